"""``import determined.pytorch.experimental``: the same module object as detslurm's."""

import sys

from detslurm.pytorch import experimental as _experimental

sys.modules[__name__] = _experimental
