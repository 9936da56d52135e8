"""Site config values that reach the batch script are validated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from detslurm.errors import ConfigError
from detslurm.slurm.site import SIGNALS, SiteConfig, load_site_config


def _errors(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "site.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_site_config(path)
    return e.value.errors


@pytest.mark.parametrize("bad", ["USR2; touch /tmp/x #", "USR1", "SIGKILL", "STOP", "TERM", "CONT", "$(id)", ""])
def test_signal_must_be_a_known_catchable_signal(tmp_path: Path, bad: str) -> None:
    errors = _errors(tmp_path, f"signal: {json.dumps(bad)}\n")
    assert len(errors) == 1 and errors[0].startswith("<site-config>.signal: signal "), errors


def test_signal_is_normalised() -> None:
    assert SiteConfig.model_validate({"signal": "sigusr2"}).signal == "USR2"
    assert SiteConfig.model_validate({"signal": "HUP"}).signal == "HUP"
    assert SiteConfig().signal == "USR2" and "USR1" not in SIGNALS and "TERM" not in SIGNALS


@pytest.mark.parametrize(
    "bad",
    ["/tmp;id", "$(id)", "${TMPDIR:-/tmp}$(id)", "/tmp`id`", '"/tmp"', "relative/dir", "/tmp x", "/tmp\nid", "${X}"],
)
def test_node_tmpdir_is_a_safe_path(tmp_path: Path, bad: str) -> None:
    errors = _errors(tmp_path, f"node_tmpdir: {json.dumps(bad)}\n")
    assert len(errors) == 1 and errors[0].startswith("<site-config>.node_tmpdir: node_tmpdir "), errors


@pytest.mark.parametrize("good", ["${TMPDIR:-/tmp}", "/scratch/local", "${SLURM_TMPDIR:-/tmp}/det", "/l/a-b_c.d"])
def test_node_tmpdir_accepts_paths_and_defaults(good: str) -> None:
    assert SiteConfig.model_validate({"node_tmpdir": good}).node_tmpdir == good


def test_python_is_an_absolute_safe_path(tmp_path: Path) -> None:
    assert SiteConfig.model_validate({"python": "/opt/venv-3.11/bin/python3"}).python == "/opt/venv-3.11/bin/python3"
    for bad in ["python3", "/opt/x;id", "/opt/my env/python", "$(id)"]:
        errors = _errors(tmp_path, f"python: {json.dumps(bad)}\n")
        assert len(errors) == 1 and errors[0].startswith("<site-config>.python: python "), errors


def test_setup_lines_stay_verbatim_but_one_line_each(tmp_path: Path) -> None:
    line = 'module load cuda/12.1 && export FOO="$(hostname)"; echo `date`'
    assert SiteConfig.model_validate({"setup": [line]}).setup == [line]
    for bad in ["module load a\rrm -rf x", "a\x00b", "a\nb"]:
        errors = _errors(tmp_path, f"setup: [ok, {json.dumps(bad)}]\n")
        assert errors == [
            "<site-config>.setup: line 1: NUL, carriage return and newline are not allowed (one shell line per entry)"
        ]
