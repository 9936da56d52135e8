"""Slurm's submit limits respected by throttling: ``SlurmExecutor.capacity()``
from MaxJobCount and the associations' MaxSubmitJobs minus this user's jobs in the tick's squeue
answer, and a submission refused for such a limit taken back as ``SubmitLater``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from fake_runner import FakeRunner
from sqlalchemy import select
from test_refusals import SITE, config, specs
from test_refusals import FakeSlurm as RefusalsFake
from test_requeue import _record

from detslurm.controller.executor import SubmitLater
from detslurm.controller.slurm_executor import LIMITS_TTL_S, QUEUE_STALE_S, SlurmExecutor
from detslurm.slurm.client import Result, SlurmClient
from detslurm.slurm.limits import QueueCount, SubmitLimits, headroom, is_limit_refusal
from detslurm.slurm.parse import parse_config
from detslurm.store import LogEntry, Trial, TrialRun, open_store

DATA = Path(__file__).parents[2] / "data" / "slurm-22.05"
# sbatch's stderr when an association's MaxSubmitJobs refused a job, captured on the test
# cluster (22.05, TEST_CLUSTER_ENFORCE=1, `sacctmgr modify user root set MaxSubmitJobs=1`).
REFUSED = (DATA / "sbatch-submit-limit.txt").read_text()


def show_config(max_job_count: int, accounting: bool) -> str:
    """The captured ``scontrol show config`` with MaxJobCount (and accounting) changed."""
    text = (
        (DATA / "show-config.txt")
        .read_text()
        .replace("MaxJobCount             = 10000", f"MaxJobCount = {max_job_count}")
    )
    if accounting:
        text = text.replace("accounting_storage/none", "accounting_storage/slurmdbd")
    return text


class Limited(FakeRunner):
    """A cluster with MaxJobCount and (with accounting) the captured associations, whose
    MaxSubmitJobs is 50 for root; sbatch answers ``refuse`` when set."""

    def __init__(self, max_job_count: int = 10000, accounting: bool = True) -> None:
        super().__init__()
        self.config = show_config(max_job_count, accounting)
        self.queue: list[str] = []
        self.refuse: Optional[str] = None
        self.next_id = 100

    def answer(self, argv: list[str], input: Optional[str]) -> Result:
        if argv[:3] == ["scontrol", "show", "config"]:
            return Result(0, self.config, "")
        if argv[0] == "sacctmgr":
            return Result(0, (DATA / "sacctmgr-assoc.txt").read_text(), "")
        if argv[0] == "squeue":
            return Result(0, "".join(self.queue), "")
        if argv[0] == "sbatch":
            if self.refuse is not None:
                return Result(1, "", self.refuse)
            self.next_id += 1
            return Result(0, f"{self.next_id}\n", "")
        return Result(1, "", f"{argv[0]}: unexpected")

    def hold(self, n: int, state: str = "PENDING") -> None:
        self.queue = [_record(f"9_{i}", state, 0) for i in range(n)]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def executor(fake: Limited, clock: Optional[Clock] = None) -> SlurmExecutor:
    return SlurmExecutor(SlurmClient(fake, user="root"), SITE, clock=clock or Clock())


def test_the_limits_read_from_captured_config_and_associations() -> None:
    fake = Limited(max_job_count=300)
    ex = executor(fake)
    ex.poll({"9_0": Path("/nonexistent")})  # the tick's squeue: nothing of ours queued
    # MaxSubmitJobs 50 (the captured associations) less its margin of 2; MaxJobCount 300 less 30.
    assert ex.capacity() == 48
    assert parse_config(fake.config).max_job_count == 300


def test_array_tasks_count_one_each_and_ended_ones_only_against_max_job_count() -> None:
    fake = Limited(max_job_count=100)
    ex = executor(fake)
    fake.queue = [_record(f"9_{i}", "PENDING", 0) for i in range(20)]
    fake.queue += [_record(f"8_{i}", "COMPLETED", 0) for i in range(55)]
    ex.poll({"9_0": Path("/nonexistent")})
    # MaxSubmitJobs: 50 - 2 - 20 live = 28; MaxJobCount: 100 - 10 - 75 records = 15.
    assert ex.capacity() == 15


def test_no_accounting_leaves_max_job_count_alone() -> None:
    fake = Limited(max_job_count=1000, accounting=False)
    ex = executor(fake)
    fake.hold(400)
    ex.poll({"9_0": Path("/nonexistent")})
    assert ex.capacity() == 1000 - 100 - 400
    assert not any(c[0] == "sacctmgr" for c in fake.calls)


def test_capacity_reads_no_command_per_tick_and_counts_what_it_submitted(tmp_path: Path) -> None:
    fake = Limited()
    clock = Clock()
    ex = executor(fake, clock)
    fake.hold(10)
    ex.poll({"9_0": tmp_path})
    assert ex.capacity() == 38
    before = len(fake.calls)
    ids = ex.submit_many(specs(tmp_path, config(), 5))
    assert all(isinstance(i, str) for i in ids)
    # The five array tasks count before the next squeue shows them; no query was made for it.
    assert ex.capacity() == 33
    assert [c[0] for c in fake.calls[before:]] == ["sbatch"]
    # Limits are read again only after LIMITS_TTL_S.
    clock.now += LIMITS_TTL_S + 1
    ex.capacity()
    assert sum(1 for c in fake.calls if c[0] == "sacctmgr") == 2


def test_a_throttled_executor_rereads_a_stale_queue_so_trials_never_wait_on_ended_jobs() -> None:
    fake = Limited()
    clock = Clock()
    ex = executor(fake, clock)
    fake.hold(48)
    ex.poll({"9_0": Path("/nonexistent")})
    assert ex.capacity() == 0
    fake.queue = []  # every job ended; with none of ours left no tick polls
    assert ex.capacity() == 0  # a fresh answer is not read again
    clock.now += QUEUE_STALE_S + 1
    assert ex.capacity() == 48
    assert sum(1 for c in fake.calls if c[0] == "squeue") == 2


def test_a_limit_refusal_is_submit_later_warned_once_and_learned(tmp_path: Path) -> None:
    fake = Limited()
    ex = executor(fake)
    fake.hold(7)
    ex.poll({"9_0": tmp_path})
    fake.refuse = REFUSED  # a limit we could not read (a QOS's) holds at our 7 live jobs
    first = ex.submit_many(specs(tmp_path, config(), 3))
    assert all(isinstance(r, SubmitLater) for r in first)
    assert [r.warn for r in first if isinstance(r, SubmitLater)] == [True, False, False]
    assert "AssocMaxSubmitJobLimit" in str(first[0])
    assert ex.capacity() == 1  # learned: the limit lies below 7 + 3; half of the 3 goes next
    again = ex.submit_many(specs(tmp_path, config(), 1))
    assert isinstance(again[0], SubmitLater) and not again[0].warn  # still the same stretch
    assert ex.capacity() == 0  # a lone job refused: the limit is our 7 live jobs
    fake.refuse = None
    fake.hold(5)
    ex.poll({"9_0": tmp_path})
    assert ex.capacity() == 2
    assert all(isinstance(r, str) for r in ex.submit_many(specs(tmp_path, config(), 2)))
    fake.refuse = REFUSED
    later = ex.submit_many(specs(tmp_path, config(), 1))
    assert isinstance(later[0], SubmitLater) and later[0].warn  # a new stretch warns again


def test_refusals_that_waiting_clears_told_from_those_it_never_does() -> None:
    assert is_limit_refusal(REFUSED)
    assert is_limit_refusal("sbatch: error: QOSMaxSubmitJobPerUserLimit\n")
    assert is_limit_refusal("sbatch: error: Batch job submission failed: Unable to create job record, try again")
    # The policy line alone is also what a size or time limit prints: waiting never clears it.
    assert not is_limit_refusal(
        "sbatch: error: Batch job submission failed: Job violates accounting/QOS policy "
        "(job submit limit, user's size and/or time limits)"
    )
    assert not is_limit_refusal("sbatch: error: Batch job submission failed: Invalid account")


def test_headroom_margins_and_no_limits() -> None:
    assert headroom(SubmitLimits(None, None), QueueCount(5, 5), 0) is None
    assert headroom(SubmitLimits(None, 10), QueueCount(4, 9), 3) == 3  # 10 is too small to spare one
    assert headroom(SubmitLimits(None, 100), QueueCount(90, 90), 0) == 5
    assert headroom(SubmitLimits(20, None), QueueCount(0, 30), 0) == 0  # never negative


def test_an_offline_dry_run_plans_every_trial() -> None:
    fake = Limited()
    ex = SlurmExecutor(SlurmClient(fake, user="root"), SITE, offline=True)
    assert ex.capacity() is None and fake.calls == []


class RefusingCluster(RefusalsFake):
    """The test cluster's answers; sbatch refuses for a submit limit while ``refuse`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.refuse = True
        self.next_id = 300

    def answer(self, argv: list[str], input: Optional[str]) -> Result:
        if argv[:2] == ["sbatch", "--parsable"]:
            if self.refuse:
                return Result(1, "", REFUSED)
            self.next_id += 1
            return Result(0, f"{self.next_id}\n", "")
        return super().answer(argv, input)


