"""The doctor's verdicts: one typed line per thing checked, and their JSON form (a stable schema
scripts may rely on: ``schema`` is bumped on any incompatible change)."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

# Version of the --json document; fields are only ever added within one version.
SCHEMA = 1


class Status(enum.Enum):
    OK = "ok"
    WARNING = "warning"
    PROBLEM = "problem"

    def __str__(self) -> str:
        return self.value


# Severity order for `worst`: enum values are strings, and "warning" > "problem" alphabetically.
_RANK = {Status.OK: 0, Status.WARNING: 1, Status.PROBLEM: 2}


@dataclass(frozen=True)
class Finding:
    """One line of the doctor's table.

    ``subject`` names what was checked (``"slurm"``, ``"partition gpu"``, ``"pool gpu: experiments
    dir"``); ``detail`` is what was found; ``action`` is what detslurm does about it (or what the
    admin or user should do, for a problem)."""

    subject: str
    status: Status
    detail: str
    action: str = ""

    # The --json form: plain strings only, so the schema never depends on Python's enum names.
    def as_dict(self) -> dict[str, str]:
        return {"subject": self.subject, "status": self.status.value, "detail": self.detail, "action": self.action}


def worst(findings: Iterable[Finding]) -> Status:
    """The most severe status among ``findings`` (OK when there are none)."""
    return max((f.status for f in findings), key=_RANK.__getitem__, default=Status.OK)


def report_json(findings: Sequence[Finding], cluster: str, slurm_version: str) -> dict[str, Any]:
    """The --json document: the findings in table order plus a count per status."""
    counts = {s.value: sum(1 for f in findings if f.status is s) for s in Status}
    return {
        "schema": SCHEMA,
        "cluster": cluster,
        "slurm_version": slurm_version,
        "status": worst(findings).value,
        "counts": counts,
        "findings": [f.as_dict() for f in findings],
    }
