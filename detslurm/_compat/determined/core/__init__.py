from detslurm.core import *  # noqa: F403
from detslurm.core import __all__  # noqa: F401
