"""Holds the `determined` compatibility package. This directory is put on PYTHONPATH inside
trials (unless a real `determined` is importable) and found everywhere else through finder.py
(installed by detslurm-determined.pth); never installed as a top-level package."""
