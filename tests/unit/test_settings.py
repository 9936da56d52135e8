"""Settings in one place: every DETSLURM_* variable is declared in detslurm/settings.py and read
through the declaration; the docs' table is the registry's; `det config` shows effective values."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
from conftest import ROOT, Det, write

from detslurm import settings
from detslurm.errors import ConfigError, DetSlurmError

SOURCES = ("detslurm", "cli", "launchers")
# Files that run where detslurm cannot be imported (see their docstrings), so they name their
# variable themselves; each name is still declared, and wrap_rank's is checked against it below.
STANDALONE = {"launchers/wrap_rank.py", "detslurm/exec/node_probe.py"}
NAME = re.compile(r"DETSLURM_[A-Z0-9_]*")
# A name anywhere in text (messages, docs, comments); not the dashboard's __DETSLURM_CONFIG__ slot.
MENTION = re.compile(r"(?<![A-Za-z0-9_])DETSLURM_[A-Z0-9_]*[A-Z0-9]")


def product_files() -> list[Path]:
    return [p for src in SOURCES for p in sorted((ROOT / src).rglob("*.py"))]


def rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def literal_names(source: str, name: str) -> list[str]:
    """Variable names written out in code: a string that is a DETSLURM_ name (or its prefix), a
    keyword argument named like one. Text that merely mentions a name (a message) is not one."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
            found.append(f"{name}:{node.lineno}: {node.value!r}")
        if isinstance(node, ast.keyword) and node.arg and NAME.fullmatch(node.arg):
            found.append(f"{name}:{node.lineno}: {node.arg}=")
    return found


def test_no_module_names_a_variable_except_the_registry() -> None:
    files = [p for p in product_files() if rel(p) not in STANDALONE and rel(p) != "detslurm/settings.py"]
    assert len(files) > 100
    assert [f for p in files for f in literal_names(p.read_text(), rel(p))] == []
    templates = {rel(p): NAME.findall(p.read_text()) for p in sorted((ROOT / "templates").rglob("*.j2"))}
    assert {k: v for k, v in templates.items() if v} == {}  # the renderer passes names in


def test_the_literal_check_catches_reads_and_writes() -> None:
    bad = (
        "a = os.environ.get('DETSLURM_DATA_DIR')\n"
        "b = env['DETSLURM_EXP_DIR']\n"
        "c = dict(env, DETSLURM_DIST_PORT='1')\n"
        "d = {'DETSLURM_TRIAL_DIR': '/x'}\n"
        "e = k.startswith('DETSLURM_DIST')\n"
        "f = os.environ.get(f'DETSLURM_{key}')\n"
    )
    assert len(literal_names(bad, "bad.py")) == 6
    ok = "a = settings.DATA_DIR.get()\nb = 'set DETSLURM_DATA_DIR to a local disk'\n"
    assert literal_names(ok, "ok.py") == []


def test_every_name_the_product_mentions_is_declared() -> None:
    texts = {rel(p): p.read_text() for p in [*product_files(), *sorted((ROOT / "templates").rglob("*.j2"))]}
    mentioned = {(n, f) for f, text in texts.items() for n in MENTION.findall(text)}
    # Prefixes in prose ("DETSLURM_*") are fine; a full name must be a declared one.
    assert sorted((n, f) for n, f in mentioned if n not in settings.REGISTRY) == []
    from detslurm.launch import wrap_rank

    assert settings.FAILED_RANKS_DIR.name == wrap_rank.FAILED_RANKS_ENV
    # Kept apart so that `det --help` does not import the settings (cli/remote/target.py).
    from detslurm.cli.remote.target import DEFAULT_PERSIST_S

    assert settings.REMOTE_PERSIST_S.default == DEFAULT_PERSIST_S


def declared_constants() -> dict[str, str]:
    """The registry's module-level names: constant -> variable name."""
    return {k: v.name for k, v in vars(settings).items() if isinstance(v, settings.Var)}


