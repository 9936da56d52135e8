"""End to end: real trial processes driven by the real controller through the real CLI."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLES, ROOT, write
from helpers import store, wait_for
from sqlalchemy import select

from detslurm import settings
from detslurm.store import Metric, Trial

pytestmark = pytest.mark.e2e
CORE = EXAMPLES / "core_api"
FIXTURES = Path(__file__).parents[1] / "fixtures"


def metrics(trial_id: int, group: str) -> list[tuple[int, int]]:
    with store().tx() as s:
        q = (
            select(Metric.steps_completed, Metric.run_id)
            .where(Metric.trial_id == trial_id)
            .where(Metric.group == group)
            .where(Metric.archived.is_(False))
            .order_by(Metric.steps_completed)
        )
        return [(a, b) for a, b in s.execute(q)]


def trials(exp_id: int) -> list[Trial]:
    with store().tx() as s:
        return list(s.scalars(select(Trial).where(Trial.experiment_id == exp_id).order_by(Trial.id)))


@pytest.mark.parametrize(
    "text,needle",
    [
        ("", "bad.yaml: the file is empty"),
        ("[1, 2]", "bad.yaml: must be a mapping of keys to values, got a list"),
        (
            "entrypoint: x\nmax_restarts: many\nsearcher: {name: single, metric: m}",
            "bad.yaml: max_restarts: Input should be a valid integer, got 'many'",
        ),
        (
            "entrypoint: x\nbogus: 1\nsearcher: {name: single, metric: m}",
            "bad.yaml: unknown key 'bogus'; valid keys: bind_mounts",
        ),
        ("entrypoint: x\nsearcher: {name: single}", "bad.yaml: searcher: metric is a required property"),
    ],
)
def test_bad_configs_one_clear_error(
    det: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, needle: str
) -> None:
    write(tmp_path / "bad.yaml", text)
    monkeypatch.chdir(tmp_path)
    # The error names the file as the user typed it, not Determined's "<config>" placeholder.
    code, out, err = det("e", "create", "--local", "bad.yaml", CORE)
    assert code == 1
    assert needle in err and "Traceback" not in err + out
    assert err.count("bad.yaml") == 1 and "<config>" not in err
    assert det("e", "list", "--json")[1].strip() == "[]"  # nothing was created


def test_missing_context_and_config(det: Any, tmp_path: Path) -> None:
    code, _, err = det("e", "create", "--local", tmp_path / "nope.yaml", CORE)
    assert code == 1 and "cannot read the experiment config" in err
    code, _, err = det("e", "create", "--local", CORE / "const.yaml", tmp_path / "nodir")
    assert code == 1 and "does not exist" in err
    code, _, err = det("e", "describe", "99")
    assert code == 1 and "experiment 99 not found" in err


def test_dry_run_creates_nothing(det: Any) -> None:
    code, out, _ = det("e", "create", "--dry-run", CORE / "adaptive.yaml", CORE)
    assert code == 0 and "adaptive_asha" in out and "nothing was created" in out
    assert det("e", "list", "--json")[1].strip() == "[]"


@pytest.mark.heavy
def test_adaptive_asha_search_early_stops_and_completes(det: Any) -> None:
    code, out, err = det("e", "create", "--local", CORE / "adaptive.yaml", CORE)
    assert code == 0, err
    assert "Created experiment 1" in out and "Experiment 1 COMPLETED" in out
    ts = trials(1)
    assert len(ts) >= 8
    assert all(t.state == "COMPLETED" for t in ts)
    lengths = [max(s for s, _ in metrics(t.id, "training")) for t in ts]
    assert any(n < 40 for n in lengths), lengths  # some trials were stopped early
    assert any(t.early_stopped for t in ts)
    code, out, _ = det("e", "list-checkpoints", "1")
    assert code == 0 and "COMPLETED" in out and "DELETED" in out  # GC kept only best/latest
    for cmd in (("e", "list"), ("e", "list-trials", "1"), ("e", "describe", "1"), ("t", "describe", "1")):
        code, out, _ = det(*cmd)  # states print as users know them, not as Python enum names
        assert code == 0 and "COMPLETED" in out and "State." not in out, (cmd, out)


def test_killed_trial_resumes_from_checkpoint_without_recounting(det: Any) -> None:
    code, out, err = det(
        "e",
        "create",
        "--local",
        CORE / "const.yaml",
        CORE,
        "--config",
        "environment.environment_variables=[EXAMPLE_CRASH_AT_BATCH=13]",
        "--config",
        "hyperparameters.sleep=0.01",
    )
    assert code == 0, err
    (t,) = trials(1)
    assert t.state == "COMPLETED" and t.restarts == 1 and t.run_count == 2
    train = metrics(t.id, "training")
    assert [s for s, _ in train] == list(range(1, 41))  # every step exactly once
    assert [r for s, r in train if s <= 10] == [1] * 10 and all(r == 2 for s, r in train if s > 10)
    with store().tx() as s:
        archived = s.scalars(
            select(Metric.steps_completed).where(Metric.trial_id == t.id).where(Metric.archived.is_(True))
        ).all()
    # Run 1's steps past the checkpoint are kept but not counted. The report made just before
    # the hard exit may not have reached the file (reports are written asynchronously).
    assert sorted(archived) == list(range(11, 11 + len(archived))) and 1 <= len(archived) <= 3
    code, out, _ = det("t", "logs", str(t.id))
    assert "simulated crash at batch 13" in out and "trial failed with exit code 3 (restart 1/3)" in out


def test_max_restarts_exceeded_is_an_error(det: Any, tmp_path: Path) -> None:
    write(tmp_path / "ctx/failing.py", (FIXTURES / "failing.py").read_text())
    cfg = write(
        tmp_path / "c.yaml", "entrypoint: python3 failing.py\nmax_restarts: 1\nsearcher: {name: single, metric: m}\n"
    )
    code, out, _ = det("e", "create", "--local", cfg, tmp_path / "ctx")
    assert code == 1 and "Experiment 1 ERROR" in out
    (t,) = trials(1)
    assert t.state == "ERROR" and t.restarts == 2 and "exceeded max restarts" in (t.exit_reason or "")


def test_test_mode_success_and_failure(det: Any, tmp_path: Path) -> None:
    # The example, waiting after its first checkpoint until it is told to stop (at most 600 s):
    # the stop must come from test mode, not from a race between its 40 quick batches and the
    # controller's poll on a loaded machine.
    ctx = tmp_path / "core"
    shutil.copytree(CORE, ctx)
    check = "            if ctx.preempt.should_preempt():\n"
    wait = "            end = time.time() + 600\n            while not ctx.preempt.should_preempt() and time.time() < end:\n"
    train = (ctx / "train.py").read_text()
    assert check in train
    (ctx / "train.py").write_text(train.replace(check, wait + "                time.sleep(0.1)\n" + check, 1))
    code, out, err = det("e", "create", "--local", "--test-mode", ctx / "adaptive.yaml", ctx)
    assert code == 0, err + out
    assert "Model definition test succeeded! 🎉" in out
    (t,) = trials(1)
    assert t.state == "COMPLETED" and max(s for s, _ in metrics(t.id, "training")) < 40  # stopped early
    write(tmp_path / "ctx/failing.py", (FIXTURES / "failing.py").read_text())
    cfg = write(tmp_path / "c.yaml", "entrypoint: python3 failing.py\nsearcher: {name: single, metric: m}\n")
    code, out, err = det("e", "create", "--local", "-t", cfg, tmp_path / "ctx")
    assert code == 1 and "Model definition test failed" in err and "about to fail" in err


def test_invalid_hp_trials_are_replaced(det: Any, tmp_path: Path) -> None:
    write(tmp_path / "ctx/invalid_hp.py", (FIXTURES / "invalid_hp.py").read_text())
    cfg = write(
        tmp_path / "c.yaml",
        """
