"""Horovod launcher overrides in horovodrun's spelling, turned into what Horovod reads.

Determined's ``determined.launch.horovod`` hands its overrides to ``horovodrun``. detslurm runs
no horovodrun (each node's launcher starts its own workers, see ``horovod.py``), so the tuning
flags become the environment variables that horovodrun itself would have set for every worker
(``--fusion-threshold-mb 1`` is ``HOROVOD_FUSION_THRESHOLD=1048576``, ``--cycle-time-ms 2`` is
``HOROVOD_CYCLE_TIME=2.0``, ...). Flags about where processes run (``-np``, ``-H``, elastic mode)
are refused: the Slurm allocation decides that. Flags about ssh are accepted and ignored (no ssh
is used). Anything else is an error that names the flag.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from detslurm.launch._common import LaunchError

# horovodrun takes the fusion buffer in MiB but Horovod reads bytes from the environment.
MIB = 1024 * 1024
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")


class Value(Enum):
    """What a knob's argument must be."""

    COUNT = "a non-negative integer"
    MS = "a non-negative number"
    FRACTION = "a number between 0 and 1"
    TEXT = "a value"
    LEVEL = "one of " + ", ".join(LOG_LEVELS)


class Controller(Enum):
    GLOO = "gloo"
    MPI = "mpi"


@dataclass(frozen=True)
class Knob:
    """One horovodrun flag that sets one environment variable.

    ``value`` None: a flag without argument that sets ``flag_value``. ``scale`` multiplies a
    COUNT (megabytes to bytes for the fusion buffer)."""

    env: str
    value: Optional[Value] = None
    flag_value: str = "1"
    scale: int = 1


# Both spellings of a switch, as horovodrun accepts them, so a copied command line that
# turns a default off still parses.
def _switch(env: str, on: str, off: str) -> dict[str, Knob]:
    return {on: Knob(env), off: Knob(env, flag_value="0")}


KNOBS: dict[str, Knob] = {
    "--fusion-threshold-mb": Knob("HOROVOD_FUSION_THRESHOLD", Value.COUNT, scale=MIB),
    "--cycle-time-ms": Knob("HOROVOD_CYCLE_TIME", Value.MS),
    "--cache-capacity": Knob("HOROVOD_CACHE_CAPACITY", Value.COUNT),
    **_switch("HOROVOD_HIERARCHICAL_ALLREDUCE", "--hierarchical-allreduce", "--no-hierarchical-allreduce"),
    **_switch("HOROVOD_HIERARCHICAL_ALLGATHER", "--hierarchical-allgather", "--no-hierarchical-allgather"),
    **_switch("HOROVOD_TORUS_ALLREDUCE", "--torus-allreduce", "--no-torus-allreduce"),
    **_switch("HOROVOD_AUTOTUNE", "--autotune", "--no-autotune"),
    "--autotune-log-file": Knob("HOROVOD_AUTOTUNE_LOG", Value.TEXT),
    "--autotune-warmup-samples": Knob("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", Value.COUNT),
    "--autotune-steps-per-sample": Knob("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", Value.COUNT),
    "--autotune-bayes-opt-max-samples": Knob("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", Value.COUNT),
    "--autotune-gaussian-process-noise": Knob("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", Value.FRACTION),
    "--timeline-filename": Knob("HOROVOD_TIMELINE", Value.TEXT),
    **_switch("HOROVOD_TIMELINE_MARK_CYCLES", "--timeline-mark-cycles", "--no-timeline-mark-cycles"),
    # horovodrun spells the stall check the other way round: --no-stall-check disables it.
    "--no-stall-check": Knob("HOROVOD_STALL_CHECK_DISABLE"),
    "--stall-check": Knob("HOROVOD_STALL_CHECK_DISABLE", flag_value="0"),
    "--stall-check-warning-time-seconds": Knob("HOROVOD_STALL_CHECK_TIME_SECONDS", Value.COUNT),
    "--stall-check-shutdown-time-seconds": Knob("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", Value.COUNT),
    **_switch("HOROVOD_MPI_THREADS_DISABLE", "--mpi-threads-disable", "--no-mpi-threads-disable"),
    "--num-nccl-streams": Knob("HOROVOD_NUM_NCCL_STREAMS", Value.COUNT),
    # horovodrun's --tcp means "no InfiniBand": for NCCL that is this variable.
    "--tcp": Knob("NCCL_IB_DISABLE"),
    "--thread-affinity": Knob("HOROVOD_THREAD_AFFINITY", Value.COUNT),
    "--gloo-timeout-seconds": Knob("HOROVOD_GLOO_TIMEOUT_SECONDS", Value.COUNT),
    "--log-level": Knob("HOROVOD_LOG_LEVEL", Value.LEVEL),
    "--log-with-timestamp": Knob("HOROVOD_LOG_HIDE_TIME", flag_value="0"),
    "--log-without-timestamp": Knob("HOROVOD_LOG_HIDE_TIME"),
    "--log-hide-timestamp": Knob("HOROVOD_LOG_HIDE_TIME"),
    "--no-log-hide-timestamp": Knob("HOROVOD_LOG_HIDE_TIME", flag_value="0"),
}

