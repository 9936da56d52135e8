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

import math
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

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


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> bytes:
    crc = crc32c(data)
    return struct.pack("<I", (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


def _varint(n: int) -> bytes:
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
    # 0x09: field 1, wire type 1 (64-bit); 0x10: field 2, varint; 0x15 below: field 2, 32-bit.
    out = b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step)
    if version:
        return out + _field(3, _FILE_VERSION)
    values = b"".join(
        _field(1, _field(1, tag.encode()) + b"\x15" + struct.pack("<f", value))
        for tag, value in (scalars or {}).items()
    )
    return out + _field(5, values)


def record(data: bytes) -> bytes:
    """``data`` framed as one TFRecord."""
    length = struct.pack("<Q", len(data))
    return length + _masked(length) + data + _masked(data)


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
    return {
        tag_for(group, str(k)): float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def event_file(directory: Path) -> Path:
    """This writer's event file in ``directory``. One fixed name per trial, appended to by every
    later ingest (a daemon restart included): no directory listing per report, and one reader
    for TensorBoard instead of one per daemon start."""
    return directory / f"{PREFIX}0000000000{SUFFIX}"


def append(directory: Path, group: str, step: int, wall_time: float, metrics: Mapping[str, Any]) -> int:
    """Append one report's scalars to ``directory``'s event file; how many were written."""
    scalars = scalars_of(group, metrics)
    if not scalars:
        return 0
    data = record(event(wall_time, step, scalars))
    path = event_file(directory)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
    try:
        fd = os.open(path, flags, 0o600)
    except FileNotFoundError:
        # The first report of the trial: its dir is made here (private, as the experiment dir).
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, flags, 0o600)
    try:
        if os.fstat(fd).st_size == 0:
            # A new file starts with the version record TensorBoard expects first.
            data = record(event(wall_time, 0, version=True)) + data
        # One write() of whole records, in append mode: a reader never sees half a record
        # followed by another writer's bytes.
        os.write(fd, data)
    finally:
        os.close(fd)
    return len(scalars)
