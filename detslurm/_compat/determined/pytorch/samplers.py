"""``import determined.pytorch.samplers``: the same module object as detslurm's."""

import sys

from detslurm.pytorch import samplers as _samplers

sys.modules[__name__] = _samplers
