"""Where root's `det` meets what another user controls: the child it starts as a trial's owner
(controller/queue_store.py's AsOwner), the owner's stored config behind root's pool move, the
daemon files root lists (`det --all-users daemon status`), and the site install's PREFIX.

The second Unix user attacks as herself: she owns the child root starts for her, so she may
ptrace it (no Yama here), and she writes her own config file, store and daemon dir."""

from __future__ import annotations

import json
import os
import pty
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLES, ROOT
from security_harness import Attacker, run_as, shared_det

from detslurm import queue as q
from detslurm.slurm.parse import NodeInfo, QueuedJob
from detslurm.slurm.partitions import PartitionInfo
from detslurm.slurm.site import SiteConfig
from detslurm.slurm.states import SlurmState

pytestmark = pytest.mark.security
CONTROL = [chr(c) for c in [*range(0x20), *range(0x7F, 0xA0)] if chr(c) != "\t"]


@pytest.fixture(scope="module")
def shared_python() -> Path:
    """An interpreter with this checkout that every user can run (root's own may not be)."""
    return shared_det(ROOT).parent / "python"


@pytest.fixture
def owner_config(mallory: Attacker) -> Iterator[Path]:
    """Her config file's path in her passwd home (all root's child knows of her), made if
    missing (the harness user has no home) and removed after."""
    home = Path(mallory.user.pw_dir)
    made = not home.exists()
    if made:
        home.mkdir(mode=0o700)
        os.chown(home, mallory.uid, mallory.user.pw_gid)
    config = home / ".config/detslurm/config.yaml"
    r = run_as(mallory.user, ["mkdir", "-p", str(config.parent)])
    assert r.returncode == 0, r.stderr
    yield config
    if made:
        shutil.rmtree(home, ignore_errors=True)
    else:
        run_as(mallory.user, ["rm", "-rf", str(config.parent)])


# Attaches to the child root started as her (found by its command line), runs open("/dev/tty")
# and TIOCSTI in it, puts it back as it was and reports what the calls returned. x86_64 only.
INJECT = r"""
import ctypes, json, os, sys, time
fifo = sys.argv[1]
deadline = time.time() + 90
while True:  # root's child opens her config (a FIFO): then its read blocks
    try:
        writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        break
    except OSError:
        if time.time() > deadline:
            sys.exit("the child never opened the config")
        time.sleep(0.05)
pid = next(
    int(p) for p in os.listdir("/proc")
    if p.isdigit() and os.stat("/proc/" + p).st_uid == os.getuid()
    and b"detslurm.controller.queue_store" in open("/proc/%s/cmdline" % p, "rb").read()
)
while open("/proc/%d/syscall" % pid).read().split()[0] != "0":  # blocked in read(2)
    time.sleep(0.05)
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
NAMES = "r15 r14 r13 r12 rbp rbx r11 r10 r9 r8 rax rcx rdx rsi rdi orig_rax rip cs eflags rsp ss fs_base gs_base ds es fs gs"
class Regs(ctypes.Structure):
    _fields_ = [(n, ctypes.c_ulonglong) for n in NAMES.split()]
ATTACH, GETREGS, SETREGS, POKEDATA, SINGLESTEP, DETACH = 16, 12, 13, 5, 9, 17
def pt(req, addr=None, data=None):
    if libc.ptrace(req, pid, addr, data) == -1 and ctypes.get_errno():
        sys.exit("ptrace %d: %s" % (req, os.strerror(ctypes.get_errno())))
pt(ATTACH); os.waitpid(pid, 0x40000000)
saved = Regs(); pt(GETREGS, None, ctypes.byref(saved))
buf = (saved.rsp - 2048) & ~15
data = b"/dev/tty".ljust(16, b"\0") + b"PWNED".ljust(8, b"\0")
for i in range(0, len(data), 8):
    pt(POKEDATA, ctypes.c_void_p(buf + i), ctypes.c_void_p(int.from_bytes(data[i:i + 8], "little")))
def call(nr, a=0, b=0, c=0):  # the syscall instruction the child stopped after, run again
    r = Regs.from_buffer_copy(saved)
    r.rax, r.orig_rax, r.rdi, r.rsi, r.rdx, r.rip = nr, 2**64 - 1, a, b, c, saved.rip - 2
    pt(SETREGS, None, ctypes.byref(r)); pt(SINGLESTEP); os.waitpid(pid, 0x40000000)
    out = Regs(); pt(GETREGS, None, ctypes.byref(out))
    return ctypes.c_longlong(out.rax).value
fd = call(2, buf, 2 | 0o400)  # open("/dev/tty", O_RDWR | O_NOCTTY)
typed = [call(16, fd, 0x5412, buf + 16 + i) for i in range(5)] if fd >= 0 else []  # TIOCSTI
pt(SETREGS, None, ctypes.byref(saved)); pt(DETACH)
os.close(writer)  # the child reads an empty config and goes on
print(json.dumps({"open": fd, "typed": typed}))
"""

