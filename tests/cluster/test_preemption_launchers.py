"""Preemption (docs/design/preemption.md) for the Horovod and DeepSpeed launchers, on two nodes x two ranks: a preemption
and the time limit's warning signal reach every rank, the Core API trial checkpoints and
acknowledges, the job is gone within KillWait, and the next run resumes with no step lost or
repeated and no restart charged. The stops and checks are test_preemption_multinode's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_preemption_multinode import STOPS, finish_and_check, runs, start_two_by_two, stop_and_check
from test_slurm_cluster import trials

pytestmark = [pytest.mark.slurm, pytest.mark.torch, pytest.mark.late_build, pytest.mark.usefixtures("slurm_env")]

# The entrypoint's launcher after `python3 -m determined.launch.`, and the module it needs. Open
# MPI gets TCP only: the test cluster's "nodes" share one host, where its shared-memory
# transport would mix up the two nodes' segments (as in test_launch_cluster).
LAUNCHERS = {
    "horovod-gloo": ("horovod", "horovod"),
    "deepspeed": ("deepspeed", "deepspeed"),
    "horovod-mpi": ("horovod --mpi --mca btl tcp,self --", "horovod"),
}
# Horovod under --mpi only with the warning signal, which mpirun forwards to its ranks. On
# SIGTERM mpirun aborts the job, and the srun it starts its remote daemons with is inside the
# job's step, where Slurm's SIGTERM reaches it and it kills their step: not solved yet
# (docs/design/preemption.md).
# In CI's run one way of stopping for each Horovod mode; the other ways, each a 2 x 2 start of
# several minutes on a loaded machine, and DeepSpeed (its CPU op's compile took a core for 30 min
# of CI's run) in the whole suite (marker `full`). Every way is run in CI for the Core API
# (test_preemption_multinode).
IN_CI = {("horovod-gloo", "warning-signal")}
CASES = [
    pytest.param(launcher, how, marks=() if (launcher, how) in IN_CI else pytest.mark.full)
    for launcher in ("deepspeed", "horovod-gloo")
    for how in sorted(STOPS)
]
CASES.append(pytest.param("horovod-mpi", "warning-signal"))
# Up to 1.5 s from the signal to the next preemption check: a launcher that kills or orphans
# its ranks at the signal (DeepSpeed's did) fails here instead of racing the check.
STEP_S = 0.3


@pytest.mark.parametrize("launcher,how", CASES)
def test_launcher_stops_checkpoint_and_resume(det: Any, tmp_path: Path, launcher: str, how: str) -> None:
    entry, needs = LAUNCHERS[launcher]
    pytest.importorskip(needs)
    start_two_by_two(det, tmp_path / "ctx", "core", total=40, launcher=entry, step_s=STEP_S)
    assert stop_and_check(det, 1, how)
    # Never a failure code that the daemon forgives only because the batch shell saw a stop
    # signal (DeepSpeed's launcher gave 241 or 244): 0, or none where Slurm's SIGKILL at KillWait
    # (15 s here) ended the job after the acknowledged checkpoint, before the shell wrote a code.
    assert runs(trials(1)[0].id)[0].exit_code in (0, None)
    finish_and_check(det, 1, total=40)
