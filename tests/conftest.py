from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


@pytest.fixture
def det_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Private detslurm dirs for one test (store, experiment dirs, checkpoints)."""
    monkeypatch.setenv("DETSLURM_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("DETSLURM_EXPERIMENTS_DIR", str(tmp_path / "exps"))
    monkeypatch.setenv("DETSLURM_CHECKPOINT_DIR", str(tmp_path / "ckpts"))
    monkeypatch.setenv("DETSLURM_CONFIG", str(tmp_path / "no-config.yaml"))
    monkeypatch.setenv("DETSLURM_POLL_INTERVAL_S", "0.1")
    for k in list(os.environ):
        if k.startswith("DET_"):
            monkeypatch.delenv(k)
    return tmp_path


@pytest.fixture
def det(det_env: Path, capsys: pytest.CaptureFixture[str]) -> Iterator[Det]:
    yield Det(capsys)


class Det:
    """Runs the real CLI entry point in-process and captures what a user would see."""

    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self.capsys = capsys

    def __call__(self, *args: str) -> tuple[int, str, str]:
        from detslurm.cli.main import main

        self.capsys.readouterr()
        code = main([str(a) for a in args])
        out, err = self.capsys.readouterr()
        return code, out, err


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


sys.path.insert(0, str(Path(__file__).parent))
