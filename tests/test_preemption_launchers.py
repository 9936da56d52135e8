"""Issue 16 for the Horovod and DeepSpeed launchers, on two nodes x two ranks: a preemption
and the time limit's warning signal reach every rank, the Core API trial checkpoints and
acknowledges, the job is gone within KillWait, and the next run resumes with no step lost or
repeated and no restart charged. The stops and checks are test_preemption_multinode's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_preemption_multinode import STOPS, finish_and_check, runs, start_two_by_two, stop_and_check
from test_slurm_cluster import trials

pytestmark = [pytest.mark.slurm, pytest.mark.torch, pytest.mark.usefixtures("slurm_env")]

# The entrypoint's launcher after `python3 -m determined.launch.`, and the module it needs.
# Horovod under --mpi is not here: mpirun starts its remote daemons with an srun of its own,
# which Slurm's SIGTERM reaches and which then kills their step (docs/readme/sigfwd.md).
LAUNCHERS = {"horovod-gloo": ("horovod", "horovod"), "deepspeed": ("deepspeed", "deepspeed")}
# Up to 1.5 s from the signal to the next preemption check: a launcher that kills or orphans
# its ranks at the signal (DeepSpeed's did) fails here instead of racing the check.
STEP_S = 0.3


@pytest.mark.parametrize("how", sorted(STOPS))
@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_launcher_stops_checkpoint_and_resume(det: Any, tmp_path: Path, launcher: str, how: str) -> None:
    entry, needs = LAUNCHERS[launcher]
    pytest.importorskip(needs)
    start_two_by_two(det, tmp_path / "ctx", "core", total=40, launcher=entry, step_s=STEP_S)
    assert stop_and_check(det, 1, how)
    # Never a failure code that the daemon forgives only because the batch shell saw a stop
    # signal (DeepSpeed's launcher gave 241 or 244): 0, or none where Slurm's SIGKILL at KillWait
    # (5 s here) ended the job after the acknowledged checkpoint, before the shell wrote a code.
    assert runs(trials(1)[0].id)[0].exit_code in (0, None)
    finish_and_check(det, 1, total=40)
