"""The object every command receives: settings, store, Slurm client and site config, each made
on first use and then shared by everything the command does (click's ``ctx.obj`` pattern).

Nothing heavy is imported here: `det --help` and the read commands must not pay for
SQLAlchemy, pydantic or the Slurm client before they use them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

import click

from detslurm.identity import Scope

# These types are for annotations only; importing them for real would load SQLAlchemy,
# pydantic and the Slurm client on every `det` call (see the module docstring).
if TYPE_CHECKING:
    from detslurm.audit import AuditLog
    from detslurm.settings import Settings
    from detslurm.slurm.client import Result, SlurmClient
    from detslurm.slurm.site import SiteConfig
    from detslurm.store import Store
    from detslurm.store.reads import Reads

T = TypeVar("T")


class App:
    """One per `det` process: the one place the CLI opens the store, Slurm and the configs."""

    def __init__(
        self,
        all_users: bool = False,
        argv: Sequence[str] = (),
        *,
        store: Store | None = None,
        scope: Scope | None = None,
    ) -> None:
        # The --all-users flag is only recorded here; whether the caller may use it is decided
        # lazily in `scope`, so commands that never touch the store never fail on it. A store and
        # a scope given: the Python SDK's session's (detslurm/client), whose changes are the CLI's.
        self.all_users = all_users
        self.argv = list(argv)  # the command line, for root's audit log
        self._scope: Scope | None = scope
        self._settings: Settings | None = None
        self._store: Store | None = store
        self._client: SlurmClient | None = None
        self._site: SiteConfig | None = None
        self._reads: Reads | None = None
        # Root's audit log, for an --all-users command (start_audit); None otherwise.
        self.audit: AuditLog | None = None

    def start_audit(self) -> None:
        """Record this command in root's audit log (detslurm/audit.py), once, and from now on
        every Slurm call its client makes that can change a job: for root's `det --all-users`,
        and for an admin's change to another user's job (cli/job.py)."""
        from detslurm.audit import AuditLog, audit_log_path

        if self.audit is None:
            audit = AuditLog(audit_log_path(self.site().audit_log))
            audit.command(self.argv)
            self.audit = audit

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            # Imported on first use, not at module top, so that `det --help` stays cheap.
            from detslurm import settings as settings_mod

            self._settings = settings_mod.load()
        return self._settings

    @property
    def store(self) -> Store:
        if self._store is None:
            from detslurm.store import open_store

            # One store per process: commands open short read/write sessions on it instead of
            # reconnecting (SQLite file or PostgreSQL, by the settings' db_url).
            self._store = open_store(self.settings.db_url)
        return self._store

    @property
    def reads(self) -> Reads:
        """The read layer every read command asks (store.reads). On a SQLite store whose schema
        is current it runs on the standard library's sqlite3, with no ORM to import; otherwise
        the ORM store is opened first (it migrates) and the same queries run through it."""
        if self._reads is None:
            from detslurm.store.reads import Reads

            url = self.settings.db_url
            reads = Reads.open_sqlite(url)
            if reads is None:
                store = self.store  # creates or migrates the store
                reads = Reads.open_sqlite(url) or Reads.of_store(store)
            self._reads = reads
        return self._reads

    @property
    def scope(self) -> Scope:
        """Whose experiments this command sees and changes: the caller's own, or every user's
        for root's explicit `det --all-users` (anyone else asking gets a clear error)."""
        if self._scope is None:
            self._scope = Scope.all_users() if self.all_users else Scope.mine()
        return self._scope

    @property
    def client(self) -> SlurmClient:
        """The process's one Slurm client (it caches `scontrol show config` for the process)."""
        if self._client is None:
            from detslurm.slurm.client import client_from_env

            self._client = client_from_env(self._run_slurm)
        return self._client

    def _run_slurm(
        self, argv: Sequence[str], *, input: str | None = None, timeout: float, env: Mapping[str, str] | None = None
    ) -> Result:
        """The client's runner: through the audit log once one is started (start_audit)."""
        from detslurm.slurm.client import subprocess_runner

        run = self.audit.runner(subprocess_runner) if self.audit else subprocess_runner
        return run(argv, input=input, timeout=timeout, env=env)

    # Read lazily: commands that never submit or list pools do not read the site file at all.
    def site(self) -> SiteConfig:
        """The site config (pools, partitions, poll floor)."""
        if self._site is None:
            from detslurm.slurm.site import load_site_config

            self._site = load_site_config()
        return self._site

    def poll_until(self, step: Callable[[], T | None]) -> T:
        """Call ``step`` every poll interval until it returns something other than None.

        Every waiting loop of the CLI (wait, follow, drive) is this; ``step`` does one round of
        work and says whether it is done."""
        while True:
            result = step()
            if result is not None:
                return result
            # Sleep between rounds, not a busy loop: every waiting CLI polls the store (and through it
            # Slurm), so the settings' interval bounds the load many waiting users put on them.
            time.sleep(self.settings.poll_interval_s)


# click's pattern for one shared state object: the root group puts an App into ctx.obj and
# every subcommand receives it through this decorator.
pass_app = click.make_pass_decorator(App)
