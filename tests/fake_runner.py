"""The base of the unit tests' stand-ins for Slurm's commands: a ``SlurmClient`` runner that
records every command line and answers from ``answer`` (one place for the runner's signature,
which each fake used to spell out again)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Optional

from detslurm.slurm.client import Result


class FakeRunner:
    """Subclasses answer each call in ``answer``; ``calls`` holds every argv asked, in order."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(
        self,
        argv: Sequence[str],
        *,
        input: Optional[str] = None,
        timeout: float,
        env: Optional[Mapping[str, str]] = None,
    ) -> Result:
        self.calls.append(list(argv))
        return self.answer(list(argv), input)

    def answer(self, argv: list[str], input: Optional[str]) -> Result:
        """What Slurm would print and exit with for ``argv``."""
        raise NotImplementedError

    def asked(self, command: str) -> int:
        """How many calls began with ``command`` (e.g. "squeue", "scontrol update")."""
        words = command.split()
        return sum(1 for c in self.calls if c[: len(words)] == words)
