"""Launchers on the real cluster: 2 nodes x 2 processes, failures, shared nodes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import write
from sqlalchemy import select

from detslurm import settings
from detslurm.store import Metric, Trial, TrialRun, open_store

torch = pytest.importorskip("torch")
FIXTURES = Path(__file__).parents[1] / "fixtures"
DDP = (
    "entrypoint: python3 -m determined.launch.torch_distributed python3 ddp_train.py\n"
    "searcher: {name: single, metric: loss}\nmax_restarts: 0\n"
)


def ctx_dir(tmp_path: Path) -> Path:
    write(tmp_path / "ctx/ddp_train.py", (FIXTURES / "ddp_train.py").read_text())
    return tmp_path / "ctx"


def validations() -> list[dict[str, Any]]:
    with open_store(settings.load().db_url).tx() as s:
        return [
            m.metrics for m in s.scalars(select(Metric).where(Metric.group == "validation").order_by(Metric.trial_id))
        ]


@pytest.mark.torch
def test_ddp_local_two_processes(det: Any, tmp_path: Path) -> None:
    cfg = write(tmp_path / "c.yaml", DDP + "resources: {slots_per_trial: 2}\n")
    code, out, err = det("e", "create", "--local", cfg, ctx_dir(tmp_path))
    assert code == 0, out + err
    assert validations() == [validations()[0]] and validations()[0]["params_equal"] == 1
    assert validations()[0]["world"] == 2


@pytest.mark.slurm
@pytest.mark.torch
@pytest.mark.usefixtures("slurm_env")
class TestOnCluster:
    def test_two_nodes_two_processes_each(self, det: Any, tmp_path: Path) -> None:
        cfg = write(tmp_path / "c.yaml", DDP + "resources: {slots_per_trial: 4}\n")
        code, out, err = det("e", "create", cfg, ctx_dir(tmp_path), "-f")
        assert code == 0, out + err
        for r, node in ((0, "c1"), (1, "c1"), (2, "c2"), (3, "c2")):
            assert f"[rank={r}] rank {r}/4 on {node}: params equal=True" in out
        (v,) = validations()
        assert v["params_equal"] == 1 and v["world"] == 4 and v["nodes"] == 2
        code, out, _ = det("t", "logs", "1", "--rank-id", "3")
        assert code == 0 and all(line.startswith("[rank=3]") for line in out.strip().splitlines())

    @pytest.mark.fault
    def test_worker_failure_stops_the_job_at_once(self, det: Any, tmp_path: Path) -> None:
        cfg = write(
            tmp_path / "c.yaml",
            DDP + "resources: {slots_per_trial: 4}\nenvironment: {environment_variables: [FAIL_RANK=3]}\n",
        )
        code, out, err = det("e", "create", cfg, ctx_dir(tmp_path))
        assert code == 0, err
        code, out, err = det("e", "wait", "1")
        assert code == 1 and "ERROR" in out
        with open_store(settings.load().db_url).tx() as s:
            (run,) = s.scalars(select(TrialRun)).all()
            (trial,) = s.scalars(select(Trial)).all()
        run_dir = Path(run.run_dir)
        failed_at = float((run_dir / "fail_time").read_text())
        down_at = (run_dir / "exit.json").stat().st_mtime
        # What this guards against is a hang: the other ranks wait in a collective that gloo
        # times out after 30 min. The speed of the stop (4.6 s on an idle 2-core machine, up to
        # 12 s on a loaded one) is bench/fail_fast.py's, against Slurm's own --kill-on-bad-exit.
        assert down_at - failed_at < 120, f"the job took {down_at - failed_at:.1f} s to go down"
        assert json.loads((run_dir / "exit.json").read_text())["code"] != 0
        assert trial.state == "ERROR" and run.exit_code != 0

    def test_two_jobs_sharing_nodes_do_not_collide(self, det: Any, tmp_path: Path) -> None:
        cfg = write(
            tmp_path / "c.yaml",
            DDP.replace("{name: single, metric: loss}", "{name: grid, metric: loss, max_concurrent_trials: 2}")
            + "resources: {slots_per_trial: 2}\nslurm: {slots_per_node: 1}\n"
            + "hyperparameters: {copy: {type: categorical, vals: [1, 2]}}\n",
        )
        code, out, err = det("e", "create", cfg, ctx_dir(tmp_path))
        assert code == 0, err
        code, out, err = det("e", "wait", "1")
        assert code == 0, out + err
        with open_store(settings.load().db_url).tx() as s:
            runs = s.scalars(select(TrialRun)).all()
        spans = []
        ports = []
        for r in runs:
            (rdv,) = Path(r.run_dir).glob("rendezvous-*.json")
            ports.append(json.loads(rdv.read_text())["master"])
            spans.append((r.start_time, r.end_time))
        assert len(runs) == 2 and ports[0] != ports[1]
        assert spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1]  # they really ran at the same time
        assert all(v["params_equal"] == 1 and v["nodes"] == 2 for v in validations())


DS = (
    "entrypoint: python3 -m determined.launch.deepspeed python3 ds_train.py\n"
    "searcher: {name: single, metric: loss}\nmax_restarts: 0\n"
)


def ds_ctx(tmp_path: Path) -> Path:
    pytest.importorskip("deepspeed")
    write(tmp_path / "ctx/ds_train.py", (FIXTURES / "ds_train.py").read_text())
    return tmp_path / "ctx"


@pytest.mark.slurm
@pytest.mark.torch
@pytest.mark.usefixtures("slurm_env")
@pytest.mark.late_build
@pytest.mark.full  # it needs DeepSpeed's CPU op, whose compile took a core for 30 min of CI's run
def test_deepspeed_zero2_two_nodes(det: Any, tmp_path: Path) -> None:
    cfg = write(tmp_path / "c.yaml", DS + "resources: {slots_per_trial: 4}\n")
    code, out, err = det("e", "create", cfg, ds_ctx(tmp_path), "-f")
    assert code == 0, out + err
    for r, node in ((0, "c1"), (1, "c1"), (2, "c2"), (3, "c2")):
        assert f"[rank={r}] rank {r}/4 on {node}: params equal=True" in out
    (v,) = validations()
    assert v["params_equal"] == 1 and v["world"] == 4 and v["nodes"] == 2


HVD = (
    "entrypoint: python3 -m determined.launch.horovod {overrides}python3 hvd_train.py\n"
    "searcher: {{name: single, metric: loss}}\nmax_restarts: 0\nresources: {{slots_per_trial: 4}}\n"
)


@pytest.mark.slurm
@pytest.mark.torch
@pytest.mark.usefixtures("slurm_env")
@pytest.mark.late_build
@pytest.mark.parametrize("mode", ["gloo", "mpi"])
def test_horovod_two_nodes(det: Any, tmp_path: Path, mode: str) -> None:
    pytest.importorskip("horovod.torch")
    write(tmp_path / "ctx/hvd_train.py", (FIXTURES / "hvd_train.py").read_text())
    # Our 4 "nodes" share one host: Open MPI's shared-memory BTL would mix up two nodes' segments,
    # so the MPI run uses TCP only (an override passed through to mpirun, as a user would).
    cfg = write(tmp_path / "c.yaml", HVD.format(overrides="--mpi --mca btl tcp,self -- " if mode == "mpi" else ""))
    code, out, err = det("e", "create", cfg, tmp_path / "ctx", "-f")
    assert code == 0, out + err
    for r in range(4):
        assert f"[rank={r}] rank {r}/4 on " in out
    (v,) = validations()
    assert v["params_equal"] == 1 and v["world"] == 4


@pytest.mark.slurm
@pytest.mark.torch
@pytest.mark.usefixtures("slurm_env")
@pytest.mark.full  # 2 x 2 DDP under a nested launcher: over 7 min of CI's run on a loaded machine
def test_pause_reaches_every_rank_through_a_nested_launcher(det: Any, tmp_path: Path) -> None:
    """`env` wrapping the launcher stands for numactl/dlprof: a nested launcher entrypoint."""
    import time as _time

    write(tmp_path / "ctx/ddp_preempt.py", (FIXTURES / "ddp_preempt.py").read_text())
    cfg = write(
        tmp_path / "c.yaml",
        "entrypoint: env NESTED=1 python3 -m determined.launch.torch_distributed "
        "python3 ddp_preempt.py\nsearcher: {name: single, metric: loss}\n"
        "resources: {slots_per_trial: 4}\n",
    )
    assert det("e", "create", cfg, tmp_path / "ctx")[0] == 0
    store = open_store(settings.load().db_url)

    def trial() -> Any:
        with store.tx() as s:
            return s.scalars(select(Trial)).first()

    deadline = _time.time() + 600  # four ranks importing torch on a busy 2-core machine
    while _time.time() < deadline and (trial() is None or trial().latest_checkpoint is None):
        _time.sleep(0.2)
    assert det("e", "pause", "1")[0] == 0
    while _time.time() < deadline and trial().state != "PAUSED":
        _time.sleep(0.2)
    t = trial()
    assert t.state == "PAUSED"
    code, out, _ = det("t", "logs", str(t.id))
    saw = [line for line in out.splitlines() if "saw the preemption" in line]
    assert len(saw) == 4 and {line.split("]")[0] for line in saw} == {f"[rank={r}" for r in range(4)}
    assert det("e", "activate", "1")[0] == 0
    code, out, err = det("e", "wait", "1")
    assert code == 0, out + err
    with store.tx() as s:
        steps = [
            m.steps_completed
            for m in s.scalars(select(Metric).where(Metric.archived.is_(False)).order_by(Metric.steps_completed))
        ]
    assert steps == list(range(1, 61))


@pytest.mark.slurm
@pytest.mark.torch
@pytest.mark.usefixtures("slurm_env")
@pytest.mark.late_build
def test_horovod_overrides_reach_every_rank_on_two_nodes(det: Any, tmp_path: Path) -> None:
    """horovodrun-spelled overrides become Horovod's variables on both nodes' workers."""
    pytest.importorskip("horovod.torch")
    probe = "import os\nprint('knobs', os.environ['HOROVOD_FUSION_THRESHOLD'], os.environ['HOROVOD_CYCLE_TIME'])\n"
    write(tmp_path / "ctx/hvd_train.py", probe + (FIXTURES / "hvd_train.py").read_text())
    timeline = tmp_path / "timeline.json"
    overrides = f"--fusion-threshold-mb 1 --cycle-time-ms 2 --timeline-filename {timeline} -- "
    cfg = write(tmp_path / "c.yaml", HVD.format(overrides=overrides))
    code, out, err = det("e", "create", cfg, tmp_path / "ctx", "-f")
    assert code == 0, out + err
    for r in range(4):
        assert f"[rank={r}] knobs 1048576 2.0" in out and f"[rank={r}] rank {r}/4 on " in out
    assert timeline.stat().st_size > 0  # Horovod itself read HOROVOD_TIMELINE


@pytest.mark.slurm
@pytest.mark.torch
@pytest.mark.usefixtures("slurm_env")
@pytest.mark.late_build
@pytest.mark.parametrize(
    "entrypoint,needs",
    [
        # In the whole suite: CI's run has Horovod's overrides on two nodes and the legacy harness
        # under Horovod (below), each a 2 x 2 start of minutes on a loaded machine.
        pytest.param(
            "python3 -m determined.launch.horovod --fusion-threshold-mb 1 --cycle-time-ms 2 -- --trial model_def:MyTrial",
            "horovod",
            marks=pytest.mark.full,
        ),
        ("python3 -m determined.launch.deepspeed --trial model_def:MyTrial", "deepspeed"),
        ("model_def:TrialClass", "horovod"),
    ],
    ids=["horovod-overrides", "deepspeed", "legacy-entrypoint"],
)
def test_seed_trial_lines_on_two_nodes(det: Any, tmp_path: Path, entrypoint: str, needs: str) -> None:
    """Seeds 000/001's `--trial` lines and legacy entrypoint, 4 slots on 2 nodes: the legacy
    harness trains as one DDP group whichever launcher started the ranks."""
    pytest.importorskip(needs)
    from test_seed_commands import LEGACY_CFG, legacy_context

    ctx = legacy_context(tmp_path)
    cfg = write(tmp_path / "c.yaml", LEGACY_CFG.format(slots=4, entrypoint=entrypoint))
    code, out, err = det("e", "create", cfg, ctx, "-f")
    assert code == 0, out + err
    code, logs, _ = det("t", "logs", "1")
    for r in range(4):
        assert f"[rank={r}] trial rank {r}/4 ddp=true" in logs, logs
    assert [v["batches"] for v in validations()] == [4, 8]
