"""Opening the store: engine, sessions, migrations, and SQLite settings for many processes.

Several CLI processes and the controller may write at once. SQLite in WAL mode with a busy
timeout serialises writers safely; every write goes through ``Store.tx()``, one transaction
that commits or rolls back as a whole. Work that only reads goes through ``Store.read()``: a
deferred transaction that takes no write lock, so ``det e list`` never waits for a writer.
"""

from __future__ import annotations

import contextlib
import enum
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from detslurm.errors import StoreError
from detslurm.store.fs import warn_if_network_db
from detslurm.store.locks import hold_lock
from detslurm.store.revisions import head_revision

_MIGRATIONS = Path(__file__).parent / "migrations"
# PostgreSQL advisory locks. Schema migrations take one lock for the whole database (bigint
# form); writes take one lock per owner (the two-int form, a separate key space): users of one
# shared database do not wait for each other, and one user's stuck client holds up only them.
_PG_LOCK_KEY = 0x64657473  # "dets"
_PG_LOCK_CLASS = 0x64657473
_PG_LOCK_NOT_AVAILABLE = "55P03"  # SQLSTATE of a lock_timeout
_TX_OPTION = "detslurm_tx"
_STAMP_DDL = (
    "CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL, "
    "CONSTRAINT alembic_version_pkc PRIMARY KEY (version_num))"
)


class TxKind(str, enum.Enum):
    """What a transaction may do, which decides the lock it takes when it begins."""

    WRITE = "write"  # SQLite: BEGIN IMMEDIATE; PostgreSQL: the owner's advisory lock
    READ = "read"  # SQLite: deferred BEGIN; PostgreSQL: no lock (a READ COMMITTED snapshot)
    MIGRATE = "migrate"  # PostgreSQL: the database-wide advisory lock


def display_url(url: str) -> str:
    """``url`` with its password masked, for messages and logs."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "<unparseable database URL>"


def _mask(message: str, url: str) -> str:
    """``message`` with the URL's password replaced, should a driver have echoed it."""
    try:
        password = make_url(url).password
    except ArgumentError:
        return message
    if not password:
        return message
    for form in (str(password), quote(str(password), safe="")):  # as given, and as written in the URL
        message = message.replace(form, "***")
    return message


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    # 30 s: a writer waits out another process's transaction (a tick, a create) instead of
    # failing at once with "database is locked"; _busy_is_store_error reports longer waits.
    cur.execute("PRAGMA busy_timeout=30000")
    # SQLite leaves foreign keys off per connection by default: the schema's references
    # (and their ON DELETE rules) are enforced only with this.
    cur.execute("PRAGMA foreign_keys=ON")
    # NORMAL is durable enough in WAL mode (a power cut may lose the last commits, never corrupt
    # the file) and saves an fsync per transaction on every tick.
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def _refuse_writes(session: Session, _ctx: Any, _instances: Any) -> None:
    raise StoreError("internal error: a write inside a read-only store transaction (use Store.tx())")


def _owner_key() -> int:
    # The two-int form takes int4 keys; uids beyond 2**31 wrap (a shared key only costs waiting).
    return os.getuid() % 2**31


