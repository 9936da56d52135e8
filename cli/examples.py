"""One example per command, shown at the end of its ``--help``.

Kept in one table (not in each command's docstring) so a test can check that every command
has one, and so the examples read as a set: the same ids and files throughout.
"""

from __future__ import annotations

import click

# Keyed by the command's path under `det`, with each command's own name (aliases share it).
# A new command needs a line here: tests/unit/cli/test_verbs.py fails for any command without one.
EXAMPLES: dict[str, str] = {
    "experiment": "det e create const.yaml . && det e list",
    "experiment label": "det e label add 7 baseline",
    "experiment set": "det e set priority 7 60",
    "trial": "det t logs 12 -f",
    "checkpoint": "det c list 7",
    "daemon": "det daemon status",
    "job": "det job list",
    "resource-pool": "det rp list",
    "dashboard": "det dashboard --port 8080  (then open the printed URL)",
    "tensorboard": "det tensorboard start 7",
    "tensorboard start": "det tensorboard start --trial 12 --port 6006",
    "site": "det site doctor",
    "config": "det config --json",
    "site doctor": "det site doctor -p gpu --json",
    "site init": "det site init --print",
    "site postgres-rls": "det site postgres-rls --dry-run alice bob",
    "experiment activate": "det e activate 7",
    "experiment drive-detached": "det e drive-detached 7 --ready-fd 3  (what det e activate --detach starts)",
    "experiment archive": "det e archive 7",
    "experiment cancel": "det e cancel 7",
    "experiment config": "det e config 7 > config.yaml",
    "experiment continue": "det e continue 7 --config searcher.max_length.batches=2000",
    "experiment create": "det e create const.yaml .  (or --local, --dry-run, --config resources.slots_per_trial=2)",
    "experiment delete": "det e delete 7 --yes",
    "experiment describe": "det e describe 7 --json",
    "experiment download": "det e download 7 --top-n 3 -o best/",
    "experiment fork": "det e fork 7 --config hyperparameters.lr=0.01",
    "experiment kill": "det e kill 7",
    "experiment label add": "det e label add 7 baseline",
    "experiment label remove": "det e label remove 7 baseline",
    "experiment list": "det e list --all --state COMPLETED --label baseline --csv",
    "experiment list-checkpoints": "det e lc 7 --best 3",
    "experiment list-trials": "det e lt 7",
    "experiment logs": "det e logs 7 -f --level WARNING",
    "experiment pause": "det e pause 7",
    "experiment set description": 'det e set description 7 "lr sweep, second try"',
    "experiment set max-slots": "det e set max-slots 7 4",
    "experiment set name": "det e set name 7 mnist-lr-sweep",
    "experiment set priority": "det e set priority 7 60",
    "experiment set weight": "det e set weight 7 2",
    "experiment unarchive": "det e unarchive 7",
    "experiment wait": "det e wait 7 && echo done",
    "trial describe": "det t describe 12 --metrics",
    "trial download": "det t download 12 --best -o model/",
    "trial kill": "det t kill 12",
    "trial logs": "det t logs 12 --rank-id 0 --level ERROR --since 2026-11-23T12:00:00Z",
    "checkpoint delete": "det c delete 3f2a...,9b1c... --yes",
    "checkpoint describe": "det c describe 3f2a...",
    "checkpoint download": "det c download 3f2a... -o ckpt/",
    "checkpoint locate-for-download": "det c locate-for-download 3f2a...  (what a remote download asks)",
    "checkpoint list": "det c list 7 --json",
    "checkpoint rm": "det c rm 3f2a... --glob 'optimizer*' --yes",
    "daemon logs": "det daemon logs",
    "daemon start": "det daemon start",
    "daemon status": "det daemon status",
    "daemon stop": "det daemon stop",
    "job list": "det job list -p gpu",
    "job update": "det job update 1234_5 --priority 60",
    "job update-batch": "det job update-batch 1234.priority=60 1235.resource-pool=gpu",
    "resource-pool list": "det rp list",
}


def add_examples(cmd: click.Command, path: str) -> None:
    """Put each command's example under its --help (``\\b`` keeps click from rewrapping it)."""
    if isinstance(cmd, click.Group):
        for name, sub in cmd.commands.items():
            if sub.name == name:  # an alias is the same object: visited under its own name
                add_examples(sub, f"{path} {name}")
    example = EXAMPLES.get(path)
    # A command that wrote its own epilog keeps it; the test of this table finds any without one.
    if example is not None and not cmd.epilog:
        cmd.epilog = f"\b\nExample:\n  {example}"
