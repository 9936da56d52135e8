"""A private, real PostgreSQL server on loopback for tests (started as the ``postgres`` user,
which needs root; the server package is installed if missing). Same recipe as the
``postgres`` fixture of tests/unit/store/test_store.py, shared here for tests of other modules."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class PostgresUnavailable(Exception):
    """This machine cannot start a private PostgreSQL (not root)."""


@contextmanager
def private_postgres(database: str = "detslurm") -> Iterator[str]:
    """A running server with ``database`` created; yields its SQLAlchemy URL (user postgres,
    trust authentication over TCP: any local user who knows the URL gets in, which is exactly
    the "one shared database, one password" setup the multi-user tests need)."""
    if os.geteuid() != 0:
        raise PostgresUnavailable("starting a private PostgreSQL needs root (to run it as the postgres user)")
    if not glob.glob("/usr/lib/postgresql/*/bin/initdb"):
        subprocess.run(
            ["apt-get", "-o", "DPkg::Lock::Timeout=900", "install", "-y", "-qq", "postgresql"],
            check=True,
            env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"),
            capture_output=True,
        )
    bindir = Path(sorted(glob.glob("/usr/lib/postgresql/*/bin"))[-1])
    # Not under pytest's basetemp, which later pytest sessions make private again (the server
    # user could then no longer reach its data dir to stop).
    data = Path(tempfile.mkdtemp(prefix="detslurm-test-pg-"))
    shutil.chown(data, "postgres", "postgres")
    pg = ["runuser", "-u", "postgres", "--"]
    subprocess.run(
        [*pg, str(bindir / "initdb"), "-D", str(data / "db"), "-A", "trust", "-U", "postgres"],
        check=True,
        capture_output=True,
    )
    port = os.environ.get("DETSLURM_TEST_PG_PORT", "17432")
    opts = f"-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories={data}"
    ctl = [*pg, str(bindir / "pg_ctl"), "-D", str(data / "db")]
    subprocess.run([*ctl, "-l", str(data / "log"), "-w", "-o", opts, "start"], check=True, capture_output=True)
    try:
        subprocess.run([*pg, str(bindir / "createdb"), "-h", "127.0.0.1", "-p", port, database], check=True)
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/{database}"
    finally:
        subprocess.run([*ctl, "-m", "fast", "stop"], capture_output=True)
        shutil.rmtree(data, ignore_errors=True)
