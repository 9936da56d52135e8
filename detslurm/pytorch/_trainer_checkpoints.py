"""The Trainer's checkpoints: saved at a batch, and loaded to resume there (or to warm start).

The files and their contents are in ``_state.py``; here is when the Trainer writes them, what it
records of where training is, and how a resumed run takes up that position.
"""

from __future__ import annotations

import json
import logging
import pickle
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from detslurm.pytorch._state import (
    LOAD_DATA_FILE,
    STATE_FILE,
    TRAINER_STATE_FILE,
    TRIAL_STATE_FILE,
    load_data,
    load_trial_state,
    set_rng_state,
    trial_state_dict,
)
from detslurm.pytorch._trainer_state import _TrainerState

log = logging.getLogger("detslurm.pytorch")


class _Checkpoints(_TrainerState):
    def _trial_id(self) -> Optional[int]:
        info = self.core.info if self.core is not None else None
        return info.trial.trial_id if info is not None else None

    def _checkpoint(self) -> None:
        if self._last_ckpt_at == self.batches_trained or self.core is None:
            return
        self._last_ckpt_at = self.batches_trained
        uuid = ""
        # State is the same on every rank after the step (DDP), so the chief's copy is the
        # checkpoint; as in Determined, only the chief's callbacks see it saved and written, and
        # every rank's hear of its upload.
        if self.context.is_chief():
            state = trial_state_dict(self.context, self.callbacks)
            state["epoch_rng_state"] = self._epoch_rng  # for plain torch loaders (see _trainer.py)
            for cb in self.callbacks.values():
                cb.on_checkpoint_save_start(state)
            with self.core.checkpoint.store_path(self._checkpoint_metadata()) as (path, uuid):
                torch.save(state, path / STATE_FILE)
                self._write_trial_files(path)
        dist = self.context.distributed
        self._checkpoint_done(dist.broadcast(uuid) if dist.size > 1 else uuid)

    def _checkpoint_metadata(self) -> dict[str, Any]:
        return {
            "determined_version": "detslurm",
            "steps_completed": self.batches_trained,
            "framework": f"torch-{torch.__version__}",
            "format": "pickle",
        }

    def _write_trial_files(self, path: Path) -> None:
        """Where training is, how to load the trial again and its code (the chief's part)."""
        # Determined's fields only: its Trainer rebuilds its state from exactly these (any other
        # key fails there), so a user can resume our checkpoints under Determined. Off-cluster
        # the trial id is 0, as Determined's: any other id means another trial (a warm start).
        trial_state = {
            "trial_id": self._trial_id() or 0,
            "last_ckpt": self.batches_trained,
            "step_id": 0,
            "last_val": max(self._last_val_at, 0),
            "batches_trained": self.batches_trained,
            "epochs_trained": self.batches_trained // self._bpe,
        }
        with open(path / TRIAL_STATE_FILE, "wb") as f:
            pickle.dump(trial_state, f)
        # What only this Trainer keeps: the best searcher metric so far (checkpoint_policy="best").
        (path / TRAINER_STATE_FILE).write_text(json.dumps({"best": self._best}))
        (path / LOAD_DATA_FILE).write_text(json.dumps(load_data(self.trial, self.context)))
        if self._on_cluster():
            self._save_code(path / "code")
        for cb in self.callbacks.values():
            # Both with the directory being written, the deprecated hook first (Determined's order).
            cb.on_checkpoint_end(str(path))
            cb.on_checkpoint_write_end(str(path))

    def _checkpoint_done(self, uuid: str) -> None:
        for cb in self.callbacks.values():
            cb.on_checkpoint_upload_end(uuid)

    @staticmethod
    def _save_code(dest: Path) -> None:
        """The trial's code travels with its weights (det.import_from_path loads it later).
        Only on a trial, where the working dir is the extracted context snapshot (<= 95 MiB)."""
        src = Path.cwd()
        shutil.copytree(
            src,
            dest,
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".git", "checkpoints"),
            dirs_exist_ok=True,
            symlinks=True,
        )

    def _load(self, storage_id: str) -> None:
        assert self.core is not None
        with self.core.checkpoint.restore_path(storage_id) as path:
            state = torch.load(path / STATE_FILE, map_location=self.context.device, weights_only=False)
            trial_state = self._read_trial_state(path)
        for cb in self.callbacks.values():
            cb.on_checkpoint_load_start(state)
        load_trial_state(self.context, state)
        self._resume_at(storage_id, state, trial_state)

    def _warm_start(self, trial_state: dict[str, Any]) -> bool:
        """Whether the checkpoint is another trial's (its weights only are taken)."""
        saved_trial = trial_state.get("trial_id")
        return saved_trial is not None and self._trial_id() is not None and saved_trial != self._trial_id()

    def _resume_position(self, storage_id: str) -> int:
        """The batch a run resuming the checkpoint ``storage_id`` starts at."""
        assert self.core is not None
        with self.core.checkpoint.restore_path(storage_id) as path:
            trial_state = self._read_trial_state(path)
        return 0 if self._warm_start(trial_state) else int(trial_state["batches_trained"])

    @staticmethod
    def _read_trial_state(path: Path) -> dict[str, Any]:
        """Where training is in the checkpoint at ``path``: Determined's fields and ours."""
        with open(path / TRIAL_STATE_FILE, "rb") as f:
            trial_state: dict[str, Any] = pickle.load(f)
        if (path / TRAINER_STATE_FILE).is_file():
            trial_state.update(json.loads((path / TRAINER_STATE_FILE).read_text()))
        return trial_state

    def _resume_at(self, storage_id: str, state: dict[str, Any], trial_state: dict[str, Any]) -> None:
        """Callbacks, RNG and where training is, from a loaded checkpoint."""
        for k, sd in state.get("callbacks", {}).items():
            if k in self.callbacks:
                self.callbacks[k].load_state_dict(sd)
        if self._warm_start(trial_state):
            # A warm start (Continue Trial, source_trial_id): keep the weights, count from zero.
            saved_trial = trial_state.get("trial_id")
            log.info("warm start from checkpoint %s of trial %s: training starts at batch 0", storage_id, saved_trial)
            return
        rng = state.get("rng_state")
        if isinstance(rng, dict) and "cpu_rng_state" in rng:
            set_rng_state(rng)
        self._epoch_rng = state.get("epoch_rng_state")
        self.batches_trained = int(trial_state["batches_trained"])
        self.epoch_idx = int(trial_state.get("epoch_idx", self.batches_trained // self._bpe))
        self._best = trial_state.get("best")
        self._last_ckpt_at = self.batches_trained
        log.info("resumed from checkpoint %s at batch %d", storage_id, self.batches_trained)
