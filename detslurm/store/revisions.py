"""The schema's head revision, read from the Alembic scripts themselves (migrations/versions/)
without importing alembic: every `det` call compares it with the store's stamp, and importing
alembic and SQLAlchemy for that would cost more than most commands. tests/test_store.py checks
that this is what alembic computes."""

from __future__ import annotations

import functools
import re
from pathlib import Path

from detslurm.errors import StoreError

VERSIONS = Path(__file__).parent / "migrations" / "versions"
# The two assignments every revision script has (alembic's template), at the start of a line.
_ASSIGNED = re.compile(r"""^(revision|down_revision)\s*=\s*(?:['"]([^'"]+)['"]|None)\s*$""", re.MULTILINE)


@functools.cache
def head_revision() -> str:
    """The one revision no other revision names as its ``down_revision``."""
    revisions, parents = set(), set()
    for script in VERSIONS.glob("*.py"):
        found = dict(m.groups() for m in _ASSIGNED.finditer(script.read_text(encoding="utf-8")))
        if "revision" in found:
            revisions.add(found["revision"])
            if found.get("down_revision"):
                parents.add(found["down_revision"])
    heads = revisions - parents
    if len(heads) != 1:
        raise StoreError(f"the store's migrations in {VERSIONS} have {len(heads)} heads, not one: {sorted(heads)}")
    return heads.pop()
