"""How a command gets its SSH connection."""

from __future__ import annotations

from typing import Any

from detslurm.remote.target import RemoteSettings, Target


def connection(target: Target, rs: RemoteSettings) -> Any:
    """A fresh, authenticated connection to the login node."""
    from detslurm.remote.connect import connect

    return connect(target)