class Store:
    """The state store. ``lock_timeout_s`` bounds how long a PostgreSQL transaction waits for
    the store's advisory lock before failing with StoreError."""

    def __init__(self, url: str, lock_timeout_s: float = 60.0) -> None:
        self.url = url
        self.display_url = display_url(url)
        self.lock_timeout_s = lock_timeout_s
        self.is_sqlite = url.startswith("sqlite")
        if self.is_sqlite:
            path = url.split("///", 1)[-1]
            if path and path != ":memory:":
                Path(path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._lock_path: str | None = path + ".migrate.lock" if path else None
            # isolation_level None: the driver's own implicit BEGIN is off, so the "begin" event
            # below decides which BEGIN each transaction issues.
            self.engine: Engine = create_engine(url, connect_args={"timeout": 30, "isolation_level": None})
            event.listen(self.engine, "connect", _sqlite_pragmas)
            # pysqlite's own transaction handling defers BEGIN; issue BEGIN IMMEDIATE ourselves
            # so two writers never both read and then fail to upgrade their lock.
            event.listen(self.engine, "begin", self._sqlite_begin)
        else:
            self._lock_path = None
            try:
                # pre_ping: the daemon keeps connections for hours, and a server restart or idle timeout
                # would otherwise fail the first tick after it.
                self.engine = create_engine(url, pool_pre_ping=True)
            except (ArgumentError, NoSuchModuleError, ImportError) as e:
                # A mistyped URL or a missing driver: say so, naming the URL without its password.
                why = _mask(str(e), url)
                raise StoreError(f"cannot open the detslurm store at {self.display_url}: {why}") from None
            if self.engine.dialect.name == "postgresql":
                # The same model as SQLite's BEGIN IMMEDIATE: one writing transaction at a time
                # (per owner). Under PostgreSQL's default READ COMMITTED, two CLI processes doing
                # read-modify-write would otherwise lose updates (seen in tests: 48 of 80 survived).
                event.listen(self.engine, "begin", self._pg_begin)
        # expire_on_commit=False: rows read in a transaction stay usable after it, so callers print
        # them without a second query (and without holding the write lock while printing).
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._read_sessions = sessionmaker(self._reader(), expire_on_commit=False)

    @staticmethod
    def _kind(conn: Any) -> TxKind:
        return TxKind(conn.get_execution_options().get(_TX_OPTION, TxKind.WRITE))

    def _sqlite_begin(self, conn: Any) -> None:
        conn.exec_driver_sql("BEGIN" if self._kind(conn) is TxKind.READ else "BEGIN IMMEDIATE")

    def _pg_begin(self, conn: Any) -> None:
        kind = self._kind(conn)
        if kind is TxKind.READ:
            return
        lock = (
            f"pg_advisory_xact_lock({_PG_LOCK_KEY})"
            if kind is TxKind.MIGRATE
            else f"pg_advisory_xact_lock({_PG_LOCK_CLASS}, {_owner_key()})"
        )
        try:
            # lock_timeout covers advisory lock waits; reset after, so it bounds only this wait.
            conn.exec_driver_sql(f"SET LOCAL lock_timeout = {int(self.lock_timeout_s * 1000)}")
            conn.exec_driver_sql(f"SELECT {lock}")
            conn.exec_driver_sql("SET LOCAL lock_timeout TO DEFAULT")
        except DBAPIError as e:
            if getattr(e.orig, "sqlstate", None) == _PG_LOCK_NOT_AVAILABLE:
                raise StoreError(
                    f"the detslurm store {self.display_url} is busy: another transaction held its lock "
                    f"for more than {self.lock_timeout_s:g} s ({lock}); try again later"
                ) from None
            raise

    def migrate(self) -> None:
        """Bring the schema to head (a no-op when it already is)."""
        # The fast path for every CLI call: one SELECT, no alembic import.
        if self._revision() == head_revision():
            return
        if self.is_sqlite and self._create_new():
            return
        from alembic import command
        from alembic.runtime.migration import MigrationContext
        from alembic.script import ScriptDirectory

        head = ScriptDirectory.from_config(_alembic_config()).get_current_head()
        lock: contextlib.AbstractContextManager[Any] = (
            hold_lock(Path(self._lock_path), timeout=-1) if self._lock_path else contextlib.nullcontext()
        )
        migrating = self.engine.execution_options(**{_TX_OPTION: TxKind.MIGRATE})
        try:
            with self._reader().connect() as conn:
                # Checked again after importing alembic: another process may have migrated meanwhile.
                if MigrationContext.configure(conn).get_current_revision() == head:
                    return
            with lock, migrating.connect() as conn, self._foreign_keys_off(conn):
                with conn.begin():
                    cfg = _alembic_config()
                    cfg.attributes["connection"] = conn
                    command.upgrade(cfg, "head")
        except OperationalError as e:
            why = _mask(str(e.orig), self.url)
            raise StoreError(f"cannot open the detslurm store at {self.display_url}: {why}") from None

    def _create_new(self) -> bool:
        """A brand-new SQLite store (no table at all): the models' schema and the head stamp in
        one transaction, instead of replaying every migration (0.25 s and importing alembic on a
        user's first `det e create`). False, touching nothing, for a store that has any table.

        The result is the schema the migrations build, as tests/unit/store/test_store.py proves by
        comparing both, table by table (columns, indexes, unique and foreign keys)."""
        from detslurm.store.models import Base

        lock: contextlib.AbstractContextManager[Any] = (
            hold_lock(Path(self._lock_path), timeout=-1) if self._lock_path else contextlib.nullcontext()
        )
        try:
            # BEGIN IMMEDIATE (a write transaction): two first commands racing to create the store
            # are serialised, and the second sees the first's tables and returns False.
            with lock, self.engine.connect() as conn, conn.begin():
                if conn.execute(text("SELECT count(*) FROM sqlite_master")).scalar():
                    return False
                Base.metadata.create_all(conn)
                # The table alembic itself creates for its stamp (same DDL), so later upgrades
                # read it as theirs.
                conn.execute(text(_STAMP_DDL))
                conn.execute(text("INSERT INTO alembic_version (version_num) VALUES (:v)"), {"v": head_revision()})
        except OperationalError as e:
            why = _mask(str(e.orig), self.url)
            raise StoreError(f"cannot open the detslurm store at {self.display_url}: {why}") from None
        return True

    @contextlib.contextmanager
    def _foreign_keys_off(self, conn: Connection) -> Iterator[None]:
        """SQLite migrations rebuild altered tables (copy, DROP, rename). With foreign keys on, the
        DROP deletes every row first and cascades (ingest offsets would vanish, and every event be
        ingested again). The pragma only takes effect outside a transaction, so it is set on the
        raw connection before the migration's transaction begins, and restored after."""
        raw = conn.connection.driver_connection if self.is_sqlite else None
        if raw is None:
            yield
            return
        raw.execute("PRAGMA foreign_keys=OFF")
        try:
            yield
            problems = raw.execute("PRAGMA foreign_key_check").fetchall()
            if problems:
                raise StoreError(f"the store migration left rows with broken references: {problems[:5]}")
        finally:
            raw.execute("PRAGMA foreign_keys=ON")

    def _reader(self) -> Engine:
        return self.engine.execution_options(**{_TX_OPTION: TxKind.READ})

    def _revision(self) -> str | None:
        try:
            with self._reader().connect() as conn:
                return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
        except Exception:  # no table yet (a new store), or the store cannot be opened: migrate says
            return None

    @contextlib.contextmanager
    def _busy_is_store_error(self) -> Iterator[None]:
        try:
            yield
        except OperationalError as e:
            if self.is_sqlite and "database is locked" in str(e.orig):
                raise StoreError(
                    f"the detslurm store {self.display_url} is busy: another process kept it locked "
                    "for more than 30 s; try again later"
                ) from None
            state = getattr(e.orig, "sqlstate", None)
            if not self.is_sqlite and (state is None or str(state).startswith("08")):
                # No SQLSTATE, or class 08: the server could not be reached or the connection broke.
                why = _mask(str(e.orig), self.url).strip()
                raise StoreError(f"cannot reach the detslurm store at {self.display_url}: {why}") from None
            raise

    @contextlib.contextmanager
    def tx(self) -> Iterator[Session]:
        """One writing transaction: commit on success, roll back on any error.

        Takes the store's write lock when it begins (SQLite: BEGIN IMMEDIATE; PostgreSQL: the
        owner's advisory lock, waiting at most ``lock_timeout_s``)."""
        with self._busy_is_store_error(), self._sessions() as session, session.begin():
            yield session

    @contextlib.contextmanager
    def read(self) -> Iterator[Session]:
        """One read-only transaction: a consistent view that takes no write lock, so it neither
        waits for writers nor holds them up. Flushing a change in it raises StoreError."""
        with self._busy_is_store_error(), self._read_sessions() as session, session.begin():
            # A read session takes no write lock, so a write in it could interleave with a writer's
            # read-modify-write; refusing the flush turns that bug into a clear error.
            event.listen(session, "before_flush", _refuse_writes)
            yield session

    def session(self) -> Session:
        return self._sessions()

    def dispose(self) -> None:
        self.engine.dispose()


def _alembic_config() -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    return cfg


def open_store(url: str, lock_timeout_s: float = 60.0) -> Store:
    """The store at ``url``, migrated to the current schema. Warns (once per process) when a
    SQLite store is on a network filesystem."""
    store = Store(url, lock_timeout_s=lock_timeout_s)
    if store.is_sqlite:
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            warn_if_network_db(Path(path))
    store.migrate()
    if store.is_sqlite:
        path = url.split("///", 1)[-1]
        if path and os.path.exists(path):
            # The store holds every experiment's config and metrics: owner-only, whatever the umask.
            os.chmod(path, 0o600)
    return store
