"""Checkpoints: save and restore throughput of the Core API (``store_path`` / ``restore_path``,
as a trial uses them: partial dir, metadata, rename, the report flushed to the events file)
against raw ``torch.save`` / ``torch.load`` of the same state into the same directory.
Interleaved repeats; medians. Goal >= 0.9x for both. Alongside: the same save with the early
writeback off (``_writeback``), i.e. the code before it, and a bare save made durable by hand.

    python bench/checkpoint_io.py [--mb N] [--repeats R]     (no cluster needed)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from _common import median, save

from detslurm.ckpt_settings import WRITEBACK_ENV
from detslurm.core._checkpoint import CheckpointContext
from detslurm.core._context import _durable
from detslurm.core._distributed import DummyDistributedContext
from detslurm.core._events import EventWriter


def state(mb: int, dev: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = mb * 1024 * 1024 // 4 // 8
    # On a GPU the weights live in device memory, as a trial's do: saving includes the copy out.
    return {f"layer{i}.weight": torch.randn(n, generator=g).to(dev) for i in range(8)}


def durable(path: Path) -> None:
    for target, flags in ((path, os.O_RDONLY), (path.parent, os.O_RDONLY | os.O_DIRECTORY)):
        fd = os.open(target, flags)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def no_writeback() -> Iterator[None]:
    """store_path as it was before its early writeback (detslurm/core/_writeback.py)."""
    os.environ[WRITEBACK_ENV] = "0"
    try:
        yield
    finally:
        del os.environ[WRITEBACK_ENV]


def saves(sd: dict[str, torch.Tensor], work: Path, writer: EventWriter) -> dict[str, Callable[[int], str]]:
    """The four saves of repeat ``i``, by name; each returns what it saved (a path or a uuid)."""
    ckpt = CheckpointContext(DummyDistributedContext(), work, _durable(writer), require_steps=True)
    with no_writeback():
        ckpt_nowb = CheckpointContext(DummyDistributedContext(), work, _durable(writer), require_steps=True)

    def raw(path: Path, fsync: bool) -> str:
        torch.save(sd, path)
        if fsync:  # made durable by hand, as store_path does: file, then dir
            durable(path)
        return str(path)

    def det(ctx: CheckpointContext) -> str:
        with ctx.store_path({"steps_completed": 1}) as (path, uuid):
            torch.save(sd, path / "state.pt")
        return uuid

    return {
        # New names each repeat: ext4 flushes a file rewritten over a truncated one at close.
        "raw_save": lambda i: raw(work / f"raw-{i}.pt", fsync=False),
        "raw_save_fsync": lambda i: raw(work / f"rawf-{i}.pt", fsync=True),
        "det_save": lambda i: det(ckpt),
        "det_save_no_writeback": lambda i: det(ckpt_nowb),
    }


def measure(sd: dict[str, torch.Tensor], repeats: int, device: str) -> dict[str, list[float]]:
    """Seconds per save and per load, each save first in turn, repeat after repeat."""
    work = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    writer = EventWriter(work / "events.jsonl")
    ckpt = CheckpointContext(DummyDistributedContext(), work, _durable(writer), require_steps=True)
    by_name = saves(sd, work, writer)
    t: dict[str, list[float]] = {k: [] for k in [*by_name, "raw_load", "det_load"]}
    try:
        for i in range(repeats):
            out: dict[str, str] = {}
            names = list(by_name)
            for name in names[i % len(names) :] + names[: i % len(names)]:
                os.sync()  # every save starts with no other dirty data for the disk to write
                t0 = time.perf_counter()
                out[name] = by_name[name](i)
                t[name].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            torch.load(out["raw_save"], map_location=device)
            t["raw_load"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with ckpt.restore_path(out["det_save"]) as path:
                torch.load(path / "state.pt", map_location=device)
            t["det_load"].append(time.perf_counter() - t0)
            for name in ("det_save", "det_save_no_writeback"):
                ckpt.delete(out[name])  # one base: either context deletes
            for name in ("raw_save", "raw_save_fsync"):
                os.unlink(out[name])
    finally:
        writer.close()
        shutil.rmtree(work, ignore_errors=True)
    return t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    t = measure(state(args.mb, args.device), args.repeats, args.device)
    med = {k: median(v) for k, v in t.items()}
    save(
        "checkpoint_io",
        {
            "benchmark": "checkpoint_io",
            "mb": args.mb,
            "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
            "repeats": args.repeats,
            "samples_s": t,
            "median_s": med,
            "save_throughput_ratio": med["raw_save"] / med["det_save"],
            "durable_save_ratio": med["raw_save_fsync"] / med["det_save"],
            "save_ratio_no_writeback": med["raw_save"] / med["det_save_no_writeback"],
            "restore_throughput_ratio": med["raw_load"] / med["det_load"],
            "goal_ratio_min": 0.9,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
