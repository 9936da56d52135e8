"""Slurm: states, parsers, the client (the only code that runs Slurm commands), rendering."""

from detslurm.slurm.client import SlurmClient, SlurmCommandError, SlurmUnavailable
from detslurm.slurm.states import SlurmState, state_from_slurm

__all__ = ["SlurmClient", "SlurmCommandError", "SlurmState", "SlurmUnavailable", "state_from_slurm"]
