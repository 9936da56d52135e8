"""``import determined.experimental.client``: the same module object as ``detslurm.client``
(``from determined.experimental import client`` reaches it through the package's
``__getattr__``; this file makes the dotted import work too)."""

import sys

from detslurm import client as _client

sys.modules[__name__] = _client
