"""Determined's API surface, compared with the real determined 0.38.1 (the oracle).

Both sides are read by introspection (tests/determined_surface.py, run once by each
interpreter): every public name of the modules users touch, and of their public classes, with
parameters, defaults and enum values. Every difference must be listed in the compatibility doc
(docs/user/determined-compat.md), either as excluded, with why, or as not yet built; an entry
that no longer matches a difference fails too, so the doc stays the truth.
`.venv/bin/python tests/determined_oracle.py` prints the counts.
"""

from __future__ import annotations

import pytest
from determined_oracle import covered_by, differences, listed, oracle_surface, our_surface

pytest.importorskip("torch")  # both sides import determined.pytorch
pytestmark = pytest.mark.torch


def _table(rows: dict[str, str]) -> str:
    return "\n".join(f"| `{path}` | {why} |" for path, why in sorted(rows.items()))


def test_every_difference_from_determined_is_documented() -> None:
    diffs = differences(oracle_surface(), our_surface())
    documented = {**listed("excluded"), **listed("not-yet")}
    unexplained = {p: d for p, d in diffs.items() if covered_by(p, documented) is None}
    assert not unexplained, (
        f"{len(unexplained)} differences from determined 0.38.1 are in no list of "
        f"docs/user/determined-compat.md (fix them, or add rows):\n{_table(unexplained)}"
    )


def test_every_documented_difference_still_is_one() -> None:
    diffs = differences(oracle_surface(), our_surface())
    for section in ("excluded", "not-yet"):
        entries = listed(section)
        used = {covered_by(p, entries) for p in diffs}
        stale = sorted(set(entries) - used)
        assert not stale, f"docs/user/determined-compat.md lists as {section} what now matches Determined: {stale}"


def test_no_path_is_both_excluded_and_not_yet() -> None:
    assert not set(listed("excluded")) & set(listed("not-yet"))


# The comparison itself, on surfaces written by hand.
CLASS = {"kind": "class", "signature": "(a, b=1)", "bases": []}


def test_a_missing_class_counts_once_not_per_member() -> None:
    theirs = {"m": {"kind": "module"}, "m.C": CLASS, "m.C.f": {"kind": "method", "signature": "(self)"}}
    assert differences(theirs, {"m": {"kind": "module"}}) == {"m.C": "missing"}


def test_a_changed_default_and_an_enum_value_are_differences() -> None:
    theirs = {
        "m.f": {"kind": "function", "signature": "(x, y=True)"},
        "m.E": {"kind": "enum", "members": {"A": "1"}},
    }
    ours = {
        "m.f": {"kind": "function", "signature": "(x, y=False)"},
        "m.E": {"kind": "enum", "members": {"A": "'A'"}},
    }
    got = differences(theirs, ours)
    assert got == {
        "m.E": "enum members differ: A: 1 there, 'A' here",
        "m.f": "Determined: function (x, y=True); detslurm: function (x, y=False)",
    }


def test_a_member_inherited_from_an_api_base_counts_at_the_base() -> None:
    method = {"kind": "method", "signature": "(self, x)"}
    theirs = {"m.B": CLASS, "m.B.g": method, "m.S": {**CLASS, "bases": ["m.B"]}, "m.S.g": method}
    ours = {"m.B": CLASS, "m.S": CLASS}
    assert differences(theirs, ours) == {"m.B.g": "missing"}


def test_an_entry_covers_its_own_path_only() -> None:
    """A listed class does not hide a difference in one of its members."""
    entries = {"determined.core.Context": "built by core.init()"}
    assert covered_by("determined.core.Context", entries) == "determined.core.Context"
    assert covered_by("determined.core.Context.alert", entries) is None
