"""The daemon: Determined's master, made small. One per user; restartable at any moment.

Each tick is one ``Controller.tick()``: one batched squeue for every active trial run of every
experiment, event ingest, searcher decisions, submissions, restarts. It never polls faster than
the site's floor, and exits after a while with nothing to do (``det e create`` starts it again).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from detslurm import settings as settings_mod
from detslurm.errors import StateError
from detslurm.jobenv import daemon_env, warn_once
from detslurm.settings import Settings
from detslurm.util import atomic_write_text

if TYPE_CHECKING:
    from detslurm.controller.controller import Controller
    from detslurm.controller.detached import DetachedIngest
    from detslurm.controller.slurm_executor import SlurmExecutor
    from detslurm.slurm.client import SlurmClient
    from detslurm.slurm.site import SiteConfig
    from detslurm.store import Store

# The controller, store and Slurm modules are imported on first use: a starting daemon takes
# its lock and writes its pid first, so `det e create` waits for it only briefly.

log = logging.getLogger("detslurm.daemon")


class Paths:
    def __init__(self, s: Settings) -> None:
        self.pid = s.data_dir / "daemon.pid"
        # The lock, not the pid file, decides who drives: a pid file can be stale or forged, a
        # held flock cannot outlive its holder.
        self.lock = s.data_dir / "daemon.lock"
        self.log = s.data_dir / "daemon.log"
        # What the daemon last did (TickStatus): `det daemon status`, and root's for every user.
        self.status = s.data_dir / "daemon.status"


# psutil derives a create time from the boot time and the start tick (10 ms): the same process
# reads the same value in every process, so a small slack is only for float noise.
_CREATE_TIME_SLACK_S = 0.05


@dataclass(frozen=True)
class PidRecord:
    """Who the daemon is. A pid alone is not an identity: it is reused after the daemon dies,
    means nothing on another login node that shares the home, and may be another user's
    process (docs/design/security.md). All four fields must match before we trust or signal it."""

    host: str
    uid: int
    pid: int
    create_time: float

    @classmethod
    def of_this_process(cls) -> PidRecord:
        import psutil

        return cls(socket.gethostname(), os.getuid(), os.getpid(), psutil.Process().create_time())

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def parse(cls, text: str) -> Optional[PidRecord]:
        """The record, or None for anything else (an old bare-pid file, a torn or hostile one)."""
        try:
            d = json.loads(text)
            rec = cls(str(d["host"]), int(d["uid"]), int(d["pid"]), float(d["create_time"]))
        except (ValueError, TypeError, KeyError):
            return None
        # pid 0 and negative pids address process groups in kill(2): never a daemon to signal.
        return rec if rec.pid > 0 else None


@dataclass(frozen=True)
class TickStatus:
    """What a running daemon last did, rewritten after every round of its loop."""

    pid: int
    poll_interval_s: float
    last_tick: Optional[float]  # epoch seconds of the last round's end; None before the first
    ok: bool  # whether that round's tick ran without an error (the error is in daemon.log)
    experiments: int  # the active experiments it drives

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def parse(cls, text: str) -> Optional[TickStatus]:
        """The status, or None for anything else (a torn, old or hostile file)."""
        try:
            d = json.loads(text)
            last = d["last_tick"]
            return cls(
                int(d["pid"]),
                float(d["poll_interval_s"]),
                None if last is None else float(last),
                bool(d["ok"]),
                int(d["experiments"]),
            )
        except (ValueError, TypeError, KeyError):
            return None

    def describe(self, now: Optional[float] = None) -> str:
        """One line: 'polling every 10 s, last tick 3 s ago', and whether it failed or is late."""
        out = f"polling every {self.poll_interval_s:g} s, "
        if self.last_tick is None:
            return out + "no tick yet"
        ago = max(0.0, (time.time() if now is None else now) - self.last_tick)
        out += f"last tick {ago:.0f} s ago" + ("" if self.ok else " (failed: see daemon.log)")
        # A round sleeps one interval: much longer since the last one means a tick is stuck.
        return out + (" (late)" if ago > 3 * self.poll_interval_s + 60 else "")


@dataclass(frozen=True)
class DaemonStatus:
    """Our daemon's pid on this host (None when it does not run here) and one line saying why."""

    pid: Optional[int]
    detail: str
    tick: Optional[TickStatus] = None


