"""Determined's spellings of `det e create` options, and autohorovod's choices (local only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import write

CHECK = (
    "import os, sys\n"
    "want = {'train.py', 'data', 'notes.txt'}\n"
    "have = set(os.listdir('.'))\n"
    "missing = want - have\n"
    "ignored_kept = os.path.exists('big.bin')\n"
    "print('missing', sorted(missing), 'data file', os.path.exists('data/sub/rows.csv'), 'big', ignored_kept)\n"
    "sys.exit(1 if missing or ignored_kept or not os.path.exists('data/sub/rows.csv') else 0)\n"
)


def context(tmp_path: Path) -> tuple[Path, Path]:
    ctx = tmp_path / "ctx"
    write(ctx / "train.py", CHECK)
    write(ctx / "big.bin", "x" * 100)
    write(ctx / ".detignore", "big.bin\n*.csv\n")  # the context's patterns must not drop included files
    write(tmp_path / "data/sub/rows.csv", "a,b\n")
    write(tmp_path / "notes.txt", "n\n")
    cfg = write(tmp_path / "c.yaml", "entrypoint: python3 train.py\nsearcher: {name: single, metric: loss}\n")
    return ctx, cfg


def test_include_config_file_and_follow(det: Any, tmp_path: Path) -> None:
    ctx, cfg = context(tmp_path)
    code, out, err = det(
        "e",
        "create",
        "--config-file",
        cfg,
        ctx,
        "-i",
        tmp_path / "data",
        "--include",
        tmp_path / "notes.txt",
        "--local",
        "--follow",
    )
    assert code == 0, out + err
    assert "missing [] data file True big False" in out


def test_include_errors_and_template_name_the_problem(det: Any, tmp_path: Path) -> None:
    ctx, cfg = context(tmp_path)
    code, _, err = det("e", "create", cfg, ctx, "-i", tmp_path / "nope", "--local")
    assert code == 1 and f"--include {tmp_path / 'nope'}: no such file or directory" in err
    code, _, err = det("e", "create", cfg, ctx, "-i", ctx / "train.py", "--local")
    assert code == 1 and "the context already has an entry named 'train.py'" in err
    code, _, err = det("e", "create", cfg, ctx, "--template", "t1")
    assert code == 2 and "--template t1: config templates are not supported" in err
    code, _, err = det("e", "create")
    assert code == 2 and "missing the experiment config" in err


def test_test_alias_runs_test_mode(det: Any, tmp_path: Path) -> None:
    ctx, cfg = context(tmp_path)
    code, out, err = det("e", "create", cfg, ctx, "--local", "--test")
    # The check script reports no metrics, so test mode fails: proof that --test meant test mode.
    assert code == 1 and "Model definition test failed" in out + err


def _autohorovod(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """autohorovod where Horovod is not importable (sys.modules entry None hides it)."""
    code = (
        "import sys; sys.modules['horovod'] = None\n"
        "from detslurm.launch.autohorovod import main\n"
        f"sys.exit(main({json.dumps(args)}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DET_", "SLURM_"))}
    env["DET_SLOT_IDS"] = "[0, 1]"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
    )


# Three torch start-ups (torchrun and two ranks): 166 s in CI's local line (2026-11-27).
@pytest.mark.heavy
def test_autohorovod_without_horovod(tmp_path: Path) -> None:
    r = _autohorovod(["python3", "-c", "pass"], tmp_path)
    assert r.returncode == 2 and "several slots and Horovod is not installed" in r.stderr
    # A legacy trial falls back to torch_distributed (the harness then stops: no trial here).
    r = _autohorovod(["--trial", "model_def:MyTrial"], tmp_path)
    assert "launching the legacy trial with torch_distributed" in r.stderr, r.stderr
    assert "not running as a trial" in r.stderr and r.returncode != 0


def test_autohorovod_one_slot_runs_directly_as_rank_0(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DET_", "SLURM_"))}
    env["DET_SLOT_IDS"] = "[0]"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "detslurm.launch.autohorovod",
            sys.executable,
            "-c",
            "import os; print(os.environ.get('USE_HOROVOD'))",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout == "[rank=0] None\n"
