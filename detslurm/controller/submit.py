"""Which trials need a new run, and the plan (a :class:`RunSpec`) for each.

The same functions serve a real submission (``Controller._submit``) and the dry run of
``det e create --dry-run``, so what the dry run prints is what would be submitted.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Select, or_, select, update
from sqlalchemy.orm import Session

from detslurm.controller.config import stored_config
from detslurm.controller.executor import RunSpec
from detslurm.protocol import ExpPaths, trial_env
from detslurm.protocol.secret import SECRET_FILE_ENV, SECRET_FILE_NAME
from detslurm.store.models import Experiment, Metric, MetricPoint, RunState, Trial, TrialRun, TrialState

# PENDING counts as active: a run whose submission reply was lost may exist in Slurm already,
# and a second run beside it would train the trial twice; the controller first looks for the
# job by its identity tag (reconcile.recover).
ACTIVE_RUN = (RunState.PENDING, RunState.QUEUED, RunState.RUNNING)


def needs_run(t: Trial, busy: set[int]) -> bool:
    # One run per trial at a time: the run's checkpoint is the next run's starting point.
    if t.state != TrialState.ACTIVE or t.id in busy or t.early_stopped:
        return False
    # With 0.37-style ops, a trial whose ops are all done waits for a promotion (or closing).
    return not (t.searcher_ops and t.ops_completed >= len(t.searcher_ops))


def new_run(s: Session, exp: Experiment, t: Trial, executor_kind: str) -> TrialRun:
    # Run ids count up per trial and never reuse a number, so every run gets a fresh dir and
    # log, and events of an old run can never be read as the new one's.
    t.run_count += 1
    paths = ExpPaths(Path(exp.exp_dir)).run(t.id, t.run_count)
    run = TrialRun(
        trial_id=t.id,
        run_id=t.run_count,
        state=RunState.PENDING,
        executor=executor_kind,
        run_dir=str(paths.dir),
        log_path=str(paths.output_log),
        preempt_acked=False,
        restart_count_seen=0,
    )
    s.add(run)
    t.runs.append(run)
    if t.run_count > 1:
        # Rows past the checkpoint we resume from would be reported again: archive them so
        # no step is counted twice.
        resume_at = t.steps_completed if t.latest_checkpoint else 0
        for table in (Metric, MetricPoint):
            s.execute(
                update(table)
                .where(table.trial_id == t.id)
                .where(table.steps_completed > resume_at)
                .values(archived=True)
            )
    return run


def run_spec(exp: Experiment, t: Trial, run: TrialRun, resources_type: str) -> RunSpec:
    """The plan of one trial run (pure: reads the rows, writes nothing)."""
    cfg = stored_config(exp)
    layout = ExpPaths(Path(exp.exp_dir))
    # Only what the trial needs from us; the executor adds the submitting environment.
    env = cfg.environment.variables()
    # The trial's own checkpoint first (a restart or resume); only a trial that never saved
    # one starts from the warm-start checkpoint (source_trial_id / source_checkpoint_uuid).
    latest = t.latest_checkpoint or t.warm_start_checkpoint
    # A warm start counts from zero: the source trial's steps are not this trial's progress.
    steps = t.steps_completed if t.latest_checkpoint else 0
    env.update(
        trial_env(
            experiment_id=exp.id,
            trial_id=t.id,
            run_id=run.run_id,
            seed=t.seed,
            hparams=t.hparams,
            config=cfg.as_dict(),
            latest_checkpoint=latest,
            steps_completed=steps,
            run_dir=Path(run.run_dir),
            trial_dir=layout.trial_dir(t.id),
            exp_dir=layout.root,
            checkpoint_base=cfg.storage_base,
            resources_type=resources_type,
            slot_ids=list(range(max(1, cfg.resources.slots_per_trial))),
            # Placeholders at plan time: which nodes the job lands on is only known inside it, where
            # the launchers read the real node list from Slurm.
            container_addrs=["127.0.0.1"],
            user=exp.owner,
        )
    )
    if exp.test_mode:
        env["DET_TEST_MODE"] = "1"
    # The run's collectives authenticate with a random secret in a 0600 file of the private run
    # dir (written before submission): never derived from ids every user can read in squeue.
    env[SECRET_FILE_ENV] = str(Path(run.run_dir) / SECRET_FILE_NAME)
    return RunSpec(
        # A readable job name for squeue; identity comes from the job comment, not from this name,
        # which the user could also have chosen.
        name=f"det-e{exp.id}-t{t.id}-r{run.run_id}",
        # sys.executable: the job runs the same detslurm install as the controller submitting it.
        argv=[sys.executable, "-m", "detslurm.exec.launch"],
        env=env,
        run_dir=Path(run.run_dir),
        log_path=Path(run.log_path),
        exp_dir=layout.root,
        identity=(exp.id, t.id, run.run_id),
        config=cfg,
    )


@dataclass(frozen=True)
class Among:
    """The only trials that can need a run since the last planning: those whose rows changed
    (``changed``) and those created after it (ids above ``newest``). Without a capacity limit
    every trial that needed a run then got one, and a trial comes to need one only through a
    change of its own row or runs."""

    changed: frozenset[int]
    newest: int


def runless_trials(exp_id: int, among: Among | None = None) -> Select[Trial]:
    """The experiment's trials that may need a new run, in id order: live, not stopped by the
    searcher, and with no active run (``needs_run`` still tests their ops); ``among``: only
    those. Indexed: nobody walks every trial to find the few that need a run."""
    busy = select(TrialRun.id).where(TrialRun.trial_id == Trial.id).where(TrialRun.state.in_(ACTIVE_RUN)).exists()
    q = select(Trial).where(Trial.experiment_id == exp_id)
    if among is not None:
        q = q.where(or_(Trial.id.in_(sorted(among.changed)), Trial.id > among.newest))
    return (
        q.where(Trial.state == TrialState.ACTIVE).where(Trial.early_stopped.is_(False)).where(~busy).order_by(Trial.id)
    )


def plan_runs(
    s: Session,
    exp: Experiment,
    capacity: int | None,
    executor_kind: str,
    resources_type: str,
    among: Among | None = None,
) -> list[tuple[TrialRun, RunSpec]]:
    """New runs for every trial that needs one (up to ``capacity``; ``among``: only of those
    trials), recorded in ``s`` as PENDING, with their plans. The caller submits them, or rolls
    back (dry run)."""
    s.flush()  # trials the searcher just created need their ids (run dirs are named by them)
    new: list[tuple[Trial, TrialRun]] = []
    # Only the trials without an active run are loaded (with their runs, in one more query).
    for t in list(s.scalars(runless_trials(exp.id, among))):
        # capacity: local processes are capped (max_local_trials), Slurm's queue is not (None);
        # the rest wait for a later tick, in trial order so earlier trials go first.
        if capacity is not None and len(new) >= capacity:
            break
        if needs_run(t, set()):
            new.append((t, new_run(s, exp, t, executor_kind)))
    s.flush()  # once for all new runs: their ids
    return [(run, run_spec(exp, t, run, resources_type)) for t, run in new]
