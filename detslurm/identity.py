"""Who runs this process, as the operating system says (never ``$USER``/``$LOGNAME``).

Environment variables are set by whoever starts the process: ``USER=root det job update ...``
must not make a user an admin, and a daemon started from a ``sudo -E`` shell must not act under
another name. The uid is the one identity the kernel vouches for, so names come from it.
"""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass

from detslurm.errors import StateError


def os_user() -> str:
    """The login name of this process's real uid (the uid as text where no passwd entry exists,
    e.g. in a container started with an arbitrary ``--user``)."""
    uid = os.getuid()
    try:
        return pwd.getpwuid(uid).pw_name
    # No passwd entry: the uid as text still names the caller uniquely, so ownership checks
    # keep working instead of failing.
    except KeyError:
        return str(uid)


@dataclass(frozen=True)
class Scope:
    """Whose experiments a command may see and change.

    A shared PostgreSQL store holds every user's experiments. Each query and each operation is
    limited to one owner; another user's experiment is reported "not found", exactly like one
    that does not exist, so a user cannot even learn which ids are taken (docs/design/security.md).
    Only root, asking explicitly (``det --all-users``), gets a scope of every user, and even then
    nothing of another user's is ever run or ticked (that stays with its owner's daemon)."""

    owner: str | None  # None: every user's experiments (root's --all-users)

    @classmethod
    def mine(cls) -> Scope:
        """The caller's own experiments, the owner named by the OS (never by $USER)."""
        return cls(os_user())

    @classmethod
    def all_users(cls) -> Scope:
        """Every user's experiments; only root may ask (the uid, not a name, decides)."""
        # The effective uid, since root privilege is what --all-users needs; names can be spoofed.
        if os.geteuid() != 0:
            raise StateError(f"--all-users is only for root; {os_user()} sees and changes only their own experiments")
        return cls(None)

    def sees(self, owner: str) -> bool:
        """Whether an experiment of ``owner`` is visible in this scope."""
        return self.owner is None or owner == self.owner