# horovodrun flags that only matter to its ssh launch: accepted, so copied command lines work.
IGNORED: dict[str, int] = {"-p": 1, "--ssh-port": 1, "-i": 1, "--ssh-identity-file": 1, "--disable-cache": 0}

_PLACEMENT = "the Slurm allocation decides where workers run (set resources.slots_per_trial instead)"
# Refused with a reason rather than ignored: silently dropping -np or elastic flags would
# run a job different from the one the user asked for.
REFUSED: dict[str, str] = {
    **dict.fromkeys(("-np", "--num-proc", "-H", "--hosts", "-hostfile", "--hostfile"), _PLACEMENT),
    **dict.fromkeys(("--slots-per-host", "--host-discovery-script"), _PLACEMENT),
    **dict.fromkeys(
        ("--min-np", "--min-num-proc", "--max-np", "--max-num-proc", "--elastic-timeout", "--reset-limit"),
        "elastic Horovod is not supported",
    ),
    "--jsrun": "jsrun is not supported (use --gloo or --mpi)",
    "--config-file": "horovodrun config files are not supported (give the flags themselves)",
    "--output-filename": "per-rank output files are not supported (logs carry [rank=N]; det trial logs --rank-id N)",
}

# Open MPI options passed through to mpirun under --mpi, with how many values each takes.
MPIRUN_PASSTHROUGH: dict[str, int] = {"--mca": 2, "-mca": 2, "-x": 1}


@dataclass
class HorovodSettings:
    """What the overrides asked for."""

    controller: Controller = Controller.GLOO
    env: dict[str, str] = field(default_factory=dict)  # for every worker
    mpi_args: list[str] = field(default_factory=list)  # extra mpirun arguments (--mpi only)
    network_interface: Optional[str] = None
    start_timeout_s: Optional[float] = None
    verbose: bool = False
    ignored: list[str] = field(default_factory=list)


def _convert(flag: str, knob: Knob, raw: str) -> str:
    """The environment value for ``flag raw``, or a LaunchError that says what was expected."""
    assert knob.value is not None
    bad = LaunchError(f"horovod override {flag}: expected {knob.value.value}, got {raw!r}")
    if knob.value is Value.TEXT:
        return raw
    if knob.value is Value.LEVEL:
        if raw.upper() not in LOG_LEVELS:
            raise bad
        return raw.upper()
    try:
        number = float(raw) if knob.value in (Value.MS, Value.FRACTION) else int(raw)
    except ValueError:
        raise bad from None
    if number < 0 or (knob.value is Value.FRACTION and number > 1):
        raise bad
    # str of a float keeps horovodrun's form for the ms values ("2.0"); counts stay integers.
    return str(number * knob.scale)


