"""Opening the store: engine, sessions, migrations, and SQLite settings for many processes.

Several CLI processes and the controller may write at once. SQLite in WAL mode with a busy
timeout serialises writers safely; every write goes through ``Store.tx()``, one transaction
that commits or rolls back as a whole.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import filelock
from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from detslurm.errors import StoreError

_MIGRATIONS = Path(__file__).parent / "migrations"
_PG_LOCK_KEY = 0x64657473  # "dets": the store's one advisory lock
# The newest migration's revision. A test checks it against alembic's scripts; knowing it here
# lets every CLI call open an up-to-date store without importing alembic (about 0.2 s).
HEAD_REVISION = "0001"


def _alembic_config() -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    return cfg


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


class Store:
    def __init__(self, url: str) -> None:
        self.url = url
        self.is_sqlite = url.startswith("sqlite")
        if self.is_sqlite:
            path = url.split("///", 1)[-1]
            if path and path != ":memory:":
                Path(path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._lock_path: str | None = path + ".migrate.lock" if path else None
            self.engine: Engine = create_engine(url, connect_args={"timeout": 30, "isolation_level": None})
            event.listen(self.engine, "connect", _sqlite_pragmas)

            # pysqlite's own transaction handling defers BEGIN; issue BEGIN IMMEDIATE ourselves
            # so two writers never both read and then fail to upgrade their lock.
            @event.listens_for(self.engine, "begin")
            def _begin(conn: Any) -> None:
                conn.exec_driver_sql("BEGIN IMMEDIATE")
        else:
            self._lock_path = None
            self.engine = create_engine(url, pool_pre_ping=True)
            if self.engine.dialect.name == "postgresql":
                # The same model as SQLite's BEGIN IMMEDIATE: one transaction at a time. Under
                # PostgreSQL's default READ COMMITTED, two CLI processes doing read-modify-write
                # would otherwise lose updates (seen in tests: 48 of 80 survived).
                @event.listens_for(self.engine, "begin")
                def _serialize(conn: Any) -> None:
                    conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_PG_LOCK_KEY})")

        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    def migrate(self) -> None:
        """Bring the schema to head (a no-op when it already is)."""
        if self._revision() == HEAD_REVISION:
            return
        from alembic import command
        from alembic.runtime.migration import MigrationContext
        from alembic.script import ScriptDirectory

        head = ScriptDirectory.from_config(_alembic_config()).get_current_head()
        lock: contextlib.AbstractContextManager[Any] = (
            filelock.FileLock(self._lock_path) if self._lock_path else contextlib.nullcontext()
        )
        try:
            with self.engine.connect() as conn:
                if MigrationContext.configure(conn).get_current_revision() == head:
                    return
            with lock, self.engine.begin() as conn:
                cfg = _alembic_config()
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, "head")
        except OperationalError as e:
            raise StoreError(f"cannot open the detslurm store at {self.url}: {e.orig}") from None

    def _revision(self) -> str | None:
        try:
            with self.engine.connect() as conn:
                return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
        except Exception:  # no table yet (a new store), or the store cannot be opened: migrate says
            return None

    @contextlib.contextmanager
    def tx(self) -> Iterator[Session]:
        """One transaction: commit on success, roll back on any error."""
        with self._sessions() as session, session.begin():
            yield session

    def session(self) -> Session:
        return self._sessions()

    def dispose(self) -> None:
        self.engine.dispose()


def open_store(url: str) -> Store:
    store = Store(url)
    store.migrate()
    if store.is_sqlite:
        path = url.split("///", 1)[-1]
        if path and os.path.exists(path):
            os.chmod(path, 0o600)
    return store
