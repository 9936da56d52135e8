"""Trials inside real Podman containers on the test cluster (site-configs/test-cluster-podman.yaml).

The image is a bookworm rootfs with python3 only (scripts/test-image, built once and cached):
detslurm's in-job side comes from the host by a read-only bind mount, which is what these tests
prove. No torch in the image, so the trials use the Core API (the 2-node one its distributed
context over TCP). Apptainer, Singularity and pyxis are checked by rendering only
(tests/unit/slurm/test_containers.py).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, write
from helpers import store, wait_for
from sqlalchemy import select
from test_slurm_cluster import CORE, FIXTURES, squeue_ids, steps, trials

from detslurm.store import Experiment, Metric, TrialRun

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_env")]
KILL_WAIT_S = 15  # scripts/test-cluster's KillWait
BAD_IMAGE = "localhost/detslurm-no-such-image:1"
# Where the trial looks to learn it runs in a container: podman writes this file into every one.
PROBE = """\
import os, sys
import determined as det
inside = os.path.exists("/run/.containerenv")
lr = det.get_cluster_info().trial.hparams.get("lr", 0)
print(f"in container: {inside}; python {sys.executable}; detslurm from {det.__file__}", flush=True)
with det.core.init() as ctx:
    ctx.train.report_validation_metrics(1, {"loss": 0.0, "inside": int(inside), "lr": lr})
