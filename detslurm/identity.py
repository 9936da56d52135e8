"""Who runs this process, as the operating system says (never ``$USER``/``$LOGNAME``).

Environment variables are set by whoever starts the process: ``USER=root det job update ...``
must not make a user an admin, and a daemon started from a ``sudo -E`` shell must not act under
another name. The uid is the one identity the kernel vouches for, so names come from it.
"""

from __future__ import annotations

import os
import pwd


def os_user() -> str:
    """The login name of this process's real uid (the uid as text where no passwd entry exists,
    e.g. in a container started with an arbitrary ``--user``)."""
    uid = os.getuid()
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)
