"""The site-config template an install offers admins (docs/admin/install.md): every key of the
site config is described in site-configs/generic.yaml, the package ships it (`det site init
--example`), and `det site init` writes a file every user can read."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import ROOT
from pydantic import BaseModel

from detslurm.cli.site import _next_steps, example_text
from detslurm.expconf.load import parse_yaml
from detslurm.slurm.site import ADMIN_SITE_CONFIG, ContainerOptions, Limits, Pool, SiteConfig

GENERIC = ROOT / "site-configs" / "generic.yaml"
# A commented-out key line: "# key: value" or "#   key: value" (one "# " taken off uncomments it).
_COMMENTED_KEY = re.compile(r"^(\s*)# (\s*[a-z_]+:(\s.*)?)$")


def _keys(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    for name, field in model.model_fields.items():
        yield prefix + name
        for sub in (ContainerOptions, Limits, Pool):
            if field.annotation is sub or sub.__name__ in str(field.annotation):
                yield from _keys(sub, f"{prefix}{name}.")


def _uncommented(text: str) -> str:
    return "\n".join(_COMMENTED_KEY.sub(r"\1\2", line) for line in text.splitlines()) + "\n"


def _key_paths(node: Any, prefix: str = "") -> Iterator[str]:
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        yield prefix + key
        if prefix == "" and key == "pools":
            # A pool's name is the site's choice: each pool's keys count as "pools.KEY".
            for pool in value.values():
                yield from _key_paths(pool, "pools.")
        else:
            yield from _key_paths(value, f"{prefix}{key}.")


def test_the_template_describes_every_key_and_every_value_in_it_is_valid() -> None:
    full = yaml.safe_load(_uncommented(GENERIC.read_text()))
    described = set(_key_paths(full))
    assert set(_keys(SiteConfig)) - described == set(), "keys of the site config the template leaves out"
    assert described - set(_keys(SiteConfig)) == set(), "keys in the template the site config does not have"
    # With its commented-out keys too, it is a site config that loads.
    site = SiteConfig.model_validate(parse_yaml(_uncommented(GENERIC.read_text()), "<site-config>"))
    assert site.audit_log == "/var/log/detslurm/audit.log" and site.limits.max_time_min == 2880


def test_the_package_ships_the_template_and_det_site_init_example_prints_it(det: Any) -> None:
    assert example_text() == GENERIC.read_text()
    code, out, err = det("site", "init", "--example")
    assert code == 0 and out == GENERIC.read_text(), err


@pytest.fixture
def umask_077() -> Iterator[None]:
    old = os.umask(0o077)
    yield
    os.umask(old)


def test_site_init_writes_0644_in_0755_dirs_whatever_the_umask_and_never_overwrites_unasked(
    det: Any, tmp_path: Path, umask_077: None
) -> None:
    path = tmp_path / "etc" / "detslurm" / "site.yaml"
    code, out, err = det("site", "init", "--example", "-o", path)
    assert code == 0, err
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert [stat.S_IMODE(d.stat().st_mode) for d in (path.parent, path.parent.parent)] == [0o755, 0o755]
    assert f"Wrote {path} (mode 0644" in out and "Check it with `det site doctor`" in out
    path.write_text("default_pool: mine\n")
    code, out, err = det("site", "init", "--example", "-o", path)
    assert code == 1 and f"{path} exists; use --force" in err
    assert path.read_text() == "default_pool: mine\n"
    code, out, err = det("site", "init", "--example", "-o", path, "--force")
    assert code == 0 and path.read_text() == GENERIC.read_text(), err


def test_the_admins_file_is_told_apart_from_a_users_in_init_s_advice(tmp_path: Path) -> None:
    admin = _next_steps(ADMIN_SITE_CONFIG)
    assert "This is the admin's site file" in admin and "det site doctor" in admin
    mine = _next_steps(tmp_path / "site.yaml")
    assert "This is the admin's site file" not in mine and f"detslurm reads {ADMIN_SITE_CONFIG}" in mine


def test_only_the_admins_file_sets_the_audit_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from detslurm.slurm.site import load_site_config

    admin = tmp_path / "admin.yaml"
    admin.write_text("audit_log: /var/log/site-audit.log\n")
    admin.chmod(0o644)
    mine = tmp_path / "mine.yaml"
    mine.write_text("audit_log: /tmp/mine.log\n")
    monkeypatch.setenv("DETSLURM_SITE_CONFIG", str(mine))
    if not ADMIN_SITE_CONFIG.exists():
        monkeypatch.setenv("DETSLURM_ADMIN_SITE_CONFIG", str(admin))
        assert load_site_config().audit_log == "/var/log/site-audit.log"
    monkeypatch.delenv("DETSLURM_ADMIN_SITE_CONFIG", raising=False)
    if not ADMIN_SITE_CONFIG.exists():
        assert load_site_config().audit_log == "/tmp/mine.log"  # no admin file: root's own file is root's choice