"""


@pytest.fixture(scope="session")
def image() -> str:
    """The test image, built by scripts/test-image on first use (about a minute), then cached."""
    if shutil.which("podman") is None and shutil.which("apt-get") is None:
        pytest.skip("podman is not installed and cannot be (no apt-get)")
    out = subprocess.run([str(ROOT / "scripts/test-image")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(autouse=True)
def podman_site(slurm_env: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("DETSLURM_SITE_CONFIG", str(ROOT / "site-configs/test-cluster-podman.yaml"))
    yield


def _runs(trial_id: int) -> list[TrialRun]:
    with store().tx() as s:
        return list(s.scalars(select(TrialRun).where(TrialRun.trial_id == trial_id).order_by(TrialRun.run_id)))


def _validation(exp: int) -> dict[str, Any]:
    with store().tx() as s:
        (m,) = s.scalars(select(Metric).where(Metric.group == "validation").where(Metric.trial_id == trials(exp)[0].id))
        return dict(m.metrics)


def _exp_state(exp: int) -> str:
    with store().tx() as s:
        e = s.get(Experiment, exp)
        assert e is not None
        return str(e.state.value)


def test_single_node_trial_runs_inside_the_image(det: Any, image: str, tmp_path: Path) -> None:
    write(tmp_path / "ctx/probe.py", PROBE)
    cfg = write(
        tmp_path / "c.yaml",
        f"entrypoint: python3 probe.py\nsearcher: {{name: single, metric: loss}}\nmax_restarts: 0\n"
        f"environment: {{image: {image}}}\n",
    )
    code, out, err = det("e", "create", cfg, tmp_path / "ctx", "-f")
    assert code == 0, out + err
    # The image's interpreter, with detslurm imported from the read-only library mount.
    assert "in container: True; python /usr/bin/python3; detslurm from /opt/detslurm/lib/" in out, out
    assert _exp_state(1) == "COMPLETED" and _validation(1)["inside"] == 1


def test_a_job_array_of_container_trials(det: Any, image: str, tmp_path: Path) -> None:
    # Trials that start together share one sbatch (a job array): each task's own DET_* variables
    # still reach its container.
    write(tmp_path / "ctx/probe.py", PROBE)
    cfg = write(
        tmp_path / "c.yaml",
        "entrypoint: python3 probe.py\nsearcher: {name: grid, metric: loss, max_length: 1}\nmax_restarts: 0\n"
        f"hyperparameters: {{lr: {{type: categorical, vals: [1, 2]}}}}\nenvironment: {{image: {image}}}\n",
    )
    code, out, err = det("e", "create", cfg, tmp_path / "ctx")
    assert code == 0, err
    code, out, err = det("e", "wait", "1")
    assert code == 0, out + err
    with store().tx() as s:
        runs = list(s.scalars(select(TrialRun).order_by(TrialRun.trial_id)))
        lrs = sorted(m.metrics["lr"] for m in s.scalars(select(Metric).where(Metric.group == "validation")))
    assert [r.job_id.split("_")[1] for r in runs] == ["0", "1"]  # one array, one task each
    assert lrs == [1, 2]


def test_two_nodes_one_container_each(det: Any, image: str, tmp_path: Path) -> None:
    write(tmp_path / "ctx/two_node.py", (FIXTURES / "two_node.py").read_text())
    cfg = write(
        tmp_path / "c.yaml",
        "entrypoint: python3 two_node.py\nsearcher: {name: single, metric: loss}\nmax_restarts: 0\n"
        f"resources: {{slots_per_trial: 4}}\nenvironment: {{image: {image}}}\n",
    )
    code, out, err = det("e", "create", cfg, tmp_path / "ctx", "-f")
    assert code == 0, out + err
    # Both containers met over the host network (rendezvous on the chief node's address).
    v = _validation(1)
    assert (v["nodes"], v["ranks"]) == (2, 2), out
    assert "rank 0 of 2 on c1" in out and "rank 1 of 2 on c2" in out, out


def test_preemption_checkpoints_through_the_container_and_resumes(det: Any, image: str) -> None:
    code, _, err = det(
        "e",
        "create",
        CORE / "const.yaml",
        CORE,
        "--config",
        "hyperparameters.sleep=1.0",
        "--config",
        "slurm.sbatch_args=[--nodelist=c1]",
        "--config",
        f"environment.image={image}",
    )
    assert code == 0, err
    tid = trials(1)[0].id
    wait_for(lambda: bool(_runs(tid)) and _runs(tid)[-1].job_id in squeue_ids())
    wait_for(lambda: trials(1)[0].latest_checkpoint is not None)
    job = str(_runs(tid)[-1].job_id)
    t0 = time.monotonic()
    # A job of the high partition preempts ours: Slurm's SIGTERM goes to `podman run`, which
    # passes it into the container, where the trial checkpoints and exits.
    subprocess.run(
        ["sbatch", "-p", "high", "-w", "c1", "-c", "2", "-o", "/dev/null", "--wrap", "sleep 1"],
        check=True,
        capture_output=True,
    )
    wait_for(lambda: job not in squeue_ids(), KILL_WAIT_S + 10)
    assert time.monotonic() - t0 < KILL_WAIT_S + 10
    code, out, err = det("e", "wait", "1")
    assert code == 0, out + err
    (t,) = trials(1)
    assert t.run_count >= 2 and t.restarts == 0
    assert [s for s, _ in steps(t.id)] == list(range(1, 41))  # nothing lost, nothing counted twice
    assert _runs(t.id)[0].preempt_acked


def test_time_limit_warning_reaches_the_container(det: Any, image: str) -> None:
    # The site's warning signal (USR2, signal_lead_s before the time limit) goes to the batch
    # shell, which passes it to `podman run` (and into the container) and records it.
    code, _, err = det(
        "e", "create", CORE / "const.yaml", CORE, "--config", "hyperparameters.sleep=1.0",
        "--config", f"environment.image={image}",
    )  # fmt: skip
    assert code == 0, err
    tid = trials(1)[0].id
    wait_for(lambda: trials(1)[0].latest_checkpoint is not None and bool(_runs(tid)) and bool(_runs(tid)[-1].job_id))
    subprocess.run(["scancel", "--signal=USR2", "--batch", str(_runs(tid)[-1].job_id)], check=True)
    code, out, err = det("e", "wait", "1")
    assert code == 0, out + err
    (t,) = trials(1)
    assert t.run_count == 2 and t.restarts == 0
    assert [s for s, _ in steps(t.id)] == list(range(1, 41))
    assert _runs(t.id)[0].preempt_acked


def test_missing_image_errors_without_retries(det: Any, tmp_path: Path) -> None:
    write(tmp_path / "ctx/probe.py", PROBE)
    cfg = write(
        tmp_path / "c.yaml",
        "entrypoint: python3 probe.py\nsearcher: {name: single, metric: loss}\nmax_restarts: 5\n"
        f"environment: {{image: {BAD_IMAGE}}}\n",
    )
    code, out, err = det("e", "create", cfg, tmp_path / "ctx")
    assert code == 0, err
    code, out, _ = det("e", "wait", "1")
    assert code == 1 and _exp_state(1) == "ERROR", out
    (t,) = trials(1)
    # One run, no restart spent: the next run would have failed the same way.
    assert (t.state.value, t.restarts, t.run_count) == ("ERROR", 0, 1)
    (run,) = _runs(t.id)
    assert run.exit_reason == "image unavailable" and run.exit_code == 125
    code, logs, _ = det("t", "logs", str(t.id))
    # Podman's own message, then ours.
    assert f"Error: initializing source docker://{BAD_IMAGE}" in logs, logs
    assert "the container runtime (podman) could not provide the trial's image" in logs


def test_the_trials_exit_code_passes_through_the_container(det: Any, image: str, tmp_path: Path) -> None:
    write(tmp_path / "ctx/fail.py", "import sys\nprint('failing on purpose', flush=True)\nsys.exit(7)\n")
    cfg = write(
        tmp_path / "c.yaml",
        "entrypoint: python3 fail.py\nsearcher: {name: single, metric: loss}\nmax_restarts: 0\n"
        f"environment: {{image: {image}}}\n",
    )
    code, out, err = det("e", "create", cfg, tmp_path / "ctx")
    assert code == 0, err
    code, out, _ = det("e", "wait", "1")
    assert code == 1 and _exp_state(1) == "ERROR", out
    (run,) = _runs(trials(1)[0].id)
    # The trial's own failure, counted as one (not an image problem).
    assert (run.exit_code, run.exit_reason) == (7, "failed")


def test_dry_run_shows_the_container_command_slurm_receives(det: Any, image: str) -> None:
    from test_dry_run_cluster import normalize, our_jobs, stored_script, submissions

    # Jobs of the module's earlier tests may still be leaving the queue: compare with ours only.
    before = set(our_jobs())

    # A fixed seed: the default experiment seed comes from the clock, and the dry run and the
    # create one second later would differ in it (and in the trial seed drawn from it).
    over = ["--config", "hyperparameters.sleep=0.3", "--config", f"environment.image={image}"]
    over += ["--config", "reproducibility.experiment_seed=7"]
    code, dry, err = det("e", "create", "--dry-run", CORE / "const.yaml", CORE, *over)
    assert code == 0, err
    ((_, script),) = submissions(dry)
    assert f"--ulimit nofile=1024:1024 --ulimit nproc=4096:4096 {image} python3 -m detslurm.exec.launch &" in script
    assert det("e", "create", "--paused", CORE / "const.yaml", CORE, *over)[0] == 0
    assert det("e", "activate", "1")[0] == 0
    # Same script, the in-job library's content key included.
    deadline = time.time() + 60
    while not (mine := sorted(set(our_jobs()) - before)) and time.time() < deadline:
        time.sleep(0.3)
    assert len(mine) == 1, f"expected this experiment's one job, saw {mine}"
    assert normalize(stored_script(mine[0])) == normalize(script)
    assert det("e", "kill", "1")[0] == 0
