"""The object every command receives: settings, and the store opened on first use."""

from __future__ import annotations

import click

from detslurm import settings as settings_mod
from detslurm.settings import Settings
from detslurm.slurm.site import SiteConfig, load_site_config
from detslurm.store import Store, open_store


class App:
    def __init__(self, as_json: bool = False) -> None:
        self.settings: Settings = settings_mod.load()
        self._store: Store | None = None
        self._site: SiteConfig | None = None
        self.as_json = as_json

    def site(self) -> SiteConfig:
        if self._site is None:
            self._site = load_site_config()
        return self._site

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = open_store(self.settings.db_url)
        return self._store


pass_app = click.make_pass_decorator(App)