ROOT_SIDE = """
import sys
from detslurm.controller import queue_store as qs
print("FOUND", qs.AsOwner(sys.argv[1]).find(1, "tag").missing[:300])
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the injection is x86_64 machine code")
def test_the_child_root_starts_as_the_owner_cannot_type_into_roots_terminal(
    mallory: Attacker, owner_config: Path, shared_python: Path
) -> None:
    os.mkfifo(owner_config, 0o600)
    os.chown(owner_config, mallory.uid, mallory.user.pw_gid)
    # Root's det on a terminal (its controlling one), changing her job: AsOwner's child.
    pid, master = pty.fork()
    if pid == 0:
        env = {"PATH": "/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8"}
        os.execve(str(shared_python), [str(shared_python), "-c", ROOT_SIDE, mallory.user.pw_name], env)
    try:
        attack = mallory.python_snippet(INJECT, str(owner_config))
        screen = b""
        deadline = time.time() + 150  # a guard: the child's own timeout is 120 s
        while time.time() < deadline:
            if select.select([master], [], [], 1)[0]:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # EIO: root's det ended
                    break
                if not chunk:
                    break
                screen += chunk
    finally:
        os.close(master)
        os.waitpid(pid, 0)
    assert attack.returncode == 0, attack.stderr
    report = json.loads(attack.stdout)
    # She cannot open root's terminal from her process (ENXIO: it has none), and nothing she
    # typed reached root's shell.
    assert report["open"] < 0 and report["typed"] == [], report
    assert b"PWNED" not in screen and b"FOUND" in screen, screen


def test_the_owners_words_reach_roots_terminal_without_control_characters(
    mallory: Attacker, owner_config: Path, shared_python: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from detslurm.controller import queue_store as qs

    home = owner_config.parents[2]
    # Her store's dir names an OSC title and a screen clear (YAML's \e and \a escapes).
    text = f'data_dir: "{home}/d\\e]0;PWNED\\a\\e[2J"\nexperiments_dir: {home}/exps\ncheckpoint_dir: {home}/ckpts\n'
    r = run_as(mallory.user, ["sh", "-c", f"cat > '{owner_config}'"], input=text)
    assert r.returncode == 0, r.stderr
    monkeypatch.setattr(sys, "executable", str(shared_python))
    found = qs.AsOwner(mallory.user.pw_name).find(1, "tag")
    assert found.config is None and "PWNED" in found.where, found
    shown = found.where + found.missing
    assert not [c for c in CONTROL if c in shown], shown


def test_roots_changes_through_the_owners_child_are_in_the_audit_log(
    mallory: Attacker, owner_config: Path, shared_python: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """docs/admin/audit.md: every change root's command makes to another user's jobs is
    recorded; the child's (a kept priority or pool, the scancel of a replaced job) too."""
    from detslurm.audit import AuditLog
    from detslurm.controller import queue_store as qs
    from detslurm.errors import StateError

    home = owner_config.parents[2]
    r = run_as(mallory.user, ["sh", "-c", f"cat > '{owner_config}'"], input=f"data_dir: {home}/data\n")
    assert r.returncode == 0, r.stderr
    logs = tmp_path / "logs"
    logs.mkdir(mode=0o700)
    monkeypatch.setattr(sys, "executable", str(shared_python))
    name = mallory.user.pw_name
    owner = qs.AsOwner(name, AuditLog(logs / "audit.log", env={}))
    assert owner.find(1, "tag").config is None  # a read: the command's own record covers it
    assert not (logs / "audit.log").exists()
    with pytest.raises(StateError, match="has no experiment 1|did not submit this job"):
        owner.save_priority(1, 10, "tag")
    recs = [json.loads(line) for line in (logs / "audit.log").read_text().splitlines()]
    assert [(r["event"], r["owner"], r["request"]) for r in recs] == [
        (event, name, {"op": "priority", "experiment_id": 1, "tag": "tag", "priority": 10})
        for event in ("as_owner", "as_owner_result")
    ]
    assert recs[1]["error"] and recs[1]["user"] == "root"


