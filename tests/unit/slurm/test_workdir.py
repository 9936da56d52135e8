"""The node-local working dir (docs/design/security.md): fresh, private, verified, swept.

In-process checks of detslurm/exec/workdir.py and the launcher's use of it; the attack by a
second user on the real cluster is in tests/security/test_security_workdir.py.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from detslurm.context import package, write_tarball
from detslurm.exec import workdir
from detslurm.exec.launch import _run_hook
from detslurm.exec.workdir import MARKER, STALE_AFTER_S, WorkdirError
from detslurm.protocol import NODE_TMPDIR_ENV

NOBODY = 65534
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700)
    return path


def shared_dir(path: Path) -> Path:
    path.mkdir()
    path.chmod(0o1777)
    return path


# -- creation ------------------------------------------------------------------------------------
def test_create_is_fresh_private_and_marked(tmp_path: Path) -> None:
    planted = tmp_path / "detslurm-77-node0"  # the old predictable name, pre-created
    planted.mkdir(mode=0o777)
    a = workdir.create(tmp_path, "77", "0")
    b = workdir.create(tmp_path, "77", "0")
    assert a.top != b.top and planted not in (a.top, b.top)
    assert a.top.name.startswith("detslurm-77-node0-") and a.path == a.top / "work"
    assert mode(a.top) == mode(a.path) == 0o700
    marker = json.loads((a.top / MARKER).read_text())
    assert marker["job_id"] == "77" and marker["pid"] == os.getpid() and marker["start"]
    assert mode(a.top / MARKER) == 0o600
    workdir.remove(a)
    assert not a.top.exists() and b.top.exists()


def test_hostile_job_ids_stay_one_path_component(tmp_path: Path) -> None:
    wd = workdir.create(tmp_path, "../../etc/x", "0;id")
    assert wd.top.parent == tmp_path and "/" not in wd.top.name and ";" not in wd.top.name


def test_verify_private_refuses_links_files_and_loose_modes(tmp_path: Path) -> None:
    real = private_dir(tmp_path / "real")
    link = tmp_path / "link"
    link.symlink_to(real)
    file = tmp_path / "file"
    file.write_text("x")
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o755)
    workdir.verify_private(real)
    for path, why in ((link, "a symlink or a file"), (file, "a symlink or a file"), (loose, "mode 755, not 700")):
        with pytest.raises(WorkdirError, match=why):
            workdir.verify_private(path)
    with pytest.raises(WorkdirError, match="No such file"):
        workdir.verify_private(tmp_path / "missing")


@root_only
def test_verify_private_refuses_another_users_dir(tmp_path: Path) -> None:
    theirs = private_dir(tmp_path / "theirs")
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(WorkdirError, match=f"owned by uid {NOBODY}, not by us"):
        workdir.verify_private(theirs)


def test_create_in_a_missing_base_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(WorkdirError, match=f"cannot create a working dir in {tmp_path / 'nope'}"):
        workdir.create(tmp_path / "nope", "1", "0")


# -- where -----------------------------------------------------------------------------------------
def test_base_prefers_private_job_scratch_then_site_then_shared(tmp_path: Path) -> None:
    slurm_tmp, private_tmp = private_dir(tmp_path / "slurm"), private_dir(tmp_path / "job-tmp")
    shared, site = shared_dir(tmp_path / "shared"), shared_dir(tmp_path / "site")
    env = {"SLURM_TMPDIR": str(slurm_tmp), "TMPDIR": str(private_tmp), NODE_TMPDIR_ENV: str(site)}
    assert workdir.choose_base(env) == slurm_tmp
    assert workdir.choose_base({**env, "SLURM_TMPDIR": ""}) == private_tmp
    # A shared TMPDIR (1777) is not per-job: the site's node_tmpdir comes first, then it.
    assert workdir.choose_base({**env, "SLURM_TMPDIR": "", "TMPDIR": str(shared)}) == site
    assert workdir.choose_base({"TMPDIR": str(shared)}) == shared
    loose = tmp_path / "loose"  # world-writable without the sticky bit: others could swap our dir
    loose.mkdir()
    loose.chmod(0o777)
    assert workdir.choose_base({"TMPDIR": str(loose), NODE_TMPDIR_ENV: str(loose)}) == Path("/tmp")
    assert workdir.choose_base({"TMPDIR": "relative", NODE_TMPDIR_ENV: str(tmp_path / "missing")}) == Path("/tmp")
    assert workdir.choose_base({}) == Path("/tmp")


@root_only
def test_base_skips_scratch_that_is_not_ours(tmp_path: Path) -> None:
    theirs, site = private_dir(tmp_path / "theirs"), shared_dir(tmp_path / "site")
    os.chown(theirs, NOBODY, NOBODY)
    assert workdir.choose_base({"SLURM_TMPDIR": str(theirs), NODE_TMPDIR_ENV: str(site)}) == site


# -- sweeping --------------------------------------------------------------------------------------
def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def left_behind(base: Path, job: str, age_s: float, **marker: object) -> Path:
    """A workdir as a launcher killed by SIGKILL leaves it, ``age_s`` old."""
    wd = workdir.create(base, job, "0")
    data = json.loads((wd.top / MARKER).read_text())
    data.update(marker)
    (wd.top / MARKER).write_text(json.dumps(data))
    (wd.path / "train.py").write_text("secret code")
    old = time.time() - age_s
    os.utime(wd.top, (old, old))
    return wd.top


def test_sweep_removes_only_our_dead_launchers_old_dirs(tmp_path: Path) -> None:
    day = STALE_AFTER_S + 60
    dead = left_behind(tmp_path, "1", day, pid=dead_pid())
    reused_pid = left_behind(tmp_path, "2", day, start="1")  # our pid now, but another start time
    alive = left_behind(tmp_path, "3", day)  # this process: its launcher still runs
    young = left_behind(tmp_path, "4", 60, pid=dead_pid())
    other_host = left_behind(tmp_path, "5", day, pid=dead_pid(), host="elsewhere")
    no_marker = left_behind(tmp_path, "6", day, pid=dead_pid())
    (no_marker / MARKER).unlink()
    os.utime(no_marker, (time.time() - day, time.time() - day))
    target = private_dir(tmp_path / "target")
    (tmp_path / "detslurm-7-node0-link").symlink_to(target)
    removed = workdir.sweep_stale(tmp_path)
    assert sorted(removed) == sorted([dead, reused_pid])
    assert all(p.exists() for p in (alive, young, other_host, no_marker, target))
    assert workdir.sweep_stale(tmp_path / "missing") == []


@root_only
def test_sweep_leaves_other_users_dirs_alone(tmp_path: Path) -> None:
    theirs = left_behind(tmp_path, "1", STALE_AFTER_S + 60, pid=dead_pid())
    for path in (theirs, theirs / MARKER):
        os.chown(path, NOBODY, NOBODY)
    assert workdir.sweep_stale(tmp_path) == [] and theirs.exists()


# -- the startup hook's environment ----------------------------------------------------------------
def test_hook_exports_come_back_through_a_pipe_not_a_file(tmp_path: Path) -> None:
    wd = private_dir(tmp_path / "wd")
    (wd / "startup-hook.sh").write_text("export FROM_HOOK='a b=c'\nsleep 30 &\n")
    env = {"PATH": os.environ["PATH"], "SECRET": "s3cret"}
    t0 = time.monotonic()
    assert _run_hook(wd, env) == 0
    # The background sleep does not hold the pipe open: we do not wait for it.
    assert time.monotonic() - t0 < 20  # not the 30 s sleep
    assert env["FROM_HOOK"] == "a b=c" and env["SECRET"] == "s3cret" and "SHLVL" not in env
    assert sorted(p.name for p in wd.iterdir()) == ["startup-hook.sh"]  # no .hook-env on disk


def test_failing_hook_changes_nothing(tmp_path: Path) -> None:
    wd = private_dir(tmp_path / "wd")
    (wd / "startup-hook.sh").write_text("export X=1\nfalse\n")
    env = {"PATH": os.environ["PATH"]}
    assert _run_hook(wd, env) != 0 and "X" not in env


# -- the launcher, as a Slurm job step would run it ------------------------------------------------
PROBE = """
import json, os, stat, sys
cwd = os.getcwd()
out = {"cwd": cwd, "mode": oct(stat.S_IMODE(os.stat(cwd).st_mode)), "hook": os.environ.get("FROM_HOOK"),
       "code_mode": oct(stat.S_IMODE(os.stat("probe.py").st_mode)), "json_from": json.__file__,
       "files": sorted(os.listdir(os.path.dirname(cwd)))}
