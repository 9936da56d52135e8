"""The object every command receives: settings, and the store opened on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from detslurm import settings as settings_mod
from detslurm.settings import Settings

if TYPE_CHECKING:  # imported on first use: `det --help` needs neither
    from detslurm.slurm.site import SiteConfig
    from detslurm.store import Store


class App:
    def __init__(self, as_json: bool = False) -> None:
        self.settings: Settings = settings_mod.load()
        self._store: Store | None = None
        self._site: SiteConfig | None = None
        self.as_json = as_json

    def site(self) -> SiteConfig:
        if self._site is None:
            from detslurm.slurm.site import load_site_config

            self._site = load_site_config()
        return self._site

    @property
    def store(self) -> Store:
        if self._store is None:
            from detslurm.store import open_store

            self._store = open_store(self.settings.db_url)
        return self._store


pass_app = click.make_pass_decorator(App)
