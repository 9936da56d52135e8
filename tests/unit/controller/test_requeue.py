"""A trial job that Slurm requeued (`scontrol requeue`, preemption on a PreemptMode=REQUEUE
partition, a node failure): squeue's restart count, parsed from real 22.05 output, and the
executor's decision (the run ended as Slurm's stop, the job is cancelled in one scancel)."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import pytest
from fake_runner import FakeRunner
from sqlalchemy import select
from test_refusals import SITE
from test_refusals import FakeSlurm as RefusalsFake

from detslurm.controller.decide import SPENDS_NO_RESTART
from detslurm.controller.executor import ExitCause, JobState
from detslurm.controller.slurm_executor import SlurmExecutor
from detslurm.protocol import BATCH_EXIT_PRINTF, exit_record_of
from detslurm.slurm.client import Result, SlurmClient
from detslurm.slurm.parse import REC_END, SEP, SQUEUE_FIELDS, SQUEUE_FORMAT, parse_squeue
from detslurm.slurm.site import SiteConfig
from detslurm.slurm.states import SlurmState
from detslurm.store import Store, Trial, TrialRun, open_store

DATA = Path(__file__).parents[2] / "data" / "slurm-22.05"


class FakeSlurm(FakeRunner):
    """squeue answers with the given records; scancel succeeds or fails like Slurm's."""

    def __init__(self, squeue: str, scancel_ok: bool = True) -> None:
        self.squeue = squeue
        self.scancel_ok = scancel_ok
        super().__init__()

    def answer(self, argv: list[str], input: Optional[str]) -> Result:
        if argv[0] == "squeue":
            return Result(0, self.squeue, "")
        if argv[0] == "scancel" and not self.scancel_ok:
            return Result(1, "", "scancel: error: Access/permission denied")
        return Result(0, "", "")

    def scancels(self) -> list[list[str]]:
        return [argv for argv in self.calls if argv[0] == "scancel"]


def test_squeue_restart_count_captured() -> None:
    """Real 22.05 output (tests/data/capture-slurm-requeue): a requeued job, a requeued array
    task beside one that runs on, and a requeued job cancelled afterwards."""
    jobs = {(j.comment, j.array_task_id): j for j in parse_squeue((DATA / "squeue-requeued.txt").read_text())}
    plain = jobs[("detslurm:exp=1,trial=1,run=1", None)]
    assert plain.state is SlurmState.PENDING and plain.restarts == 1 and plain.requeued
    assert plain.identity == (1, 1, 1) and plain.reason == "BeginTime"
    task1, task0 = jobs[("detslurm:exp=1,trial=2+,run=1", 1)], jobs[("detslurm:exp=1,trial=2+,run=1", 0)]
    assert task1.requeued and task1.identity == (1, 3, 1) and task1.state is SlurmState.PENDING
    assert not task0.requeued and task0.state is SlurmState.RUNNING and task0.identity == (1, 2, 1)
    cancelled = jobs[("detslurm:exp=1,trial=4,run=1", None)]
    assert cancelled.state is SlurmState.CANCELLED and cancelled.restarts == 1


def test_records_captured_before_the_restart_count_still_parse() -> None:
    jobs = parse_squeue((DATA / "squeue.txt").read_text())
    assert len(jobs) == 8 and all(j.restarts == 0 and not j.requeued for j in jobs)


def test_the_format_asks_squeue_for_every_field_in_full() -> None:
    # -O: each field at width 0 (never cut) with our separator, the last one ending the record.
    parts = SQUEUE_FORMAT.split(",")
    assert [p.split(":")[0] for p in parts] == SQUEUE_FIELDS and SQUEUE_FIELDS[-1] == "RestartCnt"
    assert all(p.endswith(f":0{SEP}") for p in parts[:-1]) and parts[-1].endswith(f":0{REC_END}")


def _record(job: str, state: str, restarts: int, comment: str = "detslurm:exp=1,trial=1,run=1") -> str:
    raw, _, task = job.partition("_")
    f = [job, raw, raw, task or "N/A", state, "cpu", "u", "100", "BeginTime", "", "1", "1", "N/A"]
    f += ["2026-11-23T15:10:42", "N/A", "UNLIMITED", "0", "det-e1-t1-r1", comment, str(restarts)]
    assert len(f) == len(SQUEUE_FIELDS)
    return SEP.join(f) + REC_END


