"""Stop time (docs/design/preemption.md): the time from Slurm's signal to the acknowledged checkpoint is measured,
compared with the site's budget (GraceTime, KillWait, the warning lead), and preemption_timeout
is honoured by the launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from detslurm.controller.apply import _stopped_at
from detslurm.exec.launch import preemption_timeout_s
from detslurm.launch._agent import agent_env, children_of
from detslurm.protocol.events import BadEvent, PreemptAck, decode, encode
from detslurm.slurm.budget import Budget, preemption_budget, slow_stops
from detslurm.slurm.parse import parse_config
from detslurm.slurm.partitions import parse_partitions
from detslurm.slurm.site import SiteConfig
from detslurm.store.models import TrialRun

DATA = Path(__file__).parents[2] / "data" / "slurm-22.05"


def test_ack_carries_the_signal_time_and_rejects_a_bad_one() -> None:
    assert decode(encode(PreemptAck(time=20.0, signal_time=12.5))) == PreemptAck(time=20.0, signal_time=12.5)
    # A stop through the control file has no signal time, and the line stays as it was.
    line = encode(PreemptAck(time=20.0))
    assert "signal_time" not in line and decode(line) == PreemptAck(time=20.0, signal_time=None)
    for bad in ('"x"', "-1", "1e12", "true"):
        with pytest.raises(BadEvent, match="signal_time"):
            decode(f'{{"type": "preempt_ack", "v": 1, "signal_time": {bad}}}')


def test_stop_time_runs_from_the_signal_to_the_last_checkpoint_after_it() -> None:
    run = TrialRun(preempt_signal_time=100.0)
    _stopped_at(run, 100.0, 101.5)  # the acknowledgement
    assert run.preempt_stop_s == 1.5
    _stopped_at(run, 100.0, 104.0)  # Determined's pattern: acknowledge, then checkpoint
    assert run.preempt_stop_s == 4.0
    _stopped_at(run, 100.0, 99.0)  # a clock step backwards never shortens or negates it
    assert run.preempt_stop_s == 4.0


def test_budget_from_the_probed_site() -> None:
    caps = parse_config((DATA / "show-config.txt").read_text())
    parts = {p.name: p for p in parse_partitions((DATA / "show-partition.txt").read_text())}
    part = next(iter(parts.values()))
    site = SiteConfig(signal_lead_s=120)
    b = preemption_budget(caps, part, site)
    assert b.kill_wait_s == caps.kill_wait_s and b.grace_time_s == part.grace_time_s and b.lead_s == 120
    assert b.seconds == min(part.grace_time_s, 120) + caps.kill_wait_s
    # An unknown partition: no GraceTime assumed.
    assert preemption_budget(caps, None, site).grace_time_s == 0


def test_slow_stops_name_the_trial_the_time_and_the_budget() -> None:
    b = Budget(partition="cpu", kill_wait_s=30, grace_time_s=60, lead_s=300)
    assert b.preemption_s == 90 and b.time_limit_s == 330 and b.seconds == 90
    slow = slow_stops([(7, 1, 12.0), (7, 2, 95.25), (8, 1, None)], b)
    assert [(s.trial_id, s.run_id) for s in slow] == [(7, 2)]
    msg = slow[0].message()
    assert "trial 7 run 2 took 95.2 s" in msg and "90 s the site allows" in msg
    assert "GraceTime 60 + KillWait 30" in msg and "warning lead 300" in msg


def test_preemption_timeout_is_read_from_the_config_env() -> None:
    def env(value: object) -> dict[str, str]:
        return {"DET_EXPERIMENT_CONFIG": json.dumps({"preemption_timeout": value})}

    assert preemption_timeout_s(env(30)) == 30.0
    assert preemption_timeout_s(env(None)) is None
    assert preemption_timeout_s(env(-1)) is None and preemption_timeout_s(env(True)) is None
    assert preemption_timeout_s({"DET_EXPERIMENT_CONFIG": "not json"}) is None
    assert preemption_timeout_s({}) is None


LAUNCH = """
import sys
from pathlib import Path
from detslurm.exec.launch import _run
env = dict(__import__("os").environ)
sys.exit(_run(sys.argv[1:], Path("."), env, Path("control.json")))
"""


def _launcher(tmp_path: Path, timeout: int | None, script: str) -> subprocess.Popen[str]:
    env = dict(os.environ, DET_EXPERIMENT_CONFIG=json.dumps({"preemption_timeout": timeout}))
    (tmp_path / "trial.py").write_text(textwrap.dedent(script))
    return subprocess.Popen(
        [sys.executable, "-c", LAUNCH, sys.executable, "trial.py"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


STUBBORN = """
import signal, time
signal.signal(signal.SIGTERM, lambda *a: print("told to stop", flush=True))
print("ready", flush=True)
time.sleep(60)
"""


def test_launcher_kills_a_trial_that_outlives_preemption_timeout(tmp_path: Path) -> None:
    proc = _launcher(tmp_path, 2, STUBBORN)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    # _run returns -9 (killed); the harness passes that to sys.exit, which exits 247.
    assert proc.returncode == -signal.SIGKILL & 0xFF and 2 <= time.monotonic() - t0 < 30  # the trial sleeps 60 s
    assert "told to stop" in out and "did not stop within preemption_timeout (2 s)" in err


def test_launcher_without_preemption_timeout_waits_for_the_trial(tmp_path: Path) -> None:
    proc = _launcher(tmp_path, None, STUBBORN.replace("time.sleep(60)", "time.sleep(4)"))
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "preemption_timeout" not in err


def test_control_file_stop_starts_the_preemption_timeout_clock(tmp_path: Path) -> None:
    proc = _launcher(tmp_path, 1, STUBBORN)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    from detslurm.protocol import ControlRecord

    ControlRecord(preempt=True, reason="pause").write(tmp_path / "control.json")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL & 0xFF and "preemption_timeout (1 s)" in err


def test_torchrun_is_told_to_leave_sigterm_to_its_workers() -> None:
    env = agent_env({"PATH": "/bin"})
    assert (
        "SIGTERM" not in env["PET_SIGNALS_TO_HANDLE"]
        and env["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGINT,SIGHUP,SIGQUIT"
    )
    # A user's own choice wins.
    assert agent_env({"PET_SIGNALS_TO_HANDLE": "SIGTERM"})["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM"


def test_children_of_finds_the_agents_workers() -> None:
    kids = [subprocess.Popen(["sleep", "5"]) for _ in range(2)]
    try:
        # pytest may have children of its own; ours must all be found, and no grandchild.
        assert {k.pid for k in kids} <= set(children_of(os.getpid()))
        assert not children_of(kids[0].pid)
    finally:
        for k in kids:
            k.kill()
            k.wait()
