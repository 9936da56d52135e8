"""Remote mode: `det -m ssh://[user@]login[:port][/path] ...` (or ``DET_MASTER=ssh://...``) runs
every `det` command against the detslurm installed on a cluster's login node, over SSH.

Nothing here imports paramiko at module level: `det --help` and every local command must not
pay for it. ``split_master`` (pure argv/env parsing) is all that cli.main needs before dispatch.
"""

from __future__ import annotations

from detslurm.cli.remote.target import Target, split_master

__all__ = ["Target", "split_master"]