def _run_dir(tmp_path: Path, name: str, code: Optional[int], signals: str = "TERM\n") -> Path:
    run = tmp_path / "exp-1-x" / "trials" / name / "runs" / "1"
    run.mkdir(parents=True)
    if code is not None:
        exit_record_of(run).write_text(BATCH_EXIT_PRINTF.replace("\\n", "\n") % (code, "7"))
    if signals:
        (run / "signals").write_text(signals)
    return run


@pytest.mark.parametrize("state", ["PENDING", "RUNNING", "REQUEUE_HOLD"])
def test_a_requeued_trial_job_ends_as_slurms_stop_and_is_to_be_cancelled(tmp_path: Path, state: str) -> None:
    """PENDING after the requeue, RUNNING the start Slurm made (it runs nothing), or held after
    a failed launch: the run ended as a preemption with the code its stopped start recorded, and
    the job is left for the controller to cancel once that end is recorded."""
    fake = FakeSlurm(_record("7", state, 1) + _record("8", "RUNNING", 0, "detslurm:exp=1,trial=2,run=1"))
    ex = SlurmExecutor(SlurmClient(fake, user="u"), SiteConfig())
    st = ex.poll({"7": _run_dir(tmp_path, "1", 0), "8": _run_dir(tmp_path, "2", None, "")})
    assert (st["7"].state, st["7"].exit_code, st["7"].cause) == (JobState.EXITED, 0, ExitCause.PREEMPTED)
    assert st["7"].detail == "REQUEUED" and st["7"].cancel_job
    assert st["8"].state is JobState.RUNNING and not st["8"].cancel_job
    assert ExitCause.PREEMPTED in SPENDS_NO_RESTART  # never charged as a restart
    assert fake.scancels() == []  # not before the run's end is in the store


def test_a_stopped_start_killed_before_its_record_is_a_stop_not_a_failure(tmp_path: Path) -> None:
    fake = FakeSlurm(_record("7", "PENDING", 1) + _record("9_1", "PENDING", 2, "detslurm:exp=1,trial=2+,run=1"))
    ex = SlurmExecutor(SlurmClient(fake, user="u"), SiteConfig())
    st = ex.poll({"7": _run_dir(tmp_path, "1", None), "9_1": _run_dir(tmp_path, "3", 143)})
    assert st["7"].cause is st["9_1"].cause is ExitCause.PREEMPTED and st["7"].exit_code is None
    assert st["9_1"].exit_code == 143 and st["7"].cancel_job and st["9_1"].cancel_job


def test_a_requeued_start_with_no_record_and_no_stop_signal_lost_its_node(tmp_path: Path) -> None:
    """Slurm requeues a job whose node failed too: its start was never signalled and never
    wrote its exit record. A node failure, also charged no restart."""
    fake = FakeSlurm(_record("7", "PENDING", 1) + _record("8", "PENDING", 1, "detslurm:exp=1,trial=2,run=1"))
    ex = SlurmExecutor(SlurmClient(fake, user="u"), SiteConfig())
    st = ex.poll({"7": _run_dir(tmp_path, "1", None, ""), "8": _run_dir(tmp_path, "2", 0, "")})
    assert (st["7"].cause, st["7"].exit_code, st["7"].detail) == (ExitCause.NODE_FAILURE, None, "REQUEUED")
    assert ExitCause.NODE_FAILURE in SPENDS_NO_RESTART and st["7"].cancel_job
    # Its step ended and the batch shell wrote the record (a preemption with a GraceTime
    # signals only the ranks): a stop, not a lost node.
    assert st["8"].cause is ExitCause.PREEMPTED


def test_a_requeued_job_still_completing_is_left_to_finish(tmp_path: Path) -> None:
    """COMPLETING: the stopped start may still be writing its checkpoint and exit record."""
    fake = FakeSlurm(_record("7", "COMPLETING", 1))
    st = SlurmExecutor(SlurmClient(fake, user="u"), SiteConfig()).poll({"7": _run_dir(tmp_path, "1", None)})
    assert st["7"].state is JobState.RUNNING and not st["7"].cancel_job