def test_the_controller_takes_refused_runs_back_warns_once_and_submits_later(det_env: Path, tmp_path: Path) -> None:
    from detslurm import settings as settings_mod
    from detslurm.controller.controller import Controller
    from detslurm.controller.create import execute_create, plan_create

    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "train.py").write_text("pass\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "name: u\nentrypoint: python3 train.py\nmax_restarts: 0\n"
        "hyperparameters: {x: {type: int, minval: 0, maxval: 3, count: 4}}\n"
        "searcher: {name: grid, metric: m, max_concurrent_trials: 4}\n"
    )
    settings = settings_mod.load()
    store = open_store(settings.db_url)
    exp_id = execute_create(store, settings, plan_create(settings, cfg, ctx), "slurm")
    fake = RefusingCluster()
    ctl = Controller(store, SlurmExecutor(SlurmClient(fake, user="alice"), SITE))
    ctl.tick([exp_id])  # the 4-task array is refused for the limit
    ctl.tick([exp_id])  # learned: half of it is tried next, and refused again
    with store.read() as s:
        trials = list(s.scalars(select(Trial)))
        assert [(t.state, t.run_count, t.restarts) for t in trials] == [("ACTIVE", 0, 0)] * 4
        assert list(s.scalars(select(TrialRun))) == []  # taken back: no run spent, none failed
        warnings = list(s.scalars(select(LogEntry).where(LogEntry.level == "WARNING")))
        assert len(warnings) == 1 and "AssocMaxSubmitJobLimit" in warnings[0].message
        assert not list(s.scalars(select(LogEntry).where(LogEntry.level == "ERROR")))
    assert fake.count("sbatch", "--parsable") == 2
    fake.refuse = False
    ctl.tick([exp_id])
    with store.read() as s:
        runs = list(s.scalars(select(TrialRun)))
    # Slurm took the trials it had room for; the rest wait in the store for a later tick.
    assert runs and all(r.job_id and r.run_id == 1 for r in runs)