def daemon_status(s: Settings) -> DaemonStatus:
    """Check the pid file against this host, this uid and the live process's create time."""
    path = Paths(s).pid
    try:
        rec = PidRecord.parse(path.read_text())
    except FileNotFoundError:
        return DaemonStatus(None, "not running")
    except OSError as e:
        return DaemonStatus(None, f"not running (cannot read {path}: {e.strerror})")
    if rec is None:
        return DaemonStatus(None, f"not running (ignoring the unreadable pid file {path})")
    if rec.host != socket.gethostname():
        return DaemonStatus(
            None,
            f"not running here: {path} names a daemon on host {rec.host} (pid {rec.pid}); this store's "
            f"experiments are driven there, so run det on {rec.host} or stop that daemon first",
        )
    if rec.uid != os.getuid():
        return DaemonStatus(None, f"not running (the pid file {path} was written by uid {rec.uid}, not by you)")
    pid = _live_pid(rec)
    if pid is None:
        return DaemonStatus(None, "not running")
    tick = read_tick_status(Paths(s).status, pid)
    return DaemonStatus(pid, f"running (pid {pid})" + (f", {tick.describe()}" if tick else ""), tick)


def read_tick_status(path: Path, pid: int) -> Optional[TickStatus]:
    """The status file of the daemon ``pid``, or None (none yet, another daemon's, unreadable)."""
    try:
        tick = TickStatus.parse(path.read_text())
    except OSError:
        return None
    return tick if tick is not None and tick.pid == pid else None


def _live_pid(rec: PidRecord) -> Optional[int]:
    """rec.pid while it is still the process that wrote the record (ours, alive, same start)."""
    # Imported here: a read command with no pid file (no daemon) never needs it (det t logs'
    # start-up).
    import psutil

    try:
        proc = psutil.Process(rec.pid)
        # The pid file lives in a directory the user owns, but a reused pid may now be anyone's.
        ours = proc.uids().real == os.getuid()
        # A zombie still has its pid until reaped (e.g. by the `det` that started it), but it
        # drives nothing.
        alive = proc.status() != psutil.STATUS_ZOMBIE
        same = abs(proc.create_time() - rec.create_time) <= _CREATE_TIME_SLACK_S
    # AccessDenied: a process we may not inspect belongs to someone else, so it is not ours either.
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return rec.pid if ours and alive and same else None


def running_pid(s: Settings) -> Optional[int]:
    """The pid of this user's daemon on this host, or None (see :func:`daemon_status`)."""
    return daemon_status(s).pid


def controller_lock(s: Settings, timeout: float = 0) -> AbstractContextManager[bool]:
    """Held by whoever drives Slurm experiments now: the daemon, or a CLI doing one step.
    A filesystem that refuses file locks is a clear error, not a traceback."""
    from detslurm.store.locks import hold_lock

    s.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    return hold_lock(Paths(s).lock, timeout)


def make_controller(
    s: Settings,
    site: Optional[SiteConfig] = None,
    *,
    store: Optional[Store] = None,
    client: Optional[SlurmClient] = None,
    executor: Optional[SlurmExecutor] = None,
) -> Controller:
    """A Slurm controller on the given store/client/site (or executor); what is not given is
    opened here."""
    from detslurm.controller.controller import Controller
    from detslurm.controller.slurm_executor import SlurmExecutor
    from detslurm.slurm.client import client_from_env
    from detslurm.slurm.site import load_site_config
    from detslurm.store import open_store

    return Controller(
        store or open_store(s.db_url),
        executor or SlurmExecutor(client or client_from_env(), site or load_site_config()),
    )


def detached_ingest(s: Settings, ctl: Controller, client: Optional[SlurmClient] = None) -> DetachedIngest:
    """Ingest of this user's detached runs (their own sbatch scripts using core_v2), polling
    through the controller's executor: the same one squeue per step as the tick."""
    from detslurm.controller.detached import DetachedIngest
    from detslurm.protocol.detached import detached_root

    def job_log(job_id: str) -> Optional[str]:
        # Once per run, on first sight: where Slurm writes the job's output (det trial logs).
        if client is None:
            return None
        try:
            return client.show_job(job_id).get("StdOut") or None
        except Exception:  # a missing log path must never keep a run from being recorded
            return None

    return DetachedIngest(ctl.store, detached_root(s.experiments_dir), ctl.owner, ctl.executor.poll, job_log)


def reconcile_once(
    s: Settings,
    *,
    store: Optional[Store] = None,
    client: Optional[SlurmClient] = None,
    site: Optional[SiteConfig] = None,
    executor: Optional[SlurmExecutor] = None,
) -> bool:
    """One tick, unless the daemon (or another CLI) is driving right now. A CLI passes the
    store, client and site it has open already, so a read does not open them twice; a create
    passes the executor that planned its first submission."""
    with controller_lock(s) as got:
        if not got:
            return False
        from detslurm.slurm.client import client_from_env

        client = client or client_from_env()
        ctl = make_controller(s, site, store=store, client=client, executor=executor)
        if ctl.active_experiment_ids():
            ctl.tick()
        _detached_step(detached_ingest(s, ctl, client))
        return True


