"""The schema's head revision, read from the Alembic scripts themselves (migrations/versions/)
without importing alembic: every `det` call compares it with the store's stamp, and importing
alembic and SQLAlchemy for that would cost more than most commands. tests/unit/store/test_store.py checks
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
    revisions: set[str] = set()
    parents: set[str] = set()
    for script in VERSIONS.glob("*.py"):
        found: dict[str, str | None] = {m[1]: m[2] for m in _ASSIGNED.finditer(script.read_text(encoding="utf-8"))}
        rev, down = found.get("revision"), found.get("down_revision")
        if rev:
            revisions.add(rev)
            if down:
                parents.add(down)
    heads = revisions - parents
    if len(heads) != 1:
        raise StoreError(f"the store's migrations in {VERSIONS} have {len(heads)} heads, not one: {sorted(heads)}")
    return str(heads.pop())
