"""The per-run secret that authenticates a trial's collectives (docs/design/security.md).

Created on the login node for every run (``write_run_secret``), 0600 in the run's private dir, and
named to the job by ``DETSLURM_RUN_SECRET_FILE``; every rank reads it with ``read_run_secret``,
which refuses a file another user could have written or read. It is random, never derived from
ids: the job name, the trial and experiment ids are all public in ``squeue``.

Where no file is named (local dev, a launcher run by hand, tests), the launcher makes a fresh
secret and hands it to its ranks in ``DETSLURM_DIST_SECRET`` (hex): a process's environment is
readable only by its own user and root. Stdlib only: the login side and every rank import this.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from detslurm import settings
from detslurm.util import open_regular

SECRET_FILE_ENV = settings.RUN_SECRET_FILE.name
# A job protocol variable: the local controller drops it from the daemon's own environment
# before a trial starts (a trial must get a fresh one).
SECRET_ENV = settings.DIST_SECRET.name
SECRET_FILE_NAME = "run-secret"
# 256 bits: the secret keys an HMAC that anyone on the cluster may try to forge.
SECRET_BYTES = 32
# The file is 65 bytes when we write it; reading at most this much bounds a planted huge file.
_MAX_FILE_BYTES = 4096
# fsyncs in flight at once: enough for the filesystem to batch its commits, few enough threads.
_BATCH = 256  # runs per batch (descriptors held at once)
_FSYNC_THREADS = 16


class RunSecretError(Exception):
    """The run secret is missing, unreadable, or not private to this user."""


def new_secret() -> bytes:
    """A fresh random secret (32 bytes from the OS CSPRNG)."""
    return secrets.token_bytes(SECRET_BYTES)


def write_run_secret(run_dir: os.PathLike[str] | str, name: str = SECRET_FILE_NAME) -> Path:
    """Create ``run_dir/name`` holding a fresh secret (hex), mode 0600; its path.

    Refuses to reuse or follow anything already there (O_EXCL|O_NOFOLLOW). Readers on other nodes
    never see a half-written file: the secret is written under a random temporary name first and
    then hard-linked into place, which fails if the name exists.
    """
    return write_run_secrets([run_dir], name)[0]


def write_run_secrets(run_dirs: Sequence[os.PathLike[str] | str], name: str = SECRET_FILE_NAME) -> list[Path]:
    """``write_run_secret`` for many runs at once (a job array's): their paths, in order.

    Every secret is durable before its name appears, as for one: each temporary file is fsynced
    before it is linked into place. The fsyncs run concurrently, after all files are written: one
    at a time, each waits for its own journal commit (256 secrets took 0.7 s on ext4); together,
    the filesystem commits them in a few batches.
    """
    # In chunks: a batch holds one descriptor per run, and a big array must not run out of them.
    if len(run_dirs) > _BATCH:
        return [p for i in range(0, len(run_dirs), _BATCH) for p in write_run_secrets(run_dirs[i : i + _BATCH], name)]
    temps: list[tuple[Path, Path]] = []
    fds: list[int] = []
    try:
        try:
            for d in run_dirs:
                fds.append(_write_temp(Path(d), name, temps))
            _fsync_all(fds)
        finally:
            for fd in fds:
                os.close(fd)
        for tmp, final in temps:
            # link(), not rename(): rename would silently replace an existing secret, link fails
            # instead, and either way readers only ever see the complete file.
            try:
                os.link(tmp, final)
            except FileExistsError:
                raise RunSecretError(f"{final} already exists: a run secret is never reused") from None
            except OSError as e:
                raise RunSecretError(f"cannot write the run secret {final}: {e.strerror}") from None
    finally:
        for tmp, _ in temps:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    # The names too, before sbatch: a job started after a crash of this host must find its secret.
    _fsync_dirs(sorted({final.parent for _, final in temps}))
    return [final for _, final in temps]


def _fsync_dirs(dirs: Sequence[Path]) -> None:
    fds: list[int] = []
    try:
        for d in dirs:
            fds.append(os.open(d, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)))
        _fsync_all(fds)
    except OSError as e:
        raise RunSecretError(f"cannot write the run secrets to disk: {e.strerror}") from None
    finally:
        for fd in fds:
            os.close(fd)


def _write_temp(run_dir: Path, name: str, temps: list[tuple[Path, Path]]) -> int:
    """A fresh secret in a new private temporary file of ``run_dir`` (noted in ``temps`` for the
    caller to link and remove); its still open descriptor."""
    final = run_dir / name
    # A random temp name: a predictable one could be pre-created (or symlinked) by another user in a
    # shared directory.
    tmp = final.with_name(f".{name}.{secrets.token_hex(8)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(tmp, flags, 0o600)
    except OSError as e:
        raise RunSecretError(f"cannot create the run secret in {run_dir}: {e.strerror}") from None
    temps.append((tmp, final))
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != 0o600:
            os.fchmod(fd, 0o600)  # the umask took bits off: owner read/write, whatever it is
        data = (new_secret().hex() + "\n").encode()
        if os.write(fd, data) != len(data):  # 65 bytes to a new regular file: short only on a full disk
            raise RunSecretError(f"cannot write the run secret {final}: short write")
    except OSError as e:
        os.close(fd)
        raise RunSecretError(f"cannot write the run secret {final}: {e.strerror}") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _fsync_all(fds: Sequence[int]) -> None:
    """fsync every descriptor, several at a time (see ``write_run_secrets``)."""
    try:
        if len(fds) <= 1:
            for fd in fds:
                os.fsync(fd)
            return
        with ThreadPoolExecutor(max_workers=min(_FSYNC_THREADS, len(fds))) as pool:
            list(pool.map(os.fsync, fds))  # list(): re-raises the first failure
    except OSError as e:
        raise RunSecretError(f"cannot write the run secrets to disk: {e.strerror}") from None


def ensure_run_secret(run_dir: os.PathLike[str] | str, name: str = SECRET_FILE_NAME) -> Path:
    """The run's secret file for a submission: created if missing; if the same run is submitted
    again (recovery, a retried sbatch), the existing file is kept once it passes the checks."""
    path = Path(run_dir) / name
    if not os.path.lexists(path):
        try:
            return write_run_secret(run_dir, name)
        except RunSecretError:
            if not os.path.lexists(path):  # not lost to a concurrent writer: a real failure
                raise
    read_run_secret(path)
    return path


def ensure_run_secrets(run_dirs: Sequence[os.PathLike[str] | str], name: str = SECRET_FILE_NAME) -> list[Path]:
    """``ensure_run_secret`` for many runs (a submission's), with the new secrets written by one
    ``write_run_secrets``: its concurrent fsyncs instead of one commit per run."""
    missing = [d for d in run_dirs if not os.path.lexists(Path(d) / name)]
    # A failure here may be a concurrent writer that won a name: each is checked (or made) alone below.
    with contextlib.suppress(RunSecretError):
        write_run_secrets(missing, name)
    return [ensure_run_secret(d, name) for d in run_dirs]


def read_run_secret(path: os.PathLike[str] | str) -> bytes:
    """The secret in ``path``, after checking that only we could have written or read it.

    The checks run on the opened file (fstat), so the file cannot be swapped between the check
    and the read; O_NOFOLLOW refuses a symlink, O_NONBLOCK keeps a planted FIFO from hanging us.
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        opened = open_regular(path, flags)
    except OSError as e:
        why = "is a symlink" if e.errno == errno.ELOOP else e.strerror
        raise RunSecretError(f"cannot open the run secret {path}: {why}") from None
    if opened is None:
        raise RunSecretError(f"the run secret {path} is not a regular file")
    f, st = opened
    with f:
        # Another user's file could hold a secret they know; a group- or world-readable one could have been
        # read by them. Either would let them join or impersonate our ranks.
        if st.st_uid != os.geteuid():
            raise RunSecretError(f"the run secret {path} is owned by uid {st.st_uid}, not by us ({os.geteuid()})")
        if st.st_mode & 0o077:
            raise RunSecretError(f"the run secret {path} has mode {stat.S_IMODE(st.st_mode):o}: it must be 600")
        raw = f.read(_MAX_FILE_BYTES)
    return _decode(raw.decode("ascii", "replace"), str(path))


def wait_run_secret(path: os.PathLike[str] | str, timeout_s: float = 120.0) -> bytes:
    """``read_run_secret`` once another node has created ``path`` (polls until ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    # The shared filesystem may show a file created on another node only after a delay (attribute
    # caching on NFS), so poll rather than fail on the first look.
    while not os.path.lexists(path):
        if time.monotonic() > deadline:
            raise RunSecretError(f"the chief node did not create the run secret {path} within {timeout_s:.0f} s")
        time.sleep(0.05)
    return read_run_secret(path)


def secret_from_env(env: Mapping[str, str]) -> bytes:
    """This run's secret: the file named by DETSLURM_RUN_SECRET_FILE, else DETSLURM_DIST_SECRET.

    There is deliberately no default: without a secret, distributed groups do not form.
    """
    path = settings.RUN_SECRET_FILE.raw(env)
    if path:
        return read_run_secret(path)
    hex_secret = settings.DIST_SECRET.raw(env)
    if hex_secret:
        return _decode(hex_secret, SECRET_ENV)
    raise RunSecretError(
        f"no run secret: neither {SECRET_FILE_ENV} nor {SECRET_ENV} is set. Start distributed ranks with a "
        "detslurm launcher (python -m determined.launch.torch_distributed ...), or set one of them"
    )


def _decode(text: str, where: str) -> bytes:
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError:
        raise RunSecretError(f"the run secret in {where} is not hex") from None
    # A short secret (a hand-set DETSLURM_DIST_SECRET) would make the HMAC guessable.
    if len(secret) < SECRET_BYTES:
        raise RunSecretError(f"the run secret in {where} has {len(secret)} bytes; at least {SECRET_BYTES} are needed")
    return secret