open(os.environ["PROBE_OUT"], "w").write(json.dumps(out))
"""


def test_launcher_in_a_slurm_job_uses_a_fresh_private_dir_and_removes_it(tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "probe.py").write_text(PROBE)
    (ctx / "startup-hook.sh").write_text("export FROM_HOOK=yes\n")
    exp = tmp_path / "exp"
    write_tarball(package(ctx), exp / "context.tar.gz")
    (exp / "trials/1/runs/1").mkdir(parents=True)
    scratch = shared_dir(tmp_path / "scratch")
    planted = scratch / "detslurm-4242-node0"
    planted.mkdir(mode=0o777)
    (planted / "json.py").write_text("raise SystemExit('planted json imported')\n")
    (planted / "startup-hook.sh").write_text("exit 7\n")
    out = tmp_path / "probe.json"
    env = {
        "PATH": os.environ["PATH"],
        "SLURM_JOB_ID": "4242",
        "SLURM_NODEID": "0",
        "DET_RESOURCES_TYPE": "slurm-job",
        "DETSLURM_EXP_DIR": str(exp),
        "DET_TRIAL_ID": "1",
        "DET_TRIAL_RUN_ID": "1",
        "DET_EXPERIMENT_CONFIG": json.dumps({"entrypoint": "python3 probe.py"}),
        "TMPDIR": str(scratch),
        "PROBE_OUT": str(out),
    }
    r = subprocess.run([sys.executable, "-m", "detslurm.exec.launch"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    probe = json.loads(out.read_text())
    assert Path(probe["cwd"]).parent.parent == scratch and Path(probe["cwd"]).parent != planted
    assert probe["mode"] == "0o700" and probe["code_mode"] == "0o600" and probe["hook"] == "yes"
    assert str(planted) not in probe["json_from"] and probe["files"] == [MARKER, "work"]
    assert not Path(probe["cwd"]).exists()  # removed at the end
    assert sorted(p.name for p in scratch.iterdir()) == [planted.name]
    assert json.loads((exp / "trials/1/runs/1/exit-node0.json").read_text())["code"] == 0


def test_render_passes_the_site_node_tmpdir_only_when_set() -> None:
    from test_render import config

    from detslurm.slurm.render import Identity, plan_trial_run, resource_plan
    from detslurm.slurm.site import SiteConfig

    def script(site: SiteConfig) -> str:
        cfg = config()
        res = resource_plan(cfg, site)
        return plan_trial_run(
            config=cfg, site=site, res=res, ident=Identity(1, 1, 1), env={}, run_dir="/r", log_path="/r/o", python="/p"
        ).script

    assert f'export {NODE_TMPDIR_ENV}="${{SLURM_TMPDIR:-/l}}/det"' in script(
        SiteConfig(node_tmpdir="${SLURM_TMPDIR:-/l}/det")
    )
    assert NODE_TMPDIR_ENV not in script(SiteConfig()) and "DETSLURM_WORKDIR" not in script(SiteConfig())