@pytest.mark.parametrize("state", ["CANCELLED", "COMPLETED"])
def test_a_requeued_job_that_has_ended_is_not_a_user_cancel(tmp_path: Path, state: str) -> None:
    """Our own scancel (should the run's end not have been recorded), or the start Slurm made
    exiting at once: the restart count keeps it Slurm's stop; nothing left to cancel."""
    fake = FakeSlurm(_record("7", state, 1))
    st = SlurmExecutor(SlurmClient(fake, user="u"), SiteConfig()).poll({"7": _run_dir(tmp_path, "1", 0)})
    assert (st["7"].state, st["7"].cause, st["7"].exit_code) == (JobState.EXITED, ExitCause.PREEMPTED, 0)
    assert not st["7"].cancel_job


def test_a_requeued_job_that_is_no_trial_is_left_to_slurm(tmp_path: Path) -> None:
    """Detached runs (users' own scripts) resume by Slurm's requeue: never cancelled."""
    fake = FakeSlurm(_record("7", "PENDING", 1, comment="my own job"))
    st = SlurmExecutor(SlurmClient(fake, user="u"), SiteConfig()).poll({"7": _run_dir(tmp_path, "1", 0)})
    assert st["7"].state is JobState.QUEUED and not st["7"].cancel_job


class Cluster(RefusalsFake):
    """The test cluster's answers; sbatch hands out job ids from 77, and each scancel records
    what the store said of the job's run at that moment."""

    def __init__(self, store: Store) -> None:
        super().__init__()
        self.store = store
        self.next_id = 77
        self.runs_at_scancel: list[list[tuple[str | None, str | None]]] = []

    def answer(self, argv: list[str], input: Optional[str]) -> Result:
        if argv[:2] == ["sbatch", "--parsable"]:
            self.next_id += 1
            return Result(0, f"{self.next_id - 1}\n", "")
        if argv[0] == "scancel":
            with self.store.read() as s:
                self.runs_at_scancel.append([(r.job_id, r.exit_reason) for r in s.scalars(select(TrialRun))])
        return super().answer(argv, input)


