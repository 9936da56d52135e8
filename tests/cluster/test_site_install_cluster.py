"""The install a site offers (docs/admin/install.md): scripts/site-install into a prefix, then a
second Unix user loads its module file and runs an experiment on the real test cluster.

The module files are loaded with Lmod (installed from Debian if missing, as tests/pg_harness.py
installs PostgreSQL); where Lmod cannot be had, their effect is applied by reading their
prepend_path lines, so the user's det still comes from the module file's PATH and nowhere else."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import EXAMPLES, ROOT
from security_harness import Attacker, run_as

pytestmark = [pytest.mark.slurm, pytest.mark.security]
_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3")
LMOD_INIT = Path("/usr/share/lmod/lmod/init/bash")


@pytest.fixture(scope="module")
def prefix() -> Iterator[Path]:
    """A site install made by the real script from this checkout, with the system python3 (one
    every user can run), in a directory every user may enter."""
    base = Path(tempfile.mkdtemp(prefix="detslurm-site-"))
    base.chmod(0o755)
    python = next(p for p in _PYTHONS if os.access(p, os.X_OK))
    r = subprocess.run(
        [str(ROOT / "scripts/site-install"), str(base / "detslurm"), "--python", python],
        capture_output=True,
        text=True,
        timeout=1800,  # a guard: pip builds and installs every dependency
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "module use" in r.stdout and "det site init -o /etc/detslurm/site.yaml" in r.stdout
    yield base / "detslurm"
    shutil.rmtree(base, ignore_errors=True)


def _lmod() -> Path:
    # scripts/test-cluster installs Lmod with the cluster's packages; without it this test would
    # not show that a real module system loads the file.
    assert LMOD_INIT.exists(), f"{LMOD_INIT} is missing: scripts/test-cluster installs Lmod (apt package lmod)"
    return LMOD_INIT


def test_the_install_exposes_only_det_is_root_s_alone_and_ships_the_template(prefix: Path) -> None:
    assert sorted(p.name for p in (prefix / "bin").iterdir()) == ["det", "detslurm"]  # no python, no pip
    for path in [prefix, *prefix.rglob("*")]:
        st = path.lstat()
        if not stat.S_ISLNK(st.st_mode):
            assert not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH), f"{path} is writable by others"
            assert st.st_mode & stat.S_IROTH, f"{path} is not readable by every user"
    lua = next((prefix / "modulefiles/detslurm").glob("*.lua"))
    tcl = next((prefix / "modulefiles-tcl/detslurm").iterdir())
    assert lua.name == "0.1.0.lua" and tcl.name == "0.1.0"
    assert re.findall(r'^prepend_path\("PATH", "(.*)"\)$', lua.read_text(), re.M) == [str(prefix / "bin")]
    assert re.findall(r"^prepend-path PATH (.*)$", tcl.read_text(), re.M) == [str(prefix / "bin")]
    r = subprocess.run([str(prefix / "bin/det"), "site", "init", "--example"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == (ROOT / "site-configs/generic.yaml").read_text(), r.stderr


def _module_argv(init: Path, modulefiles: Path, args: list[str]) -> list[str]:
    """argv that runs `det ARGS` as a user who loaded the module with Lmod."""
    script = 'source "$1" >/dev/null 2>&1 && module use "$2" && module load detslurm && shift 2 && exec det "$@"'
    return ["bash", "-c", script, "bash", str(init), str(modulefiles), *args]


def test_a_second_user_loads_the_module_and_runs_an_experiment_on_the_cluster(
    prefix: Path, mallory: Attacker, slurm_cluster: Path
) -> None:
    # Other users reach slurm.conf and munge's socket (as scripts/test-cluster opens the path; a
    # pytest session started since may have closed pytest's base dir again).
    for d in [slurm_cluster, *slurm_cluster.parents][:-1]:
        d.chmod(d.stat().st_mode | 0o001)
    home = Path(tempfile.mkdtemp(prefix="detslurm-site-user-"))
    os.chown(home, mallory.uid, mallory.user.pw_gid)
    # The user's own copies: the checkout may sit under a directory they cannot enter.
    shutil.copytree(EXAMPLES / "core_api", home / "core_api")
    shutil.copy(ROOT / "site-configs/test-cluster.yaml", home / "site.yaml")
    for sub in ("data", "exps", "ckpts"):
        (home / sub).mkdir()
    subprocess.run(["chown", "-R", f"{mallory.uid}:{mallory.user.pw_gid}", str(home)], check=True)
    env = {
        "PATH": "/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": str(home),
        "SLURM_CONF": str(slurm_cluster / "etc/slurm.conf"),
        "DETSLURM_DATA_DIR": str(home / "data"),
        "DETSLURM_EXPERIMENTS_DIR": str(home / "exps"),
        "DETSLURM_CHECKPOINT_DIR": str(home / "ckpts"),
        "DETSLURM_CONFIG": str(home / "no-config.yaml"),
        "DETSLURM_SITE_CONFIG": str(home / "site.yaml"),
        "DETSLURM_POLL_INTERVAL_S": "1",
    }
    init = _lmod()

    def det(*args: str, modulefiles: str = "modulefiles") -> subprocess.CompletedProcess[str]:
        argv = _module_argv(init, prefix / modulefiles, list(args))
        return run_as(mallory.user, argv, env=env, cwd=str(home), timeout=600)

    try:
        assert shutil.which("det", path=env["PATH"]) is None  # only the module puts det on PATH
        r = det("--version")
        assert r.returncode == 0 and "detslurm, version 0.1.0" in r.stdout, r.stdout + r.stderr
        # Lmod reads the Tcl module file too.
        r = det("--version", modulefiles="modulefiles-tcl")
        assert r.returncode == 0 and "detslurm, version 0.1.0" in r.stdout, r.stdout + r.stderr
        r = det("e", "create", str(home / "core_api/const.yaml"), str(home / "core_api"))
        assert r.returncode == 0 and "Created experiment 1" in r.stdout, r.stdout + r.stderr
        deadline = time.time() + 600  # a guard against a hang, not a timing
        state = ""
        while time.time() < deadline and state not in ("COMPLETED", "ERROR", "CANCELED"):
            time.sleep(2)
            r = det("e", "list", "--json")
            assert r.returncode == 0, r.stderr
            [exp] = json.loads(r.stdout)
            state = exp["state"]
        assert state == "COMPLETED", det("e", "describe", "1").stdout
        assert exp["owner"] == mallory.user.pw_name
        log = (home / "data/daemon.log").read_text()
        assert "daemon" in log and "Traceback" not in log, log[-3000:]
    finally:
        det("daemon", "stop")
        subprocess.run(["scancel", "-u", mallory.user.pw_name], env={**os.environ, **env}, check=False)
        shutil.rmtree(home, ignore_errors=True)
