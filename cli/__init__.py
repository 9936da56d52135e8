"""The `det` / `detslurm` command line (installed as detslurm.cli)."""