def _detached_step(ingest: DetachedIngest) -> bool:
    """One detached step; whether detached runs keep the daemon busy. A failure is logged and
    never stops the managed experiments' tick."""
    try:
        result = ingest.step()
    except Exception:
        log.exception("detached runs: step failed")
        return False
    return result.active or result.recorded > 0


def claim_poll(store: Store, owner: str, floor_s: float) -> bool:
    """Whether a read command may poll Slurm now: no read polled for ``owner`` in the last
    ``floor_s`` seconds (the site's polling floor). Claimed in a write transaction, so two
    reads started together poll once, and the claim is the new stamp."""
    from datetime import datetime, timedelta, timezone

    from detslurm.store.models import PollStamp

    now = datetime.now(timezone.utc)
    with store.tx() as tx:
        stamp = tx.get(PollStamp, owner)
        if stamp is not None:
            last = stamp.last_poll if stamp.last_poll.tzinfo else stamp.last_poll.replace(tzinfo=timezone.utc)
            # A stamp in the future (the clock went back) does not hold reads off for that long.
            if timedelta(0) <= now - last < timedelta(seconds=floor_s):
                return False
            stamp.last_poll = now
        else:
            tx.add(PollStamp(owner=owner, last_poll=now))
    return True


# How long a starting daemon may take to take its lock and write its pid. While it lives it is
# either starting or about to give up (another daemon's lock, after 5 s), so this is a bound,
# not a wait: a loaded login node took over 10 s to import it (CI, 2026-11-27), and `det e
# create` then failed although its jobs were already queued.
START_WAIT_S = 300.0


def start(s: Settings, wait_s: float = START_WAIT_S) -> int:
    """Start the daemon in the background unless it runs here already; its pid."""
    pid = running_pid(s)
    if pid is not None:
        return pid
    p = Paths(s)
    s.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    # Jobs inherit the daemon's environment (sbatch --export=ALL): start it without what must
    # not reach them (detslurm/jobenv.py).
    scrubbed = daemon_env(os.environ)
    warn_once(scrubbed)
    with open(p.log, "ab") as out:
        if scrubbed.dropped:  # names only: values may be private
            out.write(f"detslurm: not passing to jobs: {', '.join(scrubbed.dropped)}\n".encode())
            out.flush()
        proc = subprocess.Popen(
            # sys.executable: the daemon must run the same detslurm (same venv) as the `det` that
            # starts it, whatever python PATH finds first.
            [sys.executable, "-m", "detslurm.daemon", "run"],
            env=scrubbed.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            # A session of its own: the daemon outlives the terminal, and Ctrl-C or SIGHUP sent to
            # the `det` process group does not reach it.
            start_new_session=True,
            close_fds=True,
        )
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        pid = running_pid(s)
        if pid is not None:
            return pid
        # It exited before writing its pid (lock held elsewhere, bad config): no point waiting.
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    # Typically another daemon holds the lock: one on another login node that shares this home.
    raise StateError(f"the detslurm daemon did not start (daemon {daemon_status(s).detail}); see {p.log}")


def stop(s: Settings, wait_s: float = 30.0) -> Optional[int]:
    """SIGTERM our daemon on this host and wait for it to go; its pid, or None when none ran.
    Only a process that :func:`running_pid` proved ours is signalled."""
    pid = running_pid(s)
    if pid is None:
        return None
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return None  # it exited between the check and the signal
    except PermissionError:
        raise StateError(f"process {pid} is not yours: not stopping it") from None
    deadline = time.monotonic() + wait_s
    # Waiting lets `det daemon stop && det daemon start` work: the old daemon finishes its
    # tick and releases the lock before the new one asks for it.
    while time.monotonic() < deadline and running_pid(s) is not None:
        time.sleep(0.1)
    return pid


