"""TensorBoard event files, written without TensorBoard or protobuf installed.

The login side (the controller, at ingest) writes every trial's reported metrics here, so the
in-job side stays light: no TensorFlow/TensorBoard import in the trial, no extra files for the
job to write, and the same files whether a trial used the Core API, the Trainer or a legacy
harness. The format is small and stable: a TFRecord file (length, masked CRC-32C of the length,
the record, masked CRC-32C of the record) of ``Event`` protobufs, each a wall time, a step and a
``Summary`` of (tag, simple_value) pairs. The tests read the files back with TensorBoard's own
event reader.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import stat
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import google_crc32c

# The file name TensorBoard looks for ("events.out.tfevents." prefix); the suffix names the writer.
PREFIX = "events.out.tfevents."
SUFFIX = ".detslurm-metrics"
_FILE_VERSION = b"brain.Event:2"


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            # 0x82F63B78: the reversed Castagnoli polynomial, which TFRecord uses (not zlib's CRC-32).
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


# CRC-32C four bytes at a time: ingest frames one record per metric report, and the byte loop
# was a third of the daemon's ingest time. Two 64k-entry tables, built on first use
# (~60 ms): _TABLE16 advances the CRC over one 16-bit word, _TABLE16X over a word followed by
# 16 zero bits, so a 32-bit step is the XOR of its low half through one and its high half
# through the other (the CRC is linear).
_TABLE16: list[int] = []
_TABLE16X: list[int] = []


def _build_tables16() -> None:
    for w in range(1 << 16):
        first = _TABLE[w & 0xFF]
        _TABLE16.append(_TABLE[(first ^ (w >> 8)) & 0xFF] ^ (first >> 8))
    _TABLE16X.extend(_TABLE16[v & 0xFFFF] ^ (v >> 16) for v in _TABLE16)


def crc32c_tables(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data`` in Python: where google-crc32c has no C code (no wheel
    for the platform, ppc64le among them, and no C library to build against), its own Python
    fallback takes 10 us a record, three times this."""
    if not _TABLE16X:
        _build_tables16()
    low, high = _TABLE16X, _TABLE16
    crc = 0xFFFFFFFF
    whole = len(data) & ~3
    # Little-endian 32-bit words: byte i is the lowest, as the byte-wise loop consumes it.
    for w in struct.unpack(f"<{whole >> 2}I", data[:whole]):
        crc ^= w
        crc = low[crc & 0xFFFF] ^ high[crc >> 16]
    for b in data[whole:]:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


