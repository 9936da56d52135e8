"""``import determined.experimental.core_v2``: the same module object as detslurm's, so the
singleton's globals (``core_v2.train``...) set by ``init()`` are seen through either name."""

import sys

from detslurm.core import v2 as _v2

sys.modules[__name__] = _v2
