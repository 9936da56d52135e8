"""``import determined.pytorch.deepspeed``: the same module object as detslurm's."""

import sys

from detslurm.pytorch import deepspeed as _deepspeed

sys.modules[__name__] = _deepspeed