# google-crc32c without a wheel for the platform falls back to its own, slower, Python code.
_C_CRC = google_crc32c.implementation == "c"


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as TFRecord framing uses it (not zlib's CRC-32): google-crc32c's C
    code where it has it (0.2 us a record), else :func:`crc32c_tables`."""
    if _C_CRC:
        return google_crc32c.value(data)  # type: ignore[no-any-return]
    return crc32c_tables(data)


def _masked(data: bytes) -> bytes:
    crc = crc32c(data)
    return struct.pack("<I", (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


_PACK_DOUBLE = struct.Struct("<d").pack
_PACK_LENGTH = struct.Struct("<Q").pack
_PACK_FLOAT = struct.Struct("<f").pack
_SMALL = [bytes((i,)) for i in range(0x80)]  # the one-byte varints


def _varint(n: int) -> bytes:
    if 0 <= n < 0x80:
        return _SMALL[n]
    n &= (1 << 64) - 1  # negative int64 values are sent as their two's complement
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    # Wire type 2: length-delimited (strings and embedded messages).
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event(wall_time: float, step: int, scalars: Mapping[str, float] | None = None, version: bool = False) -> bytes:
    """One serialized ``Event``: wall_time (1, double), step (2, int64), file_version (3) or a
    summary (5) of values, each with tag (1) and simple_value (2, float)."""
    if version:
        return _event_head(wall_time, step) + _field(3, _FILE_VERSION)
    return _event(wall_time, step, [_value_head(tag) + _PACK_FLOAT(value) for tag, value in (scalars or {}).items()])


def _event_head(wall_time: float, step: int) -> bytes:
    # 0x09: field 1, wire type 1 (64-bit); 0x10: field 2, varint; 0x15 (values): field 2, 32-bit.
    return b"\x09" + _PACK_DOUBLE(wall_time) + b"\x10" + _varint(step)


def _event(wall_time: float, step: int, values: list[bytes]) -> bytes:
    summary = b"".join(values)
    # 0x2a: field 5 (the summary), length-delimited.
    return _event_head(wall_time, step) + b"\x2a" + _varint(len(summary)) + summary


# The masked CRC of a record's 8-byte length field, by length: reports of one trial have a few
# lengths, so the CRC is computed once per length instead of once per record.
_LENGTH_CRC: dict[int, bytes] = {}


# The bytes of a summary value before its float, by tag: the Value message (tag (1), then
# simple_value's key 0x15) framed as field 1 of the Summary; built once per tag, not per report.
_VALUE_HEAD: dict[str, bytes] = {}


def _value_head(tag: str) -> bytes:
    head = _VALUE_HEAD.get(tag)
    if head is None:
        name = _field(1, tag.encode())
        # The Value message is name + 0x15 + 4 bytes of float: its length is known before the float.
        head = _varint(1 << 3 | 2) + _varint(len(name) + 5) + name + b"\x15"
        if len(_VALUE_HEAD) < 4096:  # bounded: tags come from trials
            _VALUE_HEAD[tag] = head
    return head


def record(data: bytes) -> bytes:
    """``data`` framed as one TFRecord."""
    length = _PACK_LENGTH(len(data))
    head = _LENGTH_CRC.get(len(data))
    if head is None:
        head = _masked(length)
        if len(_LENGTH_CRC) < 4096:  # bounded: a trial decides the lengths
            _LENGTH_CRC[len(data)] = head
    return length + head + data + _masked(data)


def tag_for(group: str, name: str) -> str:
    """TensorBoard tag of a reported metric, named as Determined's metric writers name them:
    training metrics as they are, validation metrics with a ``val_`` prefix, others by group."""
    if group == "training":
        return name
    if group == "validation":
        return name if name.startswith("val") else f"val_{name}"
    return f"{group}/{name}"


def scalars_of(group: str, metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numeric, finite values of a report (booleans, strings and lists are not scalars)."""
    out = {}
    for k, v in metrics.items():
        value = _scalar(v)
        if value is not None:
            out[tag_for(group, str(k))] = value
    return out


def _scalar(v: Any) -> float | None:
    """``v`` as a TensorBoard value (a float32), or None when it is none: not a number, not
    finite, or an int beyond any float (JSON allows it; float() would raise)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    if isinstance(v, int) and not -_F64_MAX <= v <= _F64_MAX:
        return None
    value = float(v)
    if not math.isfinite(value):
        return None
    # Beyond float32's range struct refuses to pack it: shown as the infinity it would be in float32.
    return value if -_F32_MAX <= value <= _F32_MAX else math.copysign(math.inf, value)


_F64_MAX = 1.7976931348623157e308
_F32_MAX = 3.4028234663852886e38


def event_file(directory: Path) -> Path:
    """This writer's event file in ``directory``. One fixed name per trial, appended to by every
    later ingest (a daemon restart included): no directory listing per report, and one reader
    for TensorBoard instead of one per daemon start."""
    return directory / f"{PREFIX}0000000000{SUFFIX}"


def report_record(group: str, step: int, wall_time: float, metrics: Mapping[str, Any]) -> bytes:
    """One report's scalars (:func:`scalars_of`) as a framed record; empty when it has none."""
    values: dict[str, bytes] = {}
    for k, v in metrics.items():
        # A float within float32's range is the common case; everything else is sorted out by _scalar.
        value = v if type(v) is float and -_F32_MAX <= v <= _F32_MAX else _scalar(v)
        if value is not None:
            tag = tag_for(group, str(k))
            # By tag, as scalars_of: two names with one tag ("loss" and "val_loss" in validation) give one value.
            values[tag] = _value_head(tag) + _PACK_FLOAT(value)
    return record(_event(wall_time, step, list(values.values()))) if values else b""


def append(directory: Path, group: str, step: int, wall_time: float, metrics: Mapping[str, Any]) -> int:
    """Append one report's scalars to ``directory``'s event file; how many were written."""
    data = report_record(group, step, wall_time, metrics)
    if data:
        append_records(directory, data, wall_time)
    return len(scalars_of(group, metrics)) if data else 0


def append_records(directory: Path, data: bytes, wall_time: float) -> None:
    """Append framed records (:func:`report_record`, concatenated) to ``directory``'s event
    file in one write; ``wall_time`` dates the version record a new file starts with."""
    fd = _open_event_file(directory)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(event_file(directory)))
        size = st.st_size
        if size == 0:
            # A new file starts with the version record TensorBoard expects first.
            data = record(event(wall_time, 0, version=True)) + data
        _write_whole(fd, data, size)
    finally:
        os.close(fd)


# The trial's own run could put a symlink or a FIFO where the daemon appends (the trial's
# tensorboard dir, or the file in it): neither is followed, and a FIFO fails (ENXIO) instead
# of blocking the daemon's open.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_FILE_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def _open_event_file(directory: Path) -> int:
    try:
        dir_fd = os.open(directory, _DIR_FLAGS)
    except FileNotFoundError:
        # The first report of the trial: its dir is made here (private, as the experiment dir).
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        dir_fd = os.open(directory, _DIR_FLAGS)
    try:
        return os.open(event_file(directory).name, _FILE_FLAGS, 0o600, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def _write_whole(fd: int, data: bytes, size: int) -> None:
    """Write ``data`` at the end of ``fd`` (``size`` bytes long before): whole, or not at all.
    A record cut short (a full disk, a quota) would make every later record unreadable, so on
    an error the file goes back to ``size`` bytes and the error is raised."""
    # One write() of whole records, in append mode: a reader never sees half a record followed
    # by another writer's bytes. A short count (the disk filling up) is followed by another.
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except OSError:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, size)
        raise