def test_a_big_array_refused_early_halves_down_to_the_limit_it_cannot_read(tmp_path: Path) -> None:
    """An unreadable limit of 20 with 2 jobs live: the 60-task array refused teaches "below
    62", not "2"; halving finds room for 15 more instead of pinning the search at 2 jobs."""
    fake = Limited()
    ex = executor(fake)
    fake.hold(2)
    ex.poll({"9_0": tmp_path})
    fake.refuse = REFUSED
    assert all(isinstance(r, SubmitLater) for r in ex.submit_many(specs(tmp_path, config(), 40)))
    assert ex.capacity() == 20  # 2 live + 40 // 2, less the 2 live
    assert all(isinstance(r, SubmitLater) for r in ex.submit_many(specs(tmp_path, config(), 20)))
    assert ex.capacity() == 10
    fake.refuse = None
    assert all(isinstance(r, str) for r in ex.submit_many(specs(tmp_path, config(), 10)))


def test_the_first_submission_reads_the_queue_so_other_jobs_count(tmp_path: Path) -> None:
    """No job of ours polled yet (the first submission, or one after an idle stretch): the
    user's other jobs are only in a fresh answer."""
    fake = Limited()
    ex = executor(fake)
    fake.hold(45)  # the user's own jobs, submitted outside detslurm
    assert ex.capacity() == 50 - 2 - 45
    assert sum(1 for c in fake.calls if c[0] == "squeue") == 1


def test_trials_held_back_for_room_go_in_once_room_frees_with_no_change_of_ours(det_env: Path, tmp_path: Path) -> None:
    """The user's other jobs end: nothing of the experiment changed, yet the next tick submits."""
    from detslurm import settings as settings_mod
    from detslurm.controller.controller import Controller
    from detslurm.controller.create import execute_create, plan_create

    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "train.py").write_text("pass\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "name: u\nentrypoint: python3 train.py\n"
        "hyperparameters: {x: {type: int, minval: 0, maxval: 3, count: 4}}\n"
        "searcher: {name: grid, metric: m, max_concurrent_trials: 4}\n"
    )
    settings = settings_mod.load()
    store = open_store(settings.db_url)
    exp_id = execute_create(store, settings, plan_create(settings, cfg, ctx), "slurm")
    fake = Limited()
    fake.hold(47)  # MaxSubmitJobs 50 less its margin of 2: room for one
    ctl = Controller(store, SlurmExecutor(SlurmClient(fake, user="root"), SITE))
    ctl.tick([exp_id])
    with store.read() as s:
        (run,) = s.scalars(select(TrialRun)).all()
        ours = _record(str(run.job_id), "PENDING", 0, f"detslurm:exp={exp_id},trial={run.trial_id},run=1")
    fake.queue = fake.queue + [ours]
    ctl.tick([exp_id])  # still full: nothing more
    assert sum(1 for c in fake.calls if c[0] == "sbatch") == 1
    fake.queue = [ours]  # the other jobs end
    ctl.tick([exp_id])
    with store.read() as s:
        assert len(s.scalars(select(TrialRun)).all()) == 4


