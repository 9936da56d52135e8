"""Where an experiment's files live on the shared filesystem."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ExpLayout:
    root: Path

    @property
    def context(self) -> Path:
        return self.root / "context.tar.gz"

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def best_validation(self) -> Path:
        return self.root / "best_validation.json"

    def trial_dir(self, trial_id: int) -> Path:
        return self.root / "trials" / str(trial_id)

    def run_dir(self, trial_id: int, run_id: int) -> Path:
        return self.trial_dir(trial_id) / "runs" / str(run_id)

    def ops_file(self, trial_id: int) -> Path:
        return self.trial_dir(trial_id) / "searcher_ops.json"


def control_file(run_dir: Path) -> Path:
    return run_dir / "control.json"


def exit_file(run_dir: Path) -> Path:
    return run_dir / "exit.json"


def log_file(run_dir: Path) -> Path:
    return run_dir / "output.log"
