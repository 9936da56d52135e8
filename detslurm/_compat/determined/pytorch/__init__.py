from detslurm.pytorch import *  # noqa: F403
from detslurm.pytorch import __all__  # noqa: F401
