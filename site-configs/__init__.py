"""Site-config templates shipped as package data: generic.yaml describes every key (`det site init --example`)."""
