"""detslurm: Determined's experiment workflow on Slurm, with no master server and no root.

The in-job API lives in :mod:`detslurm.core` (Core API) and :mod:`detslurm.pytorch` (Trainer API);
the login-node side in :mod:`detslurm.cli`, :mod:`detslurm.controller` and :mod:`detslurm.store`.
Heavy frameworks are never imported here: this module must stay cheap for `det --help`.
"""

from __future__ import annotations

__version__ = "0.1.0"

from detslurm.errors import DetSlurmError, InvalidHP

__all__ = ["DetSlurmError", "InvalidHP", "__version__"]