class _Tokens:
    """Overrides one at a time; ``--flag=value`` and ``--flag value`` read the same."""

    def __init__(self, overrides: Sequence[str]) -> None:
        self.items = list(overrides)
        self.pos = 0

    def next_flag(self) -> tuple[str, Optional[str]]:
        token = self.items[self.pos]
        self.pos += 1
        flag, eq, inline = token.partition("=")
        # Only a flag's "=" splits: a value such as `-x FOO=bar` after its flag stays whole.
        if eq and flag.startswith("-"):
            return flag, inline
        return token, None

    def take(self, flag: str, inline: Optional[str], count: int = 1) -> list[str]:
        if inline is not None:
            if count != 1:
                raise LaunchError(f"horovod override {flag} takes {count} values, not {flag}=...")
            return [inline]
        values = self.items[self.pos : self.pos + count]
        if len(values) < count:
            raise LaunchError(f"horovod override {flag} needs {count} value{'s' * (count > 1)}")
        self.pos += count
        return values

    def more(self) -> bool:
        return self.pos < len(self.items)


def parse_overrides(overrides: Sequence[str]) -> HorovodSettings:
    """Pure: horovodrun-style overrides -> settings. Raises LaunchError naming the flag."""
    out = HorovodSettings()
    tokens = _Tokens(overrides)
    passthrough: list[str] = []
    while tokens.more():
        flag, inline = tokens.next_flag()
        knob = KNOBS.get(flag)
        if knob is not None:
            if knob.value is None:
                if inline is not None:
                    raise LaunchError(f"horovod override {flag} takes no value")
                out.env[knob.env] = knob.flag_value
            else:
                out.env[knob.env] = _convert(flag, knob, tokens.take(flag, inline)[0])
        elif flag in ("--gloo", "--mpi"):
            out.controller = Controller(flag[2:])
        elif flag == "--mpi-args":
            # --mpi-args is one string in horovodrun, split as its shell would.
            out.mpi_args += shlex.split(tokens.take(flag, inline)[0])
        elif flag in MPIRUN_PASSTHROUGH:
            passthrough += [flag, *tokens.take(flag, inline, MPIRUN_PASSTHROUGH[flag])]
        elif flag in ("--network-interface", "--network-interfaces"):
            out.network_interface = tokens.take(flag, inline)[0]
        # horovodrun's wait for workers to start; here the other nodes' wait for the chief's ports.
        elif flag == "--start-timeout":
            out.start_timeout_s = float(_convert(flag, Knob("", Value.COUNT), tokens.take(flag, inline)[0]))
        elif flag == "--verbose":
            out.verbose = True
        elif flag in IGNORED:
            out.ignored += [flag, *tokens.take(flag, inline, IGNORED[flag])] if IGNORED[flag] else [flag]
        elif flag in REFUSED:
            raise LaunchError(f"horovod override {flag} is not supported: {REFUSED[flag]}")
        else:
            raise LaunchError(
                f"unknown horovod override {flag!r}: give horovodrun's flags (such as --fusion-threshold-mb N, "
                "--cycle-time-ms N, --autotune, --gloo/--mpi), and mpirun's own options through --mpi-args"
            )
    _check_controller(out, passthrough)
    return out


def _check_controller(out: HorovodSettings, passthrough: list[str]) -> None:
    if out.controller is Controller.MPI:
        out.mpi_args = passthrough + out.mpi_args
        return
    given = passthrough or out.mpi_args
    if given:
        # Under gloo there is no mpirun to hand them to: an error, not a silent drop.
        raise LaunchError(f"horovod override {given[0]} is an mpirun option: it needs --mpi")


def describe(settings: HorovodSettings) -> str:
    """One line for ``--verbose`` and for ignored flags."""
    env = " ".join(f"{k}={v}" for k, v in sorted(settings.env.items()))
    extra = f"; ignored (no ssh is used): {' '.join(settings.ignored)}" if settings.ignored else ""
    return f"horovod controller={settings.controller.value} {env}{extra}".rstrip()


def report(settings: HorovodSettings) -> None:
    # Ignored flags are always reported, so a user relying on one sees that it had no effect.
    if settings.verbose or settings.ignored:
        print(f"detslurm launcher: {describe(settings)}", file=sys.stderr, flush=True)