# -- the owner's stored config behind root's pool move ----------------------------------------


def _partition(name: str) -> PartitionInfo:
    return PartitionInfo(
        name=name,
        default=name == "cpu",
        up=True,
        nodes=f"{name}1",
        total_nodes=1,
        total_cpus=8,
        max_nodes=None,
        max_time_s=None,  # Slurm's default MaxTime: UNLIMITED
        default_time_s=None,
        grace_time_s=0,
        max_cpus_per_node=None,
        allow_accounts=None,
        deny_accounts=None,
        allow_qos=None,
        deny_qos=None,
        preempt_mode="OFF",
        priority_tier=1,
    )


class _Client:
    def partitions(self) -> list[PartitionInfo]:
        return [_partition("cpu"), _partition("gpu")]

    def nodes(self) -> list[NodeInfo]:
        return [NodeInfo("cpu1", ("cpu",), "idle", 8, 0, 0, 0), NodeInfo("gpu1", ("gpu",), "idle", 8, 0, 2, 0)]


class _App:
    client = _Client()

    def site(self) -> SiteConfig:
        pools = {
            "cpu": {"partition": "cpu", "slots_per_node": 2, "account": "proj", "qos": "normal", "time_limit_min": 60},
            "gpu": {"partition": "gpu", "slot_type": "gpu", "slots_per_node": 2},
        }
        return SiteConfig.model_validate({"default_pool": "cpu", "pools": pools})


def test_roots_pool_move_of_another_users_job_takes_no_limits_from_her_stored_config(mallory: Attacker) -> None:
    """Her store is hers to write: after submitting, she sets a QOS, an account and a month's time
    limit in her experiment's sbatch_args, which Slurm would refuse her. Root's move of her job
    must not set them with root's rights."""
    from detslurm.cli import job as cli_job
    from detslurm.controller import queue_store as qs
    from detslurm.expconf import from_stored, load_config, merge_config

    config, _ = load_config(EXAMPLES / "core_api/const.yaml", default_storage={"type": "shared_fs", "host_path": "/x"})
    forged = ["--qos=vip", "--account=other", "--time=30-00:00:00"]
    stored = merge_config(config.as_dict(), {"slurm": {"sbatch_args": forged}})
    assert from_stored(stored, "<test>").slurm.sbatch_args == forged
    name = mallory.user.pw_name
    trial = qs.Trial(q.Keeper(1, "tag", f"{name}'s store"), qs.AsOwner(name), stored)
    job = QueuedJob(
        **dict.fromkeys(["job_id", "state_text", "reason", "nodelist", "gres", "submit_time", "start_time"], ""),
        raw_id=7,
        array_job_id=7,
        array_task_id=None,
        state=SlurmState.PENDING,
        partition="cpu",
        user=name,
        priority=1,
        num_nodes=1,
        num_cpus=1,
        time_limit="1:00:00",
        nice=0,
        name="det-e1-t1-r1",
        comment="",
    )
    shown = {"Partition": "cpu", "NumNodes": "1", "CPUs/Task": "1", "MinCPUsNode": "1", "NumCPUs": "1"}
    shown |= {"Account": "proj", "QOS": "normal", "TimeLimit": "01:00:00"}
    src, dst = cli_job._shapes(_App(), job, "gpu", trial, q.Caller("root", admin=True))  # type: ignore[arg-type]
    fields, _ = q.in_place(shown, src, dst)
    set_by_root = dict(fields)
    assert set_by_root.get("Partition") == "gpu"
    assert not {"QOS", "Account", "TimeLimit"} & set(set_by_root), set_by_root
    # Her own move (Slurm judges it with her rights) still asks for her values.
    src, dst = cli_job._shapes(_App(), job, "gpu", trial, q.Caller(name, admin=False))  # type: ignore[arg-type]
    assert (dst.qos, dst.account, dst.time) == ("vip", "other", "30-00:00:00")


