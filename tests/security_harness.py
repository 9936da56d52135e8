"""A second Unix user on the same machine, for the security tests (the `security` marker).

The tests run as root (CI does; the Slurm test cluster needs it anyway). The session fixture
``mallory`` (tests/conftest.py) creates the system user ``detslurm-mallory`` if it is missing and
hands out an :class:`Attacker`, which runs stdlib-only Python snippets as that user, with a clean
environment, from a private directory of its own. The attacker uses the system ``python3``: the
repository and its venv may sit under paths the second user cannot enter (a fresh clone in CI,
/root here), and stdlib is all an attacker needs.

Victim data that a test wants attacked must live under :func:`victim_base`, a directory only
traversable by others (0711): then nothing but the product's own modes protects it, and a test
cannot pass just because pytest's private tmp dir (0700) is in the way.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

USER = "detslurm-mallory"
_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3")


class HarnessUnavailable(Exception):
    """The machine cannot host a second user (not root, no useradd, no usable python3)."""


def ensure_user(name: str = USER) -> pwd.struct_passwd:
    """The system user ``name``, created (no home, no login shell) if missing; needs root."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pass
    if os.geteuid() != 0:
        raise HarnessUnavailable("creating a second Unix user needs root")
    useradd = shutil.which("useradd") or "/usr/sbin/useradd"
    r = subprocess.run(
        [useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        capture_output=True,
        text=True,
    )
    try:  # a parallel session may have created it meanwhile: useradd then fails, and that is fine
        return pwd.getpwnam(name)
    except KeyError:
        raise HarnessUnavailable(f"useradd {name} failed: {r.stderr.strip()}") from None


def run_as(user: pwd.struct_passwd, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` as ``user`` (real and effective uid/gid, no supplementary groups) with a clean
    environment: nothing of the victim's (secrets in the environment included) leaks into it."""
    env = kw.pop("env", None) or {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/nonexistent"}
    cmd = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", "--", *argv]
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    kw.setdefault("timeout", 120)
    return subprocess.run(cmd, env=env, **kw)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Attacker:
    """The second user: runs Python snippets as itself, from a directory only it can write."""

    user: pwd.struct_passwd
    python: str
    home: Path

    @property
    def uid(self) -> int:
        return self.user.pw_uid

    def python_snippet(self, code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run ``code`` (dedented) as the attacker; its argv[1:] are ``args``."""
        script = Path(tempfile.mkstemp(dir=self.home, suffix=".py")[1])
        script.write_text(textwrap.dedent(code))
        os.chown(script, self.uid, self.user.pw_gid)
        return run_as(self.user, [self.python, str(script), *args], cwd=str(self.home), timeout=timeout)

    def can_read(self, path: Path) -> bool:
        """Whether the attacker can list (a directory) or read (a file) ``path``."""
        code = "import os,sys\np=sys.argv[1]\nos.listdir(p) if os.path.isdir(p) else open(p,'rb').read(1)\n"
        r = self.python_snippet(code, str(path))
        if r.returncode not in (0, 1) or (r.returncode == 1 and "PermissionError" not in r.stderr):
            raise AssertionError(f"the read probe of {path} failed unexpectedly: {r.stderr}")
        return r.returncode == 0


def make_attacker(user_name: str = USER) -> Attacker:
    """The user (created if needed), a usable system python3, and a private 0700 home in /tmp."""
    user = ensure_user(user_name)
    home = Path(tempfile.mkdtemp(prefix="detslurm-mallory-"))
    os.chown(home, user.pw_uid, user.pw_gid)
    for python in [*_PYTHONS, shutil.which("python3") or ""]:
        if python and run_as(user, [python, "-c", "import hmac, pickle, socket"], cwd=str(home)).returncode == 0:
            return Attacker(user, python, home)
    shutil.rmtree(home, ignore_errors=True)
    raise HarnessUnavailable(f"no python3 that {user_name} can run (tried {', '.join(_PYTHONS)})")


def victim_base() -> Path:
    """A fresh directory the attacker may traverse but not list (0711): victim data goes below."""
    base = Path(tempfile.mkdtemp(prefix="detslurm-victim-"))
    os.chmod(base, 0o711)
    return base


def shared_det(root: Path) -> Path:
    """A ``det`` every user can run: this checkout installed (with the PostgreSQL driver) into a
    venv built from the system python3 under ``root/.state``. The project's own venv may use an
    interpreter under a private home (root's pyenv) that other users cannot execute. The venv
    is kept between runs; only the checkout is reinstalled, so it runs the code under test."""
    python = next(p for p in _PYTHONS if os.access(p, os.X_OK))
    version = subprocess.run(
        [python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True, check=True
    ).stdout.strip()
    # One venv per interpreter: the 24.11 pass runs this checkout inside a chroot whose system
    # Python (3.13) differs from the host's, and a venv made by one cannot run under the other.
    venv = root / ".state" / f"shared-venv-py{version}"
    # The system python3 may be older than requires-python's floor (3.11.2 here), which exists
    # only for tarfile's extraction filters: extracting a context happens inside trials, never
    # in the CLI commands a second user runs in these tests.
    # pip byte-compiles what it installs, as root: the other users cannot write __pycache__ here,
    # and without bytecode each of their commands compiles its imports again (24 s of CPU for
    # one `det e describe` on a loaded machine, 2026-11-27). Hence no --no-compile.
    pip = [str(venv / "bin/python"), "-m", "pip", "install", "-q", "--ignore-requires-python"]
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    linkable = version == here and sys.prefix != sys.base_prefix and importlib.util.find_spec("psycopg") is not None
    if linkable:
        venv = venv.with_name(f"shared-link-py{version}")
    (root / ".state").mkdir(exist_ok=True)
    # scripts/test runs several pytest sessions at once: one pip at a time in this venv.
    with open(root / ".state" / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if linkable:
            _link_shared(python, venv, Path(sysconfig.get_paths()["purelib"]))
        else:
            _install_shared(python, venv, pip, root)
    for d in (root / ".state", venv):
        os.chmod(d, 0o755)
    return venv / "bin" / "det"


# What a second user's `det` imports: byte-compiled by root once, since that user cannot write
# __pycache__ in the project's venv (see shared_det).
_DET_IMPORTS = (
    "detslurm",
    "sqlalchemy",
    "alembic",
    "mako",
    "psycopg",
    "pydantic",
    "click",
    "yaml",
    "jinja2",
    "orjson",
    "google_crc32c",
)


def _link_shared(python: str, venv: Path, purelib: Path) -> None:
    """The shared venv as the system python3 over the project's own venv's packages, where
    both are the same Python version (a .pth adds that site dir, whose editable finder maps
    ``detslurm`` onto this checkout): what it runs is the code under test, with nothing to
    install. A pip install of the checkout and its dependencies took 5 min on CI's machine."""
    if not (venv / "bin/python").exists():
        subprocess.run([python, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3.*/site-packages"))
    (site / "detslurm-project-venv.pth").write_text(f"import site; site.addsitedir({str(purelib)!r})\n")
    det = venv / "bin/det"
    det.write_text(f"#!{venv}/bin/python\nimport sys\nfrom detslurm.cli.main import main\nsys.exit(main())\n")
    det.chmod(0o755)
    dirs = subprocess.run(
        [str(venv / "bin/python"), "-c", _PACKAGE_DIRS, *_DET_IMPORTS], capture_output=True, text=True, check=True
    ).stdout.split()
    subprocess.run([str(venv / "bin/python"), "-m", "compileall", "-q", "-j0", *dirs], check=False, capture_output=True)


# Prints the directory of each package named on the command line, as that interpreter finds it.
_PACKAGE_DIRS = textwrap.dedent(
    """
    import importlib.util, sys
    for name in sys.argv[1:]:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            print(list(spec.submodule_search_locations)[0])
    """
)


def _install_shared(python: str, venv: Path, pip: list[str], root: Path) -> None:
    # Reinstalled only when the checkout changed: another session may be running this det.
    stamp, want = venv / ".detslurm-tree", tree_hash(root)
    if not (venv / "bin" / "pip").exists():
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        subprocess.run([*pip, f"{root}[postgres]"], check=True)
    elif not stamp.exists() or stamp.read_text() != want:
        subprocess.run([*pip, "--no-deps", "--force-reinstall", str(root)], check=True)
        if subprocess.run([str(venv / "bin/python"), "-c", "import psycopg"], capture_output=True).returncode:
            subprocess.run([*pip, "psycopg[binary]>=3.1"], check=True)
    stamp.write_text(want)


def tree_hash(root: Path) -> str:
    """Of everything the package is built from (pyproject.toml's package-dir)."""
    h = hashlib.sha256((root / "pyproject.toml").read_bytes())
    for top in ("detslurm", "cli", "launchers", "templates"):
        for f in sorted((root / top).rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts:
                h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()
