"""Store hardening without a database server: network filesystems, file locks, value
sanitising, masked URLs and read transactions on SQLite."""

from __future__ import annotations

import errno
import math
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from detslurm.errors import DetSlurmError, StoreError
from detslurm.store import Experiment, LogEntry, open_store
from detslurm.store.db import display_url
from detslurm.store.fs import fs_type, is_network_fs, network_fs_of, parse_mountinfo, warn_if_network_db
from detslurm.store.locks import LockError, hold_lock
from detslurm.store.sanitize import METRIC_GROUP_MAX, clean_text, json_safe, metric_group

MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
40 27 0:40 / /home rw,relatime shared:5 - nfs4 fs1:/export/home rw,vers=4.2
41 40 0:41 / /home/alice/local rw,relatime - ext4 /dev/sdb1 rw
42 27 0:42 / /lus rw - lustre 10.0.0.1@o2ib:/lus rw,flock
43 27 0:43 / /my\\040mount rw - gpfs gpfs0 rw
44 27 0:44 / /scratch rw - ext4 /dev/sdc rw
45 27 0:45 / /scratch rw - fuse.sshfs me@host:/x rw
not a mountinfo line
"""


def test_mountinfo_longest_prefix_wins() -> None:
    mounts = parse_mountinfo(MOUNTINFO)
    assert len(mounts) == 8
    assert fs_type("/home/alice/.local/share/detslurm", mounts) == "nfs4"
    assert fs_type("/home", mounts) == "nfs4"
    assert fs_type("/home/alice/local/db", mounts) == "ext4"  # a local disk mounted inside home
    assert fs_type("/homeless/x", mounts) == "ext4"  # a prefix of the name is not a parent dir
    assert fs_type("/lus/u/x", mounts) == "lustre"
    assert fs_type("/my mount/x", mounts) == "gpfs"  # \040 is a space
    assert fs_type("/scratch/a", mounts) == "fuse.sshfs"  # mounted later, on top
    assert is_network_fs("nfs4") and is_network_fs("fuse.sshfs") and not is_network_fs("fuse.ntfs-3g")
    assert not is_network_fs("ext4") and not is_network_fs(None)


def test_network_store_warns_once_and_can_be_silenced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = Path("/home/alice/.local/share/detslurm/detslurm.db")
    assert network_fs_of(db, MOUNTINFO) == "nfs4"
    assert network_fs_of(Path("/home/alice/local/detslurm.db"), MOUNTINFO) is None
    monkeypatch.setenv("DETSLURM_ALLOW_NETWORK_DB", "1")
    assert warn_if_network_db(db, MOUNTINFO) is None
    monkeypatch.delenv("DETSLURM_ALLOW_NETWORK_DB")
    msg = warn_if_network_db(db, MOUNTINFO)
    assert msg is not None and str(db) in msg and "(nfs4)" in msg
    assert "DETSLURM_DB_URL" in msg and "DETSLURM_DATA_DIR" in msg and "DETSLURM_ALLOW_NETWORK_DB=1" in msg
    assert warn_if_network_db(db, MOUNTINFO) is None  # once per process


def test_real_mountinfo_is_read() -> None:
    real = Path("/proc/self/mountinfo").read_text()
    assert fs_type("/", parse_mountinfo(real)) is not None
    # The real check agrees with the type mountinfo gives for the temp dir (a local disk here).
    tmp_fs = fs_type(str(Path("/tmp").resolve()), parse_mountinfo(real))
    assert network_fs_of(Path("/tmp/detslurm-test/detslurm.db")) == (tmp_fs if is_network_fs(tmp_fs) else None)


class _NoFlock:
    """A lock on a filesystem that refuses flock (NFS without lockd: ENOLCK)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def acquire(self, timeout: float | None = None) -> object:
        raise OSError(errno.ENOLCK, "No locks available", self.path)

    def release(self) -> None:
        raise AssertionError("never acquired")


def test_lock_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(LockError) as e, hold_lock(tmp_path / "daemon.lock", lock_factory=_NoFlock):
        pass
    assert isinstance(e.value, DetSlurmError)
    assert "No locks available" in str(e.value) and "DETSLURM_DATA_DIR" in str(e.value)
    (tmp_path / "file").write_text("")
    with pytest.raises(LockError, match="cannot lock"), hold_lock(tmp_path / "file" / "daemon.lock"):
        pass


def test_lock_is_exclusive(tmp_path: Path) -> None:
    path = tmp_path / "daemon.lock"
    got: list[bool] = []

    def other() -> None:
        with hold_lock(path, timeout=0) as held:
            got.append(held)

    with hold_lock(path) as held:
        assert held
        t = threading.Thread(target=other)
        t.start()
        t.join()
    other()
    assert got == [False, True]


