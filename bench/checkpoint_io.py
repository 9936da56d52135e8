"""Checkpoints: save and restore throughput of the Core API (``store_path`` / ``restore_path``,
as a trial uses them: partial dir, metadata, rename, the report flushed to the events file)
against raw ``torch.save`` / ``torch.load`` of the same state into the same directory.
Interleaved repeats; medians. Goal >= 0.9x for both.

    python bench/checkpoint_io.py [--mb N] [--repeats R]     (no cluster needed)
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import median, save

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
    t: dict[str, list[float]] = {"raw_save": [], "raw_save_fsync": [], "det_save": [], "raw_load": [], "det_load": []}
    try:
        for i in range(args.repeats):
            t0 = time.perf_counter()
            torch.save(sd, work / f"raw-{i}.pt")
            t["raw_save"].append(time.perf_counter() - t0)
            # The same save made durable (what store_path does since review L8): file, then dir.
            t0 = time.perf_counter()
            torch.save(sd, work / f"rawf-{i}.pt")
            durable(work / f"rawf-{i}.pt")
            t["raw_save_fsync"].append(time.perf_counter() - t0)
            (work / f"rawf-{i}.pt").unlink()
            t0 = time.perf_counter()
            with ckpt.store_path({"steps_completed": i}) as (path, uuid):
                torch.save(sd, path / "state.pt")
            t["det_save"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            torch.load(work / f"raw-{i}.pt", map_location=args.device)
            t["raw_load"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with ckpt.restore_path(uuid) as path:
                torch.load(path / "state.pt", map_location=args.device)
            t["det_load"].append(time.perf_counter() - t0)
            (work / f"raw-{i}.pt").unlink()
            ckpt.delete(uuid)
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
            "restore_throughput_ratio": med["raw_load"] / med["det_load"],
            "goal_ratio_min": 0.9,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
