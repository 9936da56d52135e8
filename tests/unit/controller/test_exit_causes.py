"""Slurm state -> job state -> exit cause are total tables, and restart accounting reads causes."""

from __future__ import annotations

from pathlib import Path

import pytest

from detslurm.controller.decide import SPENDS_NO_RESTART
from detslurm.controller.executor import ExitCause, JobState
from detslurm.controller.slurm_status import EXIT_CAUSE, JOB_STATE
from detslurm.controller.slurm_status import ended as _ended
from detslurm.slurm.states import SLURM_STATES, SlurmState, state_from_slurm


@pytest.mark.parametrize("text", sorted(SLURM_STATES))
def test_every_2205_state_has_a_job_state_and_terminal_ones_a_cause(text: str) -> None:
    state = state_from_slurm(text)
    assert state in JOB_STATE
    assert (JOB_STATE[state] is JobState.EXITED) == state.is_terminal
    if state.is_terminal:
        assert state in EXIT_CAUSE


def test_unknown_state_of_a_newer_slurm_counts_as_active() -> None:
    assert state_from_slurm("SOMETHING_NEW") is SlurmState.UNKNOWN
    assert JOB_STATE[SlurmState.UNKNOWN] is JobState.RUNNING


@pytest.mark.parametrize(
    "state,code,cause",
    [
        (SlurmState.PREEMPTED, None, ExitCause.PREEMPTED),
        (SlurmState.PREEMPTED, 0, ExitCause.PREEMPTED),
        (SlurmState.NODE_FAIL, None, ExitCause.NODE_FAILURE),
        (SlurmState.BOOT_FAIL, None, ExitCause.NODE_FAILURE),
        (SlurmState.TIMEOUT, 143, ExitCause.TIME_LIMIT),
        (SlurmState.CANCELLED, None, ExitCause.CANCELED_BY_USER),
        (SlurmState.OUT_OF_MEMORY, 137, ExitCause.FAILED),
        (SlurmState.COMPLETED, 0, ExitCause.COMPLETED),
        (SlurmState.COMPLETED, None, ExitCause.FAILED),  # ended without its own exit record
        (None, 0, ExitCause.COMPLETED),  # left the queue; the run's record says how
        (None, 3, ExitCause.FAILED),
    ],
)
def test_ended_job_cause(state: SlurmState | None, code: int | None, cause: ExitCause) -> None:
    status = _ended(state, code)
    assert (status.state, status.exit_code, status.cause) == (JobState.EXITED, code, cause)


def test_causes_that_spend_no_restart_are_the_clusters_or_ours() -> None:
    assert {ExitCause.PREEMPTED, ExitCause.NODE_FAILURE, ExitCause.NEVER_STARTED} == SPENDS_NO_RESTART


def test_every_cause_has_its_text_and_legacy_strings_map() -> None:
    assert all(c.text for c in ExitCause)
    assert ExitCause.parse("canceled") is ExitCause.CANCELED_BY_USER
    assert ExitCause.parse("job left the queue without an exit record") is ExitCause.LOST
    assert ExitCause.parse("preempted") is ExitCause.PREEMPTED
    assert ExitCause.parse("no such cause") is None and ExitCause.parse(None) is None


def test_a_stop_signal_that_kills_the_trial_is_not_its_failure(tmp_path: Path) -> None:
    """Seen in the stress test: SIGTERM landed after the trial had finished and closed its
    context; it died of the signal (exit 241) and was charged a restart. The batch shell's
    record of the signal makes it a stop, resubmitted from the checkpoint without a charge."""
    from detslurm.controller.slurm_status import ended as _ended
    from detslurm.controller.slurm_status import stop_signalled as _stop_signalled
    from detslurm.slurm.states import SlurmState

    run = tmp_path / "exp-1-x" / "trials" / "1" / "runs" / "4"
    run.mkdir(parents=True)
    assert not _stop_signalled(run) and not _stop_signalled(tmp_path)
    (run / "signals").write_text("TERM\n")
    assert _stop_signalled(run)
    assert _ended(SlurmState.FAILED, 241, stopped=True).cause == ExitCause.PREEMPTED
    assert _ended(SlurmState.FAILED, 241).cause == ExitCause.FAILED
    assert _ended(SlurmState.COMPLETED, 0, stopped=True).cause == ExitCause.COMPLETED
    assert _ended(SlurmState.NODE_FAIL, 1, stopped=True).cause == ExitCause.NODE_FAILURE