def _safe_url(url: str) -> str:
    """The store URL for logs, password masked."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "<unparsable store URL>"


def run_forever(s: Settings, idle_exit_s: float) -> int:
    stopping = {"flag": False}

    # The handler only sets a flag: a tick interrupted halfway could leave a submitted job
    # unrecorded. The loop checks the flag between ticks and during the sleep.
    def on_term(_sig: int, _frame: object) -> None:
        stopping["flag"] = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    # A few seconds' wait covers a CLI doing one reconcile step; a lock held longer is another
    # daemon, and two would submit every trial twice.
    with controller_lock(s, timeout=5) as got:
        if not got:
            log.error("another detslurm daemon holds %s", Paths(s).lock)
            return 1
        # Taken now, while the file is surely the one locked: compared before every tick.
        lock_id = _file_id(Paths(s).lock)
        me = PidRecord.of_this_process()
        # Written only while the lock is held, so the pid file names the daemon that drives.
        # durable=False: a pid file lost in a crash is harmless (the lock is the truth).
        atomic_write_text(Paths(s).pid, me.to_json(), mode=0o600, durable=False)
        _serve(s, idle_exit_s, lambda: stopping["flag"], lock_id)
        _remove_pid_file(Paths(s).pid, me)
    log.info("daemon %d stopped", os.getpid())
    return 0


def _serve(s: Settings, idle_exit_s: float, stopping: Callable[[], bool], lock_id: Optional[tuple[int, int]]) -> None:
    """Tick every poll interval until told to stop, idle for ``idle_exit_s``, or the lock file
    is no longer ``lock_id``, the one this daemon took."""
    from detslurm.slurm.client import client_from_env
    from detslurm.slurm.site import load_site_config

    site = load_site_config()
    client = client_from_env()
    ctl = make_controller(s, site, client=client)
    detached = detached_ingest(s, ctl, client)
    settle_heap()
    # The site's floor wins over a user's faster setting: many daemons polling squeue quickly
    # would load slurmctld for everyone.
    interval = max(site.poll_interval_s, s.poll_interval_s)
    log.info("daemon %d started: store %s, polling every %.1f s", os.getpid(), _safe_url(s.db_url), interval)
    _write_status(s, TickStatus(os.getpid(), interval, None, True, 0))
    idle_since = time.monotonic()
    while not stopping():
        if lock_id is None or _file_id(Paths(s).lock) != lock_id:
            # Its data dir was deleted or replaced (a user "resetting" detslurm): a daemon left
            # running would poll Slurm for good, unseen by `det daemon stop`, beside the next one
            # started on the new store.
            log.warning("%s was removed or replaced: this daemon no longer drives that store; exiting", Paths(s).lock)
            return
        ids: list[int] = []
        ok = False
        try:
            ids = ctl.active_experiment_ids()
            if ids:
                cpu, wall, calls = time.process_time(), time.perf_counter(), client.calls
                ctl.tick(ids)
                _tick_stats(cpu, wall, client.calls - calls)
            # Detached runs keep the daemon from idling out while they run.
            if _detached_step(detached) or ids:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > idle_exit_s:
                log.info("nothing to do for %.0f s: exiting", idle_exit_s)
                return
            ok = True
        # Any failure (slurmctld down, store locked, a bug on one experiment) is logged and the
        # next tick retries: the daemon must not die and leave every experiment undriven.
        except Exception:
            log.exception("tick failed; retrying in %.1f s", interval)
        _write_status(s, TickStatus(os.getpid(), interval, time.time(), ok, len(ids)))
        end = time.monotonic() + interval
        while not stopping() and time.monotonic() < end:
            # Short sleeps so SIGTERM stops the daemon within 0.2 s, not after a whole interval.
            time.sleep(min(0.2, interval))


def _write_status(s: Settings, status: TickStatus) -> None:
    """Rewrite the status file; a failure to write it never stops the daemon."""
    try:
        # Private like the pid file; not fsynced: a status lost in a crash is stale anyway.
        atomic_write_text(Paths(s).status, status.to_json(), mode=0o600, durable=False)
    except OSError as e:
        log.warning("cannot write %s: %s", Paths(s).status, e.strerror)


def _file_id(path: Path) -> Optional[tuple[int, int]]:
    """The file at ``path`` (device and inode), or None where nothing is there."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _tick_stats(cpu_start: float, wall_start: float, slurm_calls: int) -> None:
    """One line for the tick that just ended, where $DETSLURM_TICK_STATS names a file (CPU and wall
    seconds, Slurm commands): how bench/asha_scale.py reads the real daemon's own cost per tick."""
    path = settings_mod.TICK_STATS.get()
    if path is None:
        return
    cpu, wall = time.process_time() - cpu_start, time.perf_counter() - wall_start
    with open(path, "a") as f:
        f.write(json.dumps({"cpu_s": round(cpu, 6), "wall_s": round(wall, 6), "slurm_calls": slurm_calls}) + "\n")


def settle_heap() -> None:
    """Exempt what start-up built (modules, classes, the config) from the cyclic collector:
    a full collection would otherwise walk it all again every few ticks, about 50 ms of a
    tick at 10,000 trials. Only cycle detection is affected; freed objects are still freed."""
    gc.collect()
    gc.freeze()


def _remove_pid_file(path: Path, me: PidRecord) -> None:
    """Remove the pid file only while it still names this process (never a successor's)."""
    try:
        if PidRecord.parse(path.read_text()) == me:
            path.unlink()
    except FileNotFoundError:
        pass


def main(argv: Optional[list[str]] = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    s = settings_mod.load()
    if args[:1] == ["run"]:
        # An idle daemon exits (after 10 minutes by default) so no process lingers on a shared login
        # node; the next `det e create` or activate starts one again.
        return run_forever(s, settings_mod.DAEMON_IDLE_EXIT_S.get())
    print("usage: python -m detslurm.daemon run", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