entrypoint: python3 invalid_hp.py
hyperparameters: {x: {type: int, minval: 0, maxval: 9}}
searcher: {name: random, metric: loss, max_trials: 4, max_concurrent_trials: 2}
reproducibility: {experiment_seed: 5}
""",
    )
    code, out, err = det("e", "create", "--local", cfg, tmp_path / "ctx")
    assert code == 0, err
    ts = trials(1)
    valid = [t for t in ts if t.hparams["x"] % 2 == 0]
    assert len(valid) == 4 and len(ts) == 4 + sum(1 for t in ts if t.hparams["x"] % 2)


@pytest.mark.heavy
def test_037_operations_with_promotion(det: Any, tmp_path: Path) -> None:
    write(tmp_path / "ctx/ops_037.py", (FIXTURES / "ops_037.py").read_text())
    cfg = write(
        tmp_path / "c.yaml",
        """
entrypoint: python3 ops_037.py
hyperparameters: {lr: {type: double, minval: 0.01, maxval: 0.5}}
searcher: {name: adaptive_asha, metric: loss, max_trials: 6, max_length: {batches: 16}, divisor: 2,
           max_rungs: 3, mode: aggressive, max_concurrent_trials: 3}
""",
    )
    code, out, err = det("e", "create", "--local", cfg, tmp_path / "ctx")
    assert code == 0, err + out
    ts = trials(1)
    assert len(ts) == 6 and all(t.state == "COMPLETED" for t in ts)
    ops = sorted(len(t.searcher_ops) for t in ts)
    assert ops[0] == 1 and ops[-1] >= 2  # some stopped at the first rung, some were promoted
    # Determined's rung lengths, counted from the trial's start: 4, 8, then max_length itself.
    assert {tuple(t.searcher_ops) for t in ts} <= {(4,), (4, 8), (4, 8, 16)}
    promoted = [t for t in ts if len(t.searcher_ops) > 1]
    for t in promoted:  # a promoted trial resumed from its checkpoint: each step once
        assert [s for s, _ in metrics(t.id, "training")] == list(range(1, max(t.searcher_ops) + 1))


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "detslurm.cli.main", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )


def test_pause_then_activate_resumes_from_checkpoint(det: Any) -> None:
    proc = _spawn(
        "e", "create", "--local", str(CORE / "const.yaml"), str(CORE), "--config", "hyperparameters.sleep=0.1"
    )
    wait_for(lambda: bool(trials(1)) and trials(1)[0].latest_checkpoint is not None, interval=0.1)
    code, out, _ = det("e", "pause", "1")
    assert code == 0 and "Paused experiment 1" in out
    stdout, _ = proc.communicate(timeout=600)
    assert "Experiment 1 PAUSED" in stdout
    (t,) = trials(1)
    assert t.state == "PAUSED" and t.restarts == 0
    paused_at = t.steps_completed
    assert 0 < paused_at < 40
    code, out, err = det("e", "activate", "1")
    assert code == 0 and "Activated experiment 1" in out and "Experiment 1 COMPLETED" in out, err
    (t,) = trials(1)
    assert t.run_count == 2 and t.state == "COMPLETED"
    train = metrics(t.id, "training")
    assert [s for s, _ in train] == list(range(1, 41))
    assert min(s for s, r in train if r == 2) == paused_at + 1


def test_kill_and_cancel(det: Any) -> None:
    proc = _spawn(
        "e", "create", "--local", str(CORE / "const.yaml"), str(CORE), "--config", "hyperparameters.sleep=0.2"
    )
    wait_for(lambda: bool(trials(1)) and bool(metrics(trials(1)[0].id, "training")), interval=0.1)
    assert det("e", "kill", "1")[0] == 0
    stdout, _ = proc.communicate(timeout=600)
    assert "Experiment 1 CANCELED" in stdout
    assert trials(1)[0].state == "CANCELED"
    assert det("e", "pause", "1")[2].strip().endswith("experiment 1 is in incompatible state CANCELED")
    code, out, _ = det("e", "create", "--local", "--paused", CORE / "const.yaml", CORE)
    assert code == 0 and "Created experiment 2" in out
    assert det("e", "cancel", "2")[0] == 0
    assert det("e", "wait", "2")[0] == 1
    assert trials(2)[0].state == "CANCELED"


def test_reads_and_checkpoint_download(det: Any, tmp_path: Path) -> None:
    assert det("e", "create", "--local", CORE / "const.yaml", CORE, "--config", "hyperparameters.sleep=0")[0] == 0
    code, out, _ = det("e", "describe", "1")
    assert code == 0 and "Experiment:" in out and "Trials:" in out and "Workloads:" in out
    code, out, _ = det("e", "list")
    assert "core-api-const" in out and "COMPLETED" in out
    code, out, _ = det("e", "config", "1")
    assert "max_restarts: 3" in out
    (t,) = trials(1)
    code, out, _ = det("checkpoint", "download", t.latest_checkpoint, "-o", tmp_path / "dl")
    assert code == 0 and "Local checkpoint path:" in out
    assert (tmp_path / "dl/state.json").exists() and (tmp_path / "dl/metadata.json").exists()
    from detslurm import client

    ck = client.Client(store()).get_checkpoint(t.latest_checkpoint)
    assert ck.metadata["steps_completed"] == 40
    code, out, _ = det("t", "logs", str(t.id), "--tail", "1")
    assert code == 0 and len(out.strip().splitlines()) == 1
    assert det("e", "delete", "1", "--yes")[0] == 0
    assert not Path(settings.load().experiments_dir, "exp-1").exists()


@pytest.mark.heavy
def test_killed_driver_resumes_without_loss_or_duplicates(det: Any) -> None:
    """SIGKILL the controller mid-search: its trials checkpoint and stop (the kernel sends them
    the preemption signal), `det e activate` adopts those still stopping by their job ids, reads
    their exit records and resumes them, and nothing is lost or duplicated."""
    import signal

    proc = _spawn(
        "e", "create", "--local", str(CORE / "adaptive.yaml"), str(CORE), "--config", "hyperparameters.sleep=0.05"
    )
    wait_for(lambda: len(trials(1)) >= 2 and any(metrics(t.id, "validation") for t in trials(1)), interval=0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    code, out, err = det("e", "activate", "1")
    assert code == 0 and "Experiment 1 COMPLETED" in out, err + out
    ts = trials(1)
    assert len(ts) == 8 and len({t.request_id for t in ts}) == 8
    assert all(t.state == "COMPLETED" and t.restarts == 0 for t in ts)
    for t in ts:
        steps = [s for s, _ in metrics(t.id, "training")]
        assert steps == list(range(1, len(steps) + 1))  # each step exactly once
        assert t.run_count <= 2  # at most stopped by the kill (at a checkpoint) and resumed once


def test_follow_first_trial_streams_logs(det: Any) -> None:
    code, out, _ = det("e", "create", "--local", "-f", CORE / "const.yaml", CORE, "--config", "hyperparameters.sleep=0")
    assert code == 0
    assert "Following first trial with ID 1" in out and "done: w=" in out
    assert "To reopen log stream, run: det trial logs -f 1" in out
    code, out, _ = det("checkpoint", "list", "1")
    assert code == 0 and "Checkpoint UUID" in out
    code, out, _ = det("t", "describe", "1", "--json")
    assert code == 0 and '"state": "COMPLETED"' in out


def test_create_without_reachable_slurm_fails_cleanly(
    det: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "no-such-slurm.conf"))
    monkeypatch.setenv("DETSLURM_SLURM_TIMEOUT_S", "10")
    code, out, err = det("e", "create", CORE / "const.yaml", CORE)
    assert code == 1 and err.startswith("Error: ") and "Traceback" not in err
    assert "scontrol" in err or "not found" in err
    assert det("e", "list", "--json")[1].strip() == "[]"  # nothing was created


def test_help_is_fast_and_lists_every_command() -> None:
    """`det --help` loads no subcommand module (so neither the store nor Slurm code), and its
    short help for each command is the command's own."""
    import importlib
    import subprocess
    import sys

    from detslurm.cli.main import _ALIASES, _COMMANDS

    probe = (
        "import sys\nfrom detslurm.cli.main import main\nmain(['--help'])\n"
        "print(sorted(m for m in sys.modules if m.startswith(('sqlalchemy', 'detslurm.store', 'detslurm.cli.'))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    # remote.target: main() takes -m/DET_MASTER off argv before click runs (stdlib only).
    assert out.splitlines()[-1] == "['detslurm.cli.main', 'detslurm.cli.remote', 'detslurm.cli.remote.target']"
    for name, (module, attr, short) in _COMMANDS.items():
        group = getattr(importlib.import_module(f"detslurm.cli.{module}"), attr)
        assert (group.help or "").splitlines()[0] == short and f"\n  {name} " in out
    assert all(f"\n  {alias} " in out for alias in _ALIASES)


def test_container_image_is_not_silently_ignored(det: Any, tmp_path: Path) -> None:
    cfg = write(
        tmp_path / "c.yaml",
        "entrypoint: python3 train.py\nsearcher: {name: single, metric: loss}\n"
        "environment: {image: 'pytorch/pytorch:latest'}\n",
    )
    code, _, err = det("e", "create", "--dry-run", "--local", cfg, EXAMPLES / "core_api")
    assert code == 0 and "environment.image is ignored: --local runs trials with this machine's own Python" in err
