"""Trial logs: each run's output file, controller notes, rank filters, following."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import click

from detslurm import views
from detslurm.cli.app import App

RANK = re.compile(r"\[rank=(\d+)\]")


def lines(app: App, trial_id: int, ranks: Sequence[int] = ()) -> Iterator[str]:
    with app.store.read() as s:
        views.get_trial(s, trial_id, app.scope)
        runs = [(r.run_id, r.log_path) for r in views.runs(s, trial_id)]
        notes = [(n.time, n.level, n.message) for n in views.notes(s, trial_id)]
    for run_id, path in runs:
        if not ranks:
            yield f"=== trial {trial_id} run {run_id} ({path})"
        p = Path(path)
        if p.exists():
            for line in p.read_text(errors="replace").splitlines():
                if ranks:
                    m = RANK.search(line)
                    if not m or int(m.group(1)) not in ranks:
                        continue
                yield line
    if not ranks:
        for t, level, msg in notes:
            yield f"[{t:%Y-%m-%dT%H:%M:%SZ}] detslurm || {level}: {msg}"


class Follower:
    """Prints new output of a trial's runs as they grow (used by -f)."""

    def __init__(self, app: App, trial_id: int, ranks: Sequence[int] = ()) -> None:
        self.app = app
        self.trial_id = trial_id
        self.ranks = list(ranks)
        self.offsets: dict[str, int] = {}

    def pump(self) -> None:
        with self.app.store.read() as s:
            paths = [r.log_path for r in views.runs(s, self.trial_id)]
        for path in paths:
            p = Path(path)
            if not p.exists():
                continue
            with open(p, "rb") as f:
                f.seek(self.offsets.get(path, 0))
                data = f.read()
            end = data.rfind(b"\n")
            if end < 0:
                continue
            self.offsets[path] = self.offsets.get(path, 0) + end + 1
            for line in data[: end + 1].decode(errors="replace").splitlines():
                if self.ranks:
                    m = RANK.search(line)
                    if not m or int(m.group(1)) not in self.ranks:
                        continue
                click.echo(line)


def select_lines(all_lines: list[str], head: int | None, tail: int | None) -> list[str]:
    if head is not None:
        return all_lines[:head]
    if tail is not None:
        return all_lines[-tail:] if tail else []
    return all_lines
