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

from detslurm.core._checkpoint import WRITEBACK_ENV, CheckpointContext
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    sd = state(args.mb, args.device)
    writer = EventWriter(work / "events.jsonl")
    ckpt = CheckpointContext(DummyDistributedContext(), work, _durable(writer), require_steps=True)
    with no_writeback():
        ckpt_nowb = CheckpointContext(DummyDistributedContext(), work, _durable(writer), require_steps=True)

    def durable_save(path: Path) -> None:
        """The save made durable by hand (what store_path does since review L8): file, then dir."""
        torch.save(sd, path)
        durable(path)

    def det_save(ctx: CheckpointContext) -> str:
        with ctx.store_path({"steps_completed": 1}) as (path, uuid):
            torch.save(sd, path / "state.pt")
        return uuid

    saves: dict[str, Callable[[], object]] = {
        # New names each repeat: ext4 flushes a file rewritten over a truncated one at close.
        "raw_save": lambda: torch.save(sd, work / f"raw-{i}.pt"),
        "raw_save_fsync": lambda: durable_save(work / f"rawf-{i}.pt"),
        "det_save": lambda: det_save(ckpt),
        "det_save_no_writeback": lambda: det_save(ckpt_nowb),
    }
    t: dict[str, list[float]] = {k: [] for k in [*saves, "raw_load", "det_load"]}
    try:
        for i in range(args.repeats):
            uuids: dict[str, object] = {}
            names = list(saves)
            for name in names[i % len(names) :] + names[: i % len(names)]:  # each goes first in turn
                os.sync()  # every save starts with no other dirty data for the disk to write
                t0 = time.perf_counter()
                uuids[name] = saves[name]()
                t[name].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            torch.load(work / f"raw-{i}.pt", map_location=args.device)
            t["raw_load"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with ckpt.restore_path(str(uuids["det_save"])) as path:
                torch.load(path / "state.pt", map_location=args.device)
            t["det_load"].append(time.perf_counter() - t0)
            for name in ("det_save", "det_save_no_writeback"):
                ckpt.delete(str(uuids[name]))  # one base: either context deletes
            for raw in (f"raw-{i}.pt", f"rawf-{i}.pt"):
                (work / raw).unlink()
    finally:
        writer.close()
        shutil.rmtree(work, ignore_errors=True)
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