def test_json_safe() -> None:
    value = {"loss": math.nan, "a": math.inf, "b": -math.inf, "ok": 1.5, "n": 3, "t": True, "k\x00": ["x\x00y", (1,)]}
    assert json_safe(value) == {
        "loss": "NaN",
        "a": "Infinity",
        "b": "-Infinity",
        "ok": 1.5,
        "n": 3,
        "t": True,
        "k": ["xy", [1]],
    }
    assert json_safe({1: b"\x00"}) == {"1": "b'\\x00'"}
    assert json_safe("x" * 100, max_str=20) == "xxxxxx...[truncated]"
    deep: list[object] = []
    cur = deep
    for _ in range(50):
        cur.append([])
        cur = cur[0]  # type: ignore[assignment]
    out = json_safe(deep, max_depth=3)
    assert out == [[[None]]]


def test_metric_group_and_clean_text() -> None:
    assert metric_group("valid\x00ation") == "validation"
    assert metric_group("g" * METRIC_GROUP_MAX) == "g" * METRIC_GROUP_MAX
    with pytest.raises(ValueError, match="at most 256"):
        metric_group("g" * (METRIC_GROUP_MAX + 1))
    with pytest.raises(ValueError, match="empty"):
        metric_group("\x00")
    assert clean_text("a\x00b") == "ab"
    assert len(clean_text("y" * 500, 64)) == 64 and clean_text("y" * 500, 64).endswith("[truncated]")


def test_display_url_hides_the_password() -> None:
    shown = display_url("postgresql+psycopg://alice:s3cr%40t@db.example:5432/detslurm")
    assert "s3cr" not in shown and shown == "postgresql+psycopg://alice:***@db.example:5432/detslurm"
    assert display_url("sqlite:////home/u/detslurm.db") == "sqlite:////home/u/detslurm.db"


def test_unreachable_postgres_error_hides_the_password() -> None:
    with pytest.raises(StoreError) as e:
        open_store("postgresql+psycopg://alice:hunter2secret@127.0.0.1:1/detslurm")
    assert "hunter2secret" not in str(e.value) and "alice:***@127.0.0.1:1" in str(e.value)


def _experiment(name: str) -> Experiment:
    return Experiment(
        name=name, owner="u", config={}, original_config="", context_sha256="0", exp_dir="/tmp", state="ACTIVE"
    )


def test_sqlite_reader_is_not_blocked_by_a_writer(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    with store.tx() as s:
        s.add(_experiment("committed"))
    with store.tx() as w:
        w.add(_experiment("uncommitted"))
        w.flush()  # the writer holds SQLite's write lock from here to the end of the block
        start = time.monotonic()
        with store.read() as r:
            names = r.scalars(select(Experiment.name)).all()
        assert time.monotonic() - start < 20  # BEGIN IMMEDIATE would wait 30 s and fail
        assert names == ["committed"]
    with store.read() as r:
        assert sorted(r.scalars(select(Experiment.name)).all()) == ["committed", "uncommitted"]


def test_read_transaction_refuses_writes(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    with pytest.raises(StoreError, match="read-only"), store.read() as r:
        r.add(LogEntry(trial_id=1, message="x"))
        r.flush()


def test_unreachable_postgres_in_a_transaction_is_a_store_error() -> None:
    from detslurm.store.db import Store

    store = Store("postgresql+psycopg://alice:hunter2secret@127.0.0.1:1/detslurm")
    for begin in (store.tx, store.read):
        with pytest.raises(StoreError, match=r"cannot reach the detslurm store at .*alice:\*\*\*@") as e, begin() as s:
            s.connection()
        assert "hunter2secret" not in str(e.value)


def test_mask_hides_both_forms_of_the_password() -> None:
    from detslurm.store.db import _mask

    url = "postgresql+psycopg://alice:p%40ss@db/x"
    assert _mask("dsn alice:p%40ss@db and p@ss", url) == "dsn alice:***@db and ***"


def test_numeric_settings_are_checked() -> None:
    from detslurm.errors import DetSlurmError
    from detslurm.settings import SLURM_TIMEOUT_S as T

    assert T.get({T.name: "2.5"}) == 2.5 and T.get({}) == T.get({T.name: ""}) == 30.0
    with pytest.raises(DetSlurmError, match=r"\$DETSLURM_SLURM_TIMEOUT_S must be a number, got 'ten'"):
        T.get({T.name: "ten"})