def used_constants(source: str, is_registry: bool) -> set[str]:
    """The registry constants ``source`` uses: ``settings.X`` (under any alias), names imported
    with ``from detslurm.settings import X``, and, in the registry itself, uses after declaration."""
    tree = ast.parse(source)
    aliases, used = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "detslurm":
            aliases |= {a.asname or a.name for a in node.names if a.name == "settings"}
        if isinstance(node, ast.ImportFrom) and node.module == "detslurm.settings":
            used |= {a.name for a in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            used.add(node.attr)
        if is_registry and isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            used.add(node.id)
    return used


def test_every_declared_variable_is_used() -> None:
    declared = declared_constants()
    assert len(declared) == len(settings.REGISTRY) >= 30
    used = set().union(*(used_constants(p.read_text(), rel(p) == "detslurm/settings.py") for p in product_files()))
    # wrap_rank reads FAILED_RANKS_DIR by its own copy of the name (checked equal above).
    assert sorted(set(declared) - used) == []


def test_the_settings_table_in_the_docs_is_the_registrys() -> None:
    doc = ROOT / "docs/admin/settings.md"
    assert doc.read_text() == settings.markdown(), "regenerate: python -m detslurm.settings --markdown > " + str(
        doc.relative_to(ROOT)
    )
    for name in settings.REGISTRY:
        assert f"`{name}`" in doc.read_text()


def test_a_variable_is_parsed_and_an_empty_one_is_unset() -> None:
    t = settings.SLURM_TIMEOUT_S
    assert t.get({}) == t.get({t.name: ""}) == 30.0 and t.get({t.name: "2.5"}) == 2.5
    with pytest.raises(DetSlurmError, match=r"\$DETSLURM_SLURM_TIMEOUT_S must be a number, got 'ten'"):
        t.get({t.name: "ten"})
    with pytest.raises(DetSlurmError, match=r"\$DETSLURM_DIST_PORT must be an integer"):
        settings.DIST_PORT.get({settings.DIST_PORT.name: "12.5"})
    flag = settings.ALLOW_NETWORK_DB
    assert [flag.get({flag.name: v}) for v in ("1", "yes", "0", "false", "")] == [True, True, False, False, False]
    assert settings.EXPERIMENTS_DIR.get({settings.EXPERIMENTS_DIR.name: "~/x"}) == Path.home() / "x"


def test_the_protocol_names_are_what_a_local_trial_must_not_inherit() -> None:
    names = settings.protocol_names()
    assert {"DETSLURM_DIST_SECRET", "DETSLURM_RUN_SECRET_FILE", "DETSLURM_EXP_DIR"} <= set(names)
    assert "DETSLURM_DIST_JOIN_TIMEOUT_S" not in names and "DETSLURM_DATA_DIR" not in names


def test_environment_beats_the_config_file_which_beats_the_default(
    det_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = write(det_env / "no-config.yaml", "max_local_trials: 5\npoll_interval_s: 2\nremote: {det: /opt/det}\n")
    monkeypatch.setenv("DETSLURM_POLL_INTERVAL_S", "0.25")
    monkeypatch.delenv("DETSLURM_MAX_LOCAL_TRIALS", raising=False)
    st = settings.load()
    assert (st.max_local_trials, st.poll_interval_s) == (5, 0.25)
    rows = {r.var.name: r for r in settings.effective()}
    assert (rows["DETSLURM_MAX_LOCAL_TRIALS"].value, rows["DETSLURM_MAX_LOCAL_TRIALS"].source) == (
        "5",
        settings.Source.CONFIG_FILE,
    )
    assert rows["DETSLURM_POLL_INTERVAL_S"].source is settings.Source.ENVIRONMENT
    assert (rows["DETSLURM_REMOTE_DET"].value, rows["DETSLURM_REMOTE_DET"].source.value) == ("/opt/det", "config file")
    assert (rows["DETSLURM_SLURM_TIMEOUT_S"].value, rows["DETSLURM_SLURM_TIMEOUT_S"].source.value) == (
        "30.0",
        "default",
    )
    assert rows["DETSLURM_CONFIG"].value == str(cfg)
    assert not any(r.var.kind is settings.Kind.PROTOCOL for r in rows.values())


def test_an_unknown_key_in_the_user_config_file_is_refused(det_env: Path) -> None:
    write(det_env / "no-config.yaml", "db_ulr: sqlite:///x\n")
    with pytest.raises(ConfigError, match="unknown key 'db_ulr'"):
        settings.load()


def test_det_config_prints_each_setting_its_value_and_source(det: Det, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DETSLURM_DB_URL", "postgresql+psycopg://alice:s3cret@db/detslurm")
    code, out, _ = det("config", "--json")
    assert code == 0
    rows = {r["name"]: r for r in json.loads(out)}
    assert set(rows) == {v.name for v in settings.REGISTRY.values() if v.kind is settings.Kind.SETTING}
    assert rows["DETSLURM_DB_URL"]["value"] == "postgresql+psycopg://alice:***@db/detslurm"  # never the password
    assert rows["DETSLURM_DB_URL"]["source"] == "environment" and rows["DETSLURM_DB_URL"]["key"] == "db_url"
    assert rows["DETSLURM_SLURM_TIMEOUT_S"]["source"] == "default"
    code, out, _ = det("config")
    assert code == 0 and "s3cret" not in out
    line = next(ln for ln in out.splitlines() if "DETSLURM_DB_URL" in ln)
    assert [c.strip() for c in line.split("|")][:3] == [
        "DETSLURM_DB_URL",
        "postgresql+psycopg://alice:***@db/detslurm",
        "environment",
    ]
