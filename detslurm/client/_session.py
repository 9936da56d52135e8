"""The session: the store as one user sees it, which every SDK object reads and changes through."""

from __future__ import annotations

from typing import TYPE_CHECKING

from detslurm import settings
from detslurm.identity import Scope

if TYPE_CHECKING:
    from detslurm.store import Store
    from detslurm.store.reads import Reads


class Session:
    """What the SDK's objects read and change through: the store (``db_url``, default the user's
    settings) limited to ``scope`` (default the calling user's own experiments)."""

    def __init__(self, db_url: str | None = None, scope: Scope | None = None, store: Store | None = None) -> None:
        self._url = db_url
        self._store = store
        self._reads: Reads | None = None
        self.scope = scope or Scope.mine()

    @property
    def owner(self) -> str | None:
        return self.scope.owner

    @property
    def store(self) -> Store:
        """The ORM store, for state changes (created or migrated on first use)."""
        if self._store is None:
            from detslurm.store import open_store

            self._store = open_store(self._url or settings.load().db_url)
        return self._store

    @property
    def reads(self) -> Reads:
        if self._reads is None:
            from detslurm.store.reads import Reads

            if self._store is not None:
                self._reads = Reads.of_store(self._store)
            else:
                url = self._url or settings.load().db_url
                self._reads = Reads.open_sqlite(url) or Reads.of_store(self.store)
        return self._reads
