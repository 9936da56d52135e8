"""Preemption: the control file (contract 3) and Slurm's signals feed one latched flag.

A watcher thread on the chief stats the run's control file; ``should_preempt()`` gives every
rank the chief's answer.

Why the signal handler is shaped as it is (docs/design/preemption.md):

- CPython runs a Python-level handler in the main thread, between two bytecodes of whatever the
  main thread was doing. The handler therefore takes no lock of any kind: not even
  ``threading.Event.set()``, whose Condition wraps a non-reentrant Lock, and no logging, print
  or event writing (their locks may be held by the very code the handler interrupted, and the
  trial would then hang until Slurm's SIGKILL). It stores plain attributes; the watcher thread
  and ``should_preempt()`` read them.
- One preemption usually reaches a trial as two SIGTERMs: Slurm signals every process of the
  job step itself (proctrack), and the launcher forwards the one it gets to the entrypoint's
  process group. The time between them is only seen when the Python handler runs, which can be
  seconds after delivery while the main thread sits in a long C call (fsync of a checkpoint on
  a loaded or network filesystem); the kernel also merges a SIGTERM that is still pending. So
  the gap between two SIGTERMs cannot tell a duplicate from a deliberate "stop now". Before the
  trial has acknowledged the preemption a repeated SIGTERM is therefore ignored (the trial is
  busy getting to its checkpoint; Slurm's SIGKILL after KillWait remains the hard stop). Only
  after the acknowledgement does a later SIGTERM end the process at once, as if unhandled.
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, Union

from detslurm import settings
from detslurm.core._distributed import DistributedContext
from detslurm.protocol import BadRecord, ControlRecord

log = logging.getLogger("detslurm.core")
POLL_S = 0.5
DUPLICATE_WINDOW_S = 2.0


class PreemptMode(enum.Enum):
    WorkersAskChief = "WORKERS_ASK_CHIEF"
    ChiefOnly = "CHIEF_ONLY"
    WorkersAskMaster = "WORKERS_ASK_MASTER"


def preempt_signals() -> list[signal.Signals]:
    """SIGTERM (Slurm's preemption / time limit / scancel) plus the site's warning signal.
    USR1 is never the default: NCCL installs its own USR1 handler."""
    sigs = [signal.SIGTERM]
    name = settings.PREEMPT_SIGNAL.get()
    if name:
        try:
            sigs.append(signal.Signals[name if name.startswith("SIG") else f"SIG{name}"])
        except KeyError:
            log.warning("ignoring unknown %s=%s", settings.PREEMPT_SIGNAL.name, name)
    return sigs


Handler = Union[Callable[[int, FrameType | None], Any], int, None]


class PreemptContext:
    def __init__(
        self,
        dist: DistributedContext,
        control_path: Path | None,
        ack: Callable[[], None],
        mode: PreemptMode = PreemptMode.WorkersAskChief,
        signals_path: Path | None = None,
        lazy_signals: bool = False,
    ) -> None:
        self._dist = dist
        # Detached scripts (core_v2 in the user's own job): signal handlers only once the script
        # asks should_preempt(). One that never asks cannot act on the flag, and swallowing
        # SIGTERM would only keep it alive until Slurm's SIGKILL (KillWait) instead of ending now.
        self._lazy_signals = lazy_signals
        self._control = control_path
        # The batch shell appends every signal it gets (TERM, the warning signal) to this file.
        # Read as a preemption too: in a container the signal itself may never arrive (Slurm's
        # SIGTERM also kills the helper `podman run` starts to pass it on), the shared run dir does.
        self._signals = signals_path
        self._ack = ack
        self.mode = mode
        self._flag = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._old: dict[int, Handler] = {}
        self._first_term: float | None = None
        # Set by the signal handler (plain stores: see the module docstring), read by everyone.
        self._signalled = False
        # Wall-clock time of the first signal (the compute node's clock, as event times are):
        # reported with the acknowledgement so the controller can measure the stop time.
        self.signal_time: float | None = None
        self._acked = False
        self._started = False
        self.reason: str | None = None

    def start(self) -> None:
        self._started = True
        if self._control is None:
            return
        watch = self._dist.rank == 0 or self.mode == PreemptMode.WorkersAskMaster
        if watch:
            self._thread = threading.Thread(target=self._watch, name="detslurm-preempt", daemon=True)
            self._thread.start()
        if not self._lazy_signals:
            self._install_handlers()

    def _install_handlers(self) -> None:
        # Never after close() (it restored the old handlers), never twice, only where Python allows.
        if self._old or self._stop.is_set() or threading.current_thread() is not threading.main_thread():
            return
        for sig in preempt_signals():
            self._old[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Runs between two bytecodes of the main thread: no locks, no I/O (module docstring).
        now = time.monotonic()
        if self.signal_time is None:
            self.signal_time = time.time()
        first = self._first_term
        if signum == signal.SIGTERM and first is None:
            self._first_term = now
        elif signum == signal.SIGTERM and first is not None and self._acked and now - first > DUPLICATE_WINDOW_S:
            # Acknowledged earlier, and another SIGTERM now: "really stop", as if unhandled.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self._signalled = True

    def _watch(self) -> None:
        assert self._control is not None
        while not self._stop.wait(POLL_S):
            if self._signals is not None and _has_content(self._signals):
                self.reason = "preempt"
                self._flag.set()
                return
            try:
                record = ControlRecord.read(self._control)
            except BadRecord:
                continue  # mid-replace on some filesystems: read again at the next poll
            if record is not None and record.preempt:
                self.reason = record.reason
                self._flag.set()
                return

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for sig, old in self._old.items():
            if sig != signal.SIGTERM and old in (None, signal.SIG_DFL):
                # The warning signal's default action is to terminate. After close() the trial
                # has nothing left to checkpoint, and a warning that lands while it exits (the time
                # limit's, or a preemption notice) would turn a finished run into a failed one
                # that is charged a restart. SIGTERM keeps its default: it still means "stop".
                signal.signal(sig, signal.SIG_IGN)
            else:
                signal.signal(sig, old if old is not None else signal.SIG_DFL)
        self._old.clear()

    def _local_answer(self) -> bool:
        return self._signalled or self._flag.is_set()

    def should_preempt(self, auto_ack: bool = True) -> bool:
        if not self._started:
            raise RuntimeError("should_preempt() must be called inside `with core.init() as ctx:`")
        if self.mode == PreemptMode.ChiefOnly and self._dist.rank != 0:
            raise RuntimeError("should_preempt() in ChiefOnly mode may only be called by the chief")
        if self._lazy_signals and self._control is not None:
            self._install_handlers()
        if self.mode == PreemptMode.WorkersAskChief:
            answer = bool(self._dist.broadcast(self._local_answer()))
        else:
            answer = self._local_answer()
        if answer and auto_ack and self._dist.rank == 0:
            self.acknowledge_preemption_signal()
        return answer

    def acknowledge_preemption_signal(self) -> None:
        if not self._acked:
            self._acked = True
            self._ack()


def _has_content(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


class DummyPreemptContext(PreemptContext):
    """Off-cluster twin: never preempted, but keeps the collective in step across ranks."""

    def __init__(self, dist: DistributedContext, preempt_mode: PreemptMode = PreemptMode.WorkersAskChief) -> None:
        super().__init__(dist, None, lambda: None, preempt_mode)