def one_trial(tmp_path: Path) -> tuple[Store, int, Cluster, Any]:
    """An experiment of one trial (max_restarts 0) on the fake cluster, not yet submitted:
    (store, experiment id, the fake cluster, its controller)."""
    from detslurm import settings as settings_mod
    from detslurm.controller.controller import Controller
    from detslurm.controller.create import execute_create, plan_create

    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "train.py").write_text("pass\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("name: u\nentrypoint: python3 train.py\nmax_restarts: 0\nsearcher: {name: single, metric: m}\n")
    settings = settings_mod.load()
    store = open_store(settings.db_url)
    exp_id = execute_create(store, settings, plan_create(settings, cfg, ctx), "slurm")
    fake = Cluster(store)
    ctl = Controller(store, SlurmExecutor(SlurmClient(fake, user="alice"), SITE))
    return store, exp_id, fake, ctl


def test_the_controller_records_the_stop_cancels_the_job_and_resubmits(det_env: Path, tmp_path: Path) -> None:

    store, exp_id, fake, ctl = one_trial(tmp_path)
    ctl.tick([exp_id])  # submits job 77
    fake.queue = _record("77", "COMPLETING", 1, f"detslurm:exp={exp_id},trial=1,run=1")
    ctl.tick([exp_id])  # the stopped start is still finishing: nothing decided
    assert fake.count("scancel") == 0 and fake.count("sbatch", "--parsable") == 1
    # The stopped start got Slurm's SIGTERM (its batch shell recorded it) and was killed before
    # it could write its exit record.
    with store.read() as s:
        (Path(s.scalars(select(TrialRun.run_dir)).one()) / "signals").write_text("TERM\n")
    fake.queue = _record("77", "PENDING", 1, f"detslurm:exp={exp_id},trial=1,run=1")
    ctl.tick([exp_id])
    # One scancel, sent once the run's end was in the store; the trial resumed as run 2 (job 78).
    assert fake.runs_at_scancel == [[("77", "preempted"), ("78", None)]]
    assert [c for c in fake.calls if c[0] == "scancel"] == [["scancel", "77"]]
    # Our cancel's CANCELLED (the restart count says it was requeued) changes nothing.
    fake.queue = _record("77", "CANCELLED", 1, f"detslurm:exp={exp_id},trial=1,run=1")
    fake.queue += _record("78", "RUNNING", 0, f"detslurm:exp={exp_id},trial=1,run=2")
    ctl.tick([exp_id])
    with store.read() as s:
        (trial,) = s.scalars(select(Trial)).all()
        assert trial.state == "ACTIVE" and trial.restarts == 0 and trial.run_count == 2
    assert fake.count("scancel") == 1 and fake.count("sbatch", "--parsable") == 2


def test_node_failures_in_a_row_end_up_spending_restarts(det_env: Path, tmp_path: Path) -> None:
    """A trial that loses its node every time (it brings the node down itself) is resubmitted
    for free only NODE_FAILURES_FREE times in a row; the next one spends a restart, as a crash."""
    from detslurm.controller.decide import NODE_FAILURES_FREE

    store, exp_id, fake, ctl = one_trial(tmp_path)
    ctl.tick([exp_id])  # run 1: job 77
    for n in range(1, NODE_FAILURES_FREE + 2):
        # Requeued by Slurm after its node failed: no stop signal, no exit record.
        fake.queue = _record(str(76 + n), "PENDING", 1, f"detslurm:exp={exp_id},trial=1,run={n}")
        ctl.tick([exp_id])
        with store.read() as s:
            (trial,) = s.scalars(select(Trial)).all()
            if n <= NODE_FAILURES_FREE:
                assert (trial.state, trial.restarts, trial.run_count) == ("ACTIVE", 0, n + 1), n
            else:  # one more in a row spends a restart, and max_restarts 0 allows none
                assert (trial.state, trial.restarts, trial.run_count) == ("ERROR", 1, n), n
    with store.read() as s:
        reasons = [r.exit_reason for r in s.scalars(select(TrialRun).order_by(TrialRun.run_id))]
    assert reasons == ["node failure"] * (NODE_FAILURES_FREE + 1)


@pytest.mark.parametrize("checkpoints", [False, True])
def test_preemptions_without_a_checkpoint_end_up_spending_restarts(
    det_env: Path, tmp_path: Path, checkpoints: bool
) -> None:
    """A trial stopped every time before it saves a checkpoint (its save always fails at the
    time limit's warning, or it writes its own signals file) makes no progress: it goes again
    for free only PREEMPTIONS_WITHOUT_CHECKPOINT_FREE times in a row, then spends restarts. A
    trial that saves a checkpoint in each run is resumed for free however often it is stopped."""
    from detslurm.controller.decide import PREEMPTIONS_WITHOUT_CHECKPOINT_FREE as FREE
    from detslurm.store.models import Checkpoint

    store, exp_id, fake, ctl = one_trial(tmp_path)
    ctl.tick([exp_id])  # run 1: job 77
    for n in range(1, FREE + 2):
        with store.tx() as s:
            run = s.scalars(select(TrialRun).where(TrialRun.run_id == n)).one()
            # Its batch shell recorded a stop signal; Slurm requeued the job.
            (Path(run.run_dir) / "signals").write_text("TERM\n")
            if checkpoints:
                s.add(
                    Checkpoint(
                        uuid=f"ck-{n}",
                        trial_id=run.trial_id,
                        run_id=n,
                        steps_completed=n,
                        storage_path="-",
                        metadata_={},
                        resources={},
                        size=0,
                        report_time=datetime.now(timezone.utc),
                    )
                )
        fake.queue = _record(str(76 + n), "PENDING", 1, f"detslurm:exp={exp_id},trial=1,run={n}")
        ctl.tick([exp_id])
        with store.read() as s:
            (trial,) = s.scalars(select(Trial)).all()
            if n <= FREE or checkpoints:
                assert (trial.state, trial.restarts, trial.run_count) == ("ACTIVE", 0, n + 1), n
            else:  # one more without a checkpoint spends a restart, and max_restarts 0 allows none
                assert (trial.state, trial.restarts, trial.run_count) == ("ERROR", 1, n), n
