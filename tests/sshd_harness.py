"""Real OpenSSH servers for the remote-mode tests: Debian's openssh-server (installed here when
missing, as root), private `sshd -D` processes on 127.0.0.1 with their own host keys, an
ordinary Unix user with an authorized key, and a `det` that user can run.

The system's own ssh service is never enabled or started: each server here has its own config,
host key and pid, and is stopped by its pid.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from conftest import ROOT
from security_harness import tree_hash

SSHD = Path("/usr/sbin/sshd")
USER = "detslurm-remote"


class Unavailable(Exception):
    pass


def ensure_openssh() -> None:
    if SSHD.exists() and shutil.which("ssh-keygen"):
        return
    if os.geteuid() != 0:
        raise Unavailable("openssh-server is not installed and installing it needs root")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "-o", "DPkg::Lock::Timeout=900", "install", "-y", "-qq", "openssh-server"]
    if subprocess.run(cmd, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "-o", "DPkg::Lock::Timeout=900", "update", "-qq"], env=env, check=True)
        subprocess.run(cmd, env=env, check=True, capture_output=True)


def ensure_user() -> pwd.struct_passwd:
    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "-m", "-s", "/bin/bash", USER], check=True)
    # useradd leaves the password "!" (locked), and sshd without PAM refuses locked accounts even
    # for keys; "*" means "no password" without the lock.
    subprocess.run(["usermod", "-p", "*", USER], check=True)
    return pwd.getpwnam(USER)


def keygen(path: Path, comment: str = "detslurm-test") -> Path:
    """An ed25519 key pair at path (and path.pub), no passphrase."""
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)], check=True)
    return path


def fingerprint(pub: Path) -> str:
    out = subprocess.run(["ssh-keygen", "-lf", str(pub)], capture_output=True, text=True, check=True).stdout
    return out.split()[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Sshd:
    """One private sshd on 127.0.0.1."""

    dir: Path
    port: int
    host_key: Path
    proc: subprocess.Popen[bytes]

    @property
    def log(self) -> str:
        return (self.dir / "sshd.log").read_text(errors="replace")

    def known_hosts_line(self) -> str:
        kind, b64 = Path(f"{self.host_key}.pub").read_text().split()[:2]
        return f"[127.0.0.1]:{self.port} {kind} {b64}\n"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_sshd(d: Path, authorized_keys: Path, sftp: bool = True) -> Sshd:
    """With ``sftp=False`` the server has no SFTP subsystem, as some login nodes are configured."""
    d.mkdir(parents=True, exist_ok=True)
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
    host_key = keygen(d / "host_ed25519", "host")
    port = free_port()
    conf = d / "sshd_config"
    conf.write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {host_key}\nPidFile {d / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {authorized_keys}\nStrictModes no\nUsePAM no\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nPubkeyAuthentication yes\nAllowTcpForwarding yes\n"
        f"AllowUsers {USER}\n{'Subsystem sftp internal-sftp' if sftp else ''}\nLogLevel DEBUG1\nMaxStartups 50\n"
    )
    with open(d / "sshd.log", "wb") as log:  # sshd keeps its own copy of the fd
        proc = subprocess.Popen([str(SSHD), "-D", "-e", "-f", str(conf)], stderr=log)
    deadline = time.time() + 15
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return Sshd(d, port, host_key, proc)
        except OSError:
            if proc.poll() is not None:
                raise Unavailable(f"sshd exited: {(d / 'sshd.log').read_text()}") from None
            time.sleep(0.1)
    proc.kill()
    raise Unavailable("sshd did not start listening")


def remote_det() -> tuple[Path, list[str]]:
    """A `det` the ssh user can run, and the setup lines it needs (the login node's `module
    load`). The project's interpreter lives under root's private home, so a copy of it (without
    its site-packages) goes to .state/, world-readable, with a venv holding this checkout."""
    py_src = Path(os.path.realpath(os.sys.executable)).parent.parent  # type: ignore[attr-defined]
    state = ROOT / ".state"
    py, venv = state / "remote-python", state / "remote-venv"
    lib = f"LD_LIBRARY_PATH={py / 'lib'}"
    state.mkdir(exist_ok=True)
    # Both Slurm-less and Slurm sessions of scripts/test may get here at once: one build at a time.
    with open(state / "remote-venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp, want = venv / ".detslurm-tree", tree_hash(ROOT)
        if not (py / "bin").exists():
            tar = subprocess.Popen(
                [
                    "tar",
                    "-C",
                    str(py_src),
                    "--exclude=./lib/python3.11/site-packages",
                    "--exclude=./lib/python3.11/test",
                    "-cf",
                    "-",
                    ".",
                ],
                stdout=subprocess.PIPE,
            )
            py.mkdir()
            subprocess.run(["tar", "-C", str(py), "-xf", "-"], stdin=tar.stdout, check=True)
            tar.wait()
            (py / "lib/python3.11/site-packages").mkdir(exist_ok=True)
        pybin = next((py / "bin").glob("python3.*[0-9]"))
        if not (venv / "bin/pip").exists():
            subprocess.run(["env", lib, str(pybin), "-m", "venv", str(venv)], check=True)
            # Byte-compiled by pip, as root: security_harness.shared_det says why.
            subprocess.run(["env", lib, str(venv / "bin/pip"), "install", "-q", str(ROOT)], check=True)
        elif (stamp.read_text() if stamp.exists() else "") != want:
            subprocess.run(
                ["env", lib, str(venv / "bin/pip"), "install", "-q", "--no-deps", "--force-reinstall", str(ROOT)],
                check=True,
            )
        # Reinstalled only when the checkout changed: the other session may be running this det.
        stamp.write_text(want)
    subprocess.run(["chmod", "-R", "a+rX", str(py), str(venv)], check=True)
    for p in [state, *state.parents]:
        if p == Path("/"):
            break
        if not os.stat(p).st_mode & 0o001:
            raise Unavailable(f"{p} is not traversable by other users; the ssh user cannot run {venv}")
    return venv / "bin/det", [f"export LD_LIBRARY_PATH={py / 'lib'}"]
