"""Checkpoints on a shared filesystem, written atomically (contract 5).

A checkpoint is written into ``<base>/.<uuid>.partial`` and renamed to ``<base>/<uuid>`` only
when complete, after ``metadata.json``; a crash mid-write leaves the previous checkpoint as the
latest usable one. Sharded checkpoints: every rank writes into the same partial directory.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import shutil
import uuid as uuidlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from detslurm.core._distributed import DistributedContext
from detslurm.errors import CheckpointNotFound
from detslurm.protocol.events import CheckpointDeleted, CheckpointSaved, Event


class DownloadMode(enum.Enum):
    LocalWorkersShareDownload = "LOCAL_WORKERS_SHARE_DOWNLOAD"
    NoSharedDownload = "NO_SHARED_DOWNLOAD"


def list_resources(root: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for d in dirnames:
            out[(d if rel == "." else f"{rel}/{d}") + "/"] = 0
        for f in filenames:
            p = os.path.join(dirpath, f)
            out[f if rel == "." else f"{rel}/{f}"] = os.path.getsize(p)
    return out


def merge_metadata(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge per-rank metadata; equal leaves are fine, conflicting leaves are an error."""

    def merge(a: Any, b: Any, path: str) -> Any:
        if isinstance(a, dict) and isinstance(b, dict):
            out = dict(a)
            for k, v in b.items():
                out[k] = merge(out[k], v, f"{path}.{k}") if k in out else v
            return out
        if a != b:
            raise RuntimeError(f"refusing to upload with metadata conflicts at {path or '.'}: {a!r} != {b!r}")
        return a

    merged: dict[str, Any] = {}
    for p in parts:
        merged = merge(merged, p or {}, "")
    return merged


class CheckpointContext:
    def __init__(
        self, dist: DistributedContext, base: Path, report: Callable[[Event], None], require_steps: bool
    ) -> None:
        self._dist = dist
        self.base = Path(base)
        self._report = report
        self._require_steps = require_steps

    # -- writing ---------------------------------------------------------------------------
    def _check_metadata(self, metadata: dict[str, Any] | None) -> dict[str, Any]:
        md = dict(metadata or {})
        if self._require_steps and "steps_completed" not in md:
            raise ValueError("checkpoint metadata must include 'steps_completed' when running as a trial")
        return md

    def _finish(self, partial: Path, storage_id: str, md: dict[str, Any]) -> None:
        (partial / "metadata.json").write_text(json.dumps(md, sort_keys=True, indent=2))
        resources = list_resources(partial)
        final = self.base / storage_id
        os.replace(partial, final)
        self._report(
            CheckpointSaved(
                uuid=storage_id,
                metadata=md,
                resources=resources,
                steps_completed=int(md.get("steps_completed", 0)),
                size=sum(resources.values()),
                storage_path=str(final),
            )
        )

    @contextlib.contextmanager
    def store_path(self, metadata: dict[str, Any] | None = None, *, shard: bool = False) -> Iterator[tuple[Path, str]]:
        if not shard and self._dist.rank != 0:
            raise RuntimeError("cannot call CheckpointContext.store_path(shard=False) from non-chief worker")
        md = self._check_metadata(metadata) if (self._dist.rank == 0 or shard) else {}
        storage_id = str(uuidlib.uuid4()) if self._dist.rank == 0 else ""
        if shard:
            storage_id = self._dist.broadcast(storage_id)
        partial = self.base / f".{storage_id}.partial"
        if self._dist.rank == 0:
            partial.mkdir(parents=True, exist_ok=False)
        if shard:
            self._dist.allgather(None)  # the directory exists before any rank writes
        try:
            yield partial, storage_id
        except BaseException:
            # A failed write (a full filesystem, a crash in user code) leaves no half checkpoint
            # behind to fill the disk: the latest complete one stays the one we resume from.
            if self._dist.rank == 0:
                shutil.rmtree(partial, ignore_errors=True)
            raise
        if shard:
            parts = self._dist.allgather(md)
            if self._dist.rank == 0:
                self._finish(partial, storage_id, merge_metadata(parts))
            self._dist.allgather(None)  # nobody returns before the rename
        else:
            self._finish(partial, storage_id, md)

    def upload(
        self,
        ckpt_dir: os.PathLike[str] | str | None,
        metadata: dict[str, Any] | None = None,
        *,
        shard: bool = False,
        selector: Callable[[str], bool] | None = None,
    ) -> str:
        if not shard and self._dist.rank != 0:
            raise RuntimeError("cannot call .upload(shard=False) from non-chief worker")
        if shard and not any(self._dist.allgather(ckpt_dir is not None)):
            raise RuntimeError("upload(shard=True) needs a ckpt_dir on at least one rank")
        with self.store_path(metadata, shard=shard) as (path, storage_id):
            if ckpt_dir is not None:
                src = Path(ckpt_dir)
                for rel in list_resources(src):
                    if rel.endswith("/") or rel == "metadata.json" or (selector and not selector(rel)):
                        continue
                    (path / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src / rel, path / rel)
        return storage_id

    # -- reading ---------------------------------------------------------------------------
    def _path(self, storage_id: str) -> Path:
        if "/" in storage_id or storage_id.startswith("."):
            raise ValueError(f"invalid checkpoint id {storage_id!r}")
        p = self.base / storage_id
        if not p.is_dir():
            raise CheckpointNotFound(storage_id, str(self.base))
        return p

    @contextlib.contextmanager
    def restore_path(
        self,
        storage_id: str,
        download_mode: DownloadMode = DownloadMode.LocalWorkersShareDownload,
        *,
        selector: Callable[[str], bool] | None = None,
    ) -> Iterator[Path]:
        # Shared filesystem: every rank reads the checkpoint where it lies.
        yield self._path(storage_id)

    def download(
        self,
        storage_id: str,
        ckpt_dir: os.PathLike[str] | str,
        download_mode: DownloadMode = DownloadMode.LocalWorkersShareDownload,
        *,
        selector: Callable[[str], bool] | None = None,
    ) -> None:
        src = self._path(storage_id)
        dst = Path(ckpt_dir)
        dst.mkdir(parents=True, exist_ok=True)
        for rel in list_resources(src):
            if rel.endswith("/") or (selector and not selector(rel)):
                continue
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / rel, dst / rel)

    def get_metadata(self, storage_id: str) -> dict[str, Any]:
        md: dict[str, Any] = json.loads((self._path(storage_id) / "metadata.json").read_text())
        return md

    def delete(self, storage_id: str) -> None:
        shutil.rmtree(self._path(storage_id))
        self._report(CheckpointDeleted(uuid=storage_id))
