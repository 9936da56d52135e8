"""Append-only JSON-lines event files in the trial run's dir (docs/design/architecture.md, rule 2).

Every line is a typed record of :mod:`detslurm.protocol.events`, written by its one encoder.

Reports are queued and written by one background thread so that a training loop never waits
on a shared filesystem; ``flush()`` makes everything queued so far durable (used before a
checkpoint report returns, on preemption acks and at exit).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

from detslurm.protocol.events import Event, encode


def _default(o: Any) -> Any:
    # numpy / torch scalars and 0-d tensors
    item = getattr(o, "item", None)
    if callable(item):
        return item()
    if isinstance(o, (set, tuple)):
        return list(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"metric value of type {type(o).__name__} is not JSON serializable")


class EventWriter:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._q: queue.SimpleQueue[tuple[Event | None, threading.Event | None] | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="detslurm-events", daemon=True)
        self._closed = False
        self._thread.start()

    def emit(self, event: Event) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"writing trial events to {self.path} failed: {err}") from err
        self._q.put((event, None))

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until everything queued so far is on disk; ``timeout_s`` bounds the wait (a hung
        filesystem must not hang a script that is exiting) and raises RuntimeError past it."""
        done = threading.Event()
        self._q.put((None, done))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not done.wait(1.0 if timeout_s is None else min(1.0, timeout_s)):
            if not self._thread.is_alive():
                raise RuntimeError("the trial event writer thread died")
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(f"writing trial events to {self.path} did not finish in {timeout_s:.0f} s")
        if self._error is not None:
            raise RuntimeError(f"writing trial events to {self.path} failed: {self._error}")

    def _run(self) -> None:
        with open(self.path, "a", buffering=1 << 16) as f:
            while True:
                item = self._q.get()
                if item is None:
                    f.flush()
                    os.fsync(f.fileno())
                    return
                batch = [item]
                while True:
                    try:
                        nxt = self._q.get_nowait()
                    except queue.Empty:
                        break
                    if nxt is None:
                        self._q.put(None)
                        break
                    batch.append(nxt)
                self._write(f, batch)

    def _write(self, f: Any, batch: list[tuple[Event | None, threading.Event | None]]) -> None:
        waiters = []
        for event, done in batch:
            if done is not None:
                waiters.append(done)
                continue
            if event is None:
                continue
            try:
                f.write(encode(event, default=_default))
            except (TypeError, ValueError) as e:
                self._error = e
        # Hand every batch to the OS: a process that crashes (or os._exit()s) right after a
        # report loses nothing; fsync is reserved for flush(), where durability is asked for.
        try:
            f.flush()
        except OSError as e:
            self._error = e
        if waiters:
            try:
                f.flush()
                os.fsync(f.fileno())
            except OSError as e:
                self._error = e
            for w in waiters:
                w.set()

    def close(self, timeout_s: float = 60.0) -> None:
        """Write what is queued and stop the thread, waiting at most ``timeout_s`` (the thread
        is a daemon: one stuck on a hung filesystem never keeps the process alive)."""
        if self._closed:
            return
        self._closed = True
        self._q.put(None)
        self._thread.join(timeout=timeout_s)


class NullWriter:
    """Off-cluster twin: events are only logged."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)

    def flush(self, timeout_s: float | None = None) -> None:
        pass

    def close(self, timeout_s: float = 0.0) -> None:
        pass
