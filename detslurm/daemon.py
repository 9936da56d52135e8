"""The daemon: Determined's master, made small. One per user; restartable at any moment.

Each tick is one ``Controller.tick()``: one batched squeue for every active trial run of every
experiment, event ingest, searcher decisions, submissions, restarts. It never polls faster than
the site's floor, and exits after a while with nothing to do (``det e create`` starts it again).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Optional

import filelock
import psutil

from detslurm import settings as settings_mod
from detslurm.settings import Settings

if TYPE_CHECKING:
    from detslurm.controller.controller import Controller
    from detslurm.slurm.site import SiteConfig

# The controller, store and Slurm modules are imported on first use: a starting daemon takes
# its lock and writes its pid first, so `det e create` waits for it only briefly.

log = logging.getLogger("detslurm.daemon")


class Paths:
    def __init__(self, s: Settings) -> None:
        self.pid = s.data_dir / "daemon.pid"
        self.lock = s.data_dir / "daemon.lock"
        self.log = s.data_dir / "daemon.log"


def running_pid(s: Settings) -> Optional[int]:
    p = Paths(s)
    try:
        pid = int(p.pid.read_text().strip())
        proc = psutil.Process(pid)
        if proc.status() != psutil.STATUS_ZOMBIE and any("detslurm.daemon" in a for a in proc.cmdline()):
            return pid
    except (FileNotFoundError, ValueError, psutil.NoSuchProcess, psutil.AccessDenied):
        pass
    return None


@contextmanager
def controller_lock(s: Settings, timeout: float = 0) -> Iterator[bool]:
    """Held by whoever drives Slurm experiments now: the daemon, or a CLI doing one step."""
    s.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock = filelock.FileLock(str(Paths(s).lock))
    try:
        lock.acquire(timeout=timeout)
    except filelock.Timeout:
        yield False
        return
    try:
        yield True
    finally:
        lock.release()


def make_controller(s: Settings, site: Optional[SiteConfig] = None) -> Controller:
    from detslurm.controller.controller import Controller
    from detslurm.controller.slurm_executor import SlurmExecutor
    from detslurm.slurm.client import client_from_env
    from detslurm.slurm.site import load_site_config
    from detslurm.store import open_store

    return Controller(open_store(s.db_url), SlurmExecutor(client_from_env(), site or load_site_config()))


def reconcile_once(s: Settings) -> bool:
    """One tick, unless the daemon (or another CLI) is driving right now."""
    with controller_lock(s) as got:
        if not got:
            return False
        ctl = make_controller(s)
        if ctl.active_experiment_ids():
            ctl.tick()
        return True


def start(s: Settings, wait_s: float = 10.0) -> int:
    pid = running_pid(s)
    if pid is not None:
        return pid
    p = Paths(s)
    s.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(p.log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "detslurm.daemon", "run"],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        pid = running_pid(s)
        if pid is not None:
            return pid
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError(f"the detslurm daemon did not start; see {p.log}")


def stop(s: Settings, wait_s: float = 30.0) -> Optional[int]:
    pid = running_pid(s)
    if pid is None:
        return None
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and running_pid(s) is not None:
        time.sleep(0.1)
    return pid


def run_forever(s: Settings, idle_exit_s: float) -> int:
    stopping = {"flag": False}

    def on_term(_sig: int, _frame: object) -> None:
        stopping["flag"] = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    with controller_lock(s, timeout=5) as got:
        if not got:
            log.error("another detslurm daemon holds %s", Paths(s).lock)
            return 1
        Paths(s).pid.write_text(str(os.getpid()))
        from detslurm.slurm.site import load_site_config

        site = load_site_config()
        ctl = make_controller(s, site)
        interval = max(site.poll_interval_s, s.poll_interval_s)
        log.info("daemon %d started: store %s, polling every %.1f s", os.getpid(), s.db_url, interval)
        idle_since = time.monotonic()
        while not stopping["flag"]:
            try:
                ids = ctl.active_experiment_ids()
                if ids:
                    ctl.tick(ids)
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since > idle_exit_s:
                    log.info("nothing to do for %.0f s: exiting", idle_exit_s)
                    break
            except Exception:
                log.exception("tick failed; retrying in %.1f s", interval)
            end = time.monotonic() + interval
            while not stopping["flag"] and time.monotonic() < end:
                time.sleep(min(0.2, interval))
        Paths(s).pid.unlink(missing_ok=True)
    log.info("daemon %d stopped", os.getpid())
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    s = settings_mod.load()
    if args[:1] == ["run"]:
        return run_forever(s, float(os.environ.get("DETSLURM_DAEMON_IDLE_EXIT_S", "600")))
    print("usage: python -m detslurm.daemon run", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