def test_a_timeout_keeps_what_the_command_printed() -> None:
    """sbatch resending into a full job table prints why before our timeout cuts it short."""
    from detslurm.slurm.client import SlurmCommandError, subprocess_runner

    script = "echo 'sbatch: error: Slurm job queue full, sleeping and retrying' >&2; exec sleep 5"
    try:
        subprocess_runner(["sh", "-c", script], timeout=1.0)
    except SlurmCommandError as e:
        assert e.returncode == 124 and e.reply_lost
        assert is_limit_refusal(e.stderr) and "timed out after 1 s" in e.stderr
    else:
        raise AssertionError("no timeout")


class FullTable(Limited):
    """sbatch timed out while resending into a full job table."""

    def answer(self, argv: list[str], input: Optional[str]) -> Result:
        if argv[0] == "sbatch":
            msg = "sbatch: error: Slurm job queue full, sleeping and retrying\ntimed out after 30 s"
            return Result(124, "", msg)
        return super().answer(argv, input)


def test_a_full_job_table_cut_short_is_looked_for_and_teaches_the_limit(tmp_path: Path) -> None:
    from detslurm.controller.executor import SubmitUnknown

    fake = FullTable()
    ex = executor(fake)
    fake.hold(4)
    ex.poll({"9_0": tmp_path})
    out = ex.submit_many(specs(tmp_path, config(), 6))
    # A resend may have got in before the timeout: the runs are looked for, not resubmitted.
    assert all(isinstance(r, SubmitUnknown) for r in out)
    assert ex.capacity() == 3  # and the limit is learned: below 4 live + 6 tried


class Down(Limited):
    """slurmctld stopped: every command fails as 22.05's do when it cannot be reached."""

    def __init__(self) -> None:
        super().__init__()
        self.down = True

    def answer(self, argv: list[str], input: Optional[str]) -> Result:
        if self.down:
            return Result(1, "", f"{argv[0]}: error: Unable to contact slurm controller (connect failure)\n")
        return super().answer(argv, input)


def test_trials_waiting_out_an_outage_say_why_once_and_no_sbatch_is_tried(det_env: Path, tmp_path: Path) -> None:
    from detslurm import settings as settings_mod
    from detslurm.controller.controller import Controller
    from detslurm.controller.create import execute_create, plan_create

    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "train.py").write_text("pass\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "name: u\nentrypoint: python3 train.py\n"
        "hyperparameters: {x: {type: int, minval: 0, maxval: 1, count: 2}}\n"
        "searcher: {name: grid, metric: m}\n"
    )
    settings = settings_mod.load()
    store = open_store(settings.db_url)
    exp_id = execute_create(store, settings, plan_create(settings, cfg, ctx), "slurm")
    fake = Down()
    ctl = Controller(store, SlurmExecutor(SlurmClient(fake, user="root"), SITE))

    def warnings() -> list[str]:
        with store.read() as s:
            return [e.message for e in s.scalars(select(LogEntry).where(LogEntry.level == "WARNING"))]

    ctl.tick([exp_id])
    ctl.tick([exp_id])
    assert fake.asked("sbatch") == 0  # the queue did not answer: no sbatch into a stopped slurmctld
    (said,) = warnings()  # once per outage, not per tick or per trial
    assert said.startswith("Slurm is unreachable; will submit again") and "Unable to contact" in said
    with store.read() as s:
        assert list(s.scalars(select(TrialRun))) == []
        assert [(t.run_count, t.restarts) for t in s.scalars(select(Trial))] == [(0, 0)] * 2
    fake.down = False
    ctl.tick([exp_id])
    with store.read() as s:
        assert len(s.scalars(select(TrialRun)).all()) == 2
    assert len(warnings()) == 1


class Queueing(Limited):
    """sbatch's job shows in the next squeue answer, with the comment it was submitted with."""

    def answer(self, argv: list[str], input: Optional[str]) -> Result:
        result = super().answer(argv, input)
        if argv[0] == "sbatch" and result.returncode == 0:
            comment = next(a.removeprefix("--comment=") for a in argv if a.startswith("--comment="))
            self.queue.append(_record(result.stdout.strip(), "PENDING", 0, comment))
        return result


def test_a_queue_read_before_a_submission_never_answers_a_recovery(tmp_path: Path) -> None:
    """The tick read the queue (for capacity), then submitted; the job id was lost on our side
    (a controller dying before its commit). Looking for the job must ask Slurm again: the read
    from before the sbatch would say "never submitted" and the run would be submitted twice."""
    fake = Queueing()
    ex = executor(fake)
    assert ex.capacity() is not None  # the first submission reads the queue
    (job,) = ex.submit_many(specs(tmp_path, config(), 1))
    assert ex.recover((1, 1, 1), str(tmp_path / "exp-1-abcd")) == job
