from detslurm import client  # noqa: F401
