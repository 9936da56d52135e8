"""``python -m detslurm.launch.autohorovod [HVD_OVERRIDES... --] (--trial T | SCRIPT...)``

Determined's launcher for legacy trials (seeds 000/001: "automatically detects distributed
training, based on slot size and number of machines, and launches with Horovod for distributed
training"; ``dlprof --mode=simple python3 -m determined.launch.autohorovod --trial ...``):

- one node with one slot: the script runs directly (under ``wrap_rank 0``, so its log lines carry
  ``[rank=0]`` like every other launcher's);
- several slots: ``detslurm.launch.horovod`` with the same arguments;
- several slots for a ``--trial`` with no overrides where Horovod is not installed: the
  torch_distributed launcher instead. The legacy harness trains with torch DDP under either (the
  Trainer's one data-parallel path), so only the launching differs; a notice says so.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence

from detslurm.launch import wrap_rank
from detslurm.launch._common import LaunchError, fail, help_requested, nodes_from_env, parse_args, run
from detslurm.launch._horovod_args import parse_overrides


def run_one_slot(script: Sequence[str], python: str = sys.executable) -> int:
    """The script alone, as rank 0, with signals forwarded; its exit code."""
    return run(wrap_rank.command("0", script, python), os.environ)


def _is_trial(script: Sequence[str]) -> bool:
    """Whether ``parse_args`` turned ``--trial`` into the legacy harness command."""
    return list(script[1:3]) == ["-m", "detslurm.exec.harness"]


def main(argv: Sequence[str]) -> int:
    if help_requested(argv, __doc__):
        return 0
    try:
        overrides, script = parse_args(argv)
        parse_overrides(overrides)  # a bad override fails here, even where one slot ignores them
        nodes = nodes_from_env(os.environ)
    except LaunchError as e:
        return fail(str(e))
    # One slot needs no launcher at all, as in Determined; Horovod need not even be installed.
    if nodes.nnodes == 1 and nodes.slots <= 1:
        return run_one_slot(script)
    if importlib.util.find_spec("horovod") is None:
        # Only a --trial may fall back: its harness trains with torch DDP under either launcher,
        # while a user script or Horovod overrides need Horovod itself.
        if overrides or not _is_trial(script):
            return fail("autohorovod: this trial has several slots and Horovod is not installed")
        print(
            "detslurm launcher: Horovod is not installed; launching the legacy trial with torch_distributed",
            file=sys.stderr,
            flush=True,
        )
        from detslurm.launch import torch_distributed

        return torch_distributed.main(argv)
    # Imported only here: the one-slot path must not need Horovod's launcher module.
    from detslurm.launch import horovod

    return horovod.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