# -- every user's daemon, on root's terminal ----------------------------------------------------


def test_a_daemon_dir_named_to_attack_roots_terminal_is_shown_plainly(
    det: Any, mallory: Attacker, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    site = tmp_path / "admin-site.yaml"
    site.write_text(f"audit_log: {tmp_path / 'log/audit.log'}\n")
    site.chmod(0o644)
    monkeypatch.setenv("DETSLURM_ADMIN_SITE_CONFIG", str(site))
    monkeypatch.delenv("DETSLURM_SITE_CONFIG", raising=False)
    det_bin = shared_det(ROOT)
    home = mallory.home
    # A title escape, a forged second row, and a byte that is not UTF-8 (\udcff is b"\xff").
    data = f"{home}/d\x1b]0;PWNED\x07\n root | 1 | forged\udcff"
    env = {
        "PATH": "/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": str(home),
        "DETSLURM_DATA_DIR": data,
        "DETSLURM_EXPERIMENTS_DIR": f"{home}/exps",
        "DETSLURM_CONFIG": f"{home}/no-config.yaml",
    }
    try:
        r = run_as(mallory.user, [str(det_bin), "daemon", "start"], env=env, cwd=str(home), errors="replace")
        assert r.returncode == 0, r.stdout + r.stderr
        code, out, err = det("--all-users", "daemon", "status")
        assert code == 0, err
        rows = [line for line in out.splitlines() if "PWNED" in line]
        assert len(rows) == 1 and mallory.user.pw_name in rows[0], out
        assert "forged" in rows[0] and not [c for c in CONTROL if c != "\n" and c in out], out
    finally:
        run_as(mallory.user, [str(det_bin), "daemon", "stop"], env=env, cwd=str(home))


# -- scripts/site-install ---------------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["/opt/site apps/det", '/opt/a"b', "/opt/det[exec id]", "/opt/a:b", "/opt/a$HOME"])
def test_site_install_refuses_a_prefix_its_module_files_cannot_hold(prefix: str, tmp_path: Path) -> None:
    """A space would put a relative directory on every user's PATH (Tcl splits the word), a
    quote end the Lua string, brackets or '$' run as Tcl in every user's shell."""
    target = tmp_path / prefix.lstrip("/")
    r = subprocess.run(
        [str(ROOT / "scripts/site-install"), str(target), "--python", "/nonexistent/python3"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "PREFIX may hold only" in r.stderr, r.stderr
    assert not target.exists() and not target.parent.exists()


@pytest.mark.parametrize("planted", ["prefix", "parent"])
def test_site_install_refuses_a_prefix_another_user_controls(planted: str, mallory: Attacker, tmp_path: Path) -> None:
    """She pre-creates the install dir (or owns the one above it): she could then swap the venv
    whose det every user, root included, runs."""
    hers = tmp_path / "sw"
    hers.mkdir()
    os.chown(hers, mallory.uid, mallory.user.pw_gid)
    prefix = hers if planted == "prefix" else hers / "detslurm"
    r = subprocess.run(
        [str(ROOT / "scripts/site-install"), str(prefix), "--python", "/nonexistent/python3"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and f"{hers} is owned by uid {mallory.uid}, not by root or by you" in r.stderr, r.stderr
    assert not prefix.exists() or not any(prefix.iterdir())
