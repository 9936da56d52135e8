"""Holds the `determined` compatibility package. This directory is put on PYTHONPATH inside
trials (unless a real `determined` is importable), never installed as a top-level package."""
