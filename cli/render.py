"""Tables and times in Determined's CLI formats (tabulate "presto", UTC times)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import click


def fmt_time(t: datetime | None) -> str:
    if t is None:
        return ""
    if t.tzinfo is not None:
        t = t.astimezone(timezone.utc).replace(tzinfo=None)
    # SQLite hands back naive datetimes; the store writes UTC, so naive means UTC here.
    # Determined's CLI prints UTC with a literal +0000 offset; scripts parse that format.
    # isoformat, not strftime: a fifth of the time, for the 10,000s of rows a describe prints.
    return t.isoformat(" ", "seconds") + "+0000"


def fmt_pct(x: float) -> str:
    return f"{x:.1%}"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    click.echo(presto(headers, rows))


def presto(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """tabulate's "presto" table. tabulate infers a type per cell (about 20 us each: seconds for
    10k experiments), so tables of ints, strings and empty cells are laid out here, the same
    way (a test compares both); anything else goes to tabulate. One difference: job ids of
    array tasks ("12_3") stay text, where tabulate would read them as the number 123."""
    cols = list(zip(*rows, strict=True)) if rows else [() for _ in headers]
    # Each distinct cell is classified once: columns repeat values (states, pools, times), and
    # checking 90k cells one by one was a third of `det e list`'s time with 10k experiments.
    # Keyed by type too, so that True and 1 (equal in a set) are both seen.
    kinds = [_distinct(c) for c in cols]
    if len(cols) != len(headers) or not all(k is not None and _simple(k) for k in kinds):
        # Imported only here: tabulate costs ~15 ms to import, and most tables never need it.
        from tabulate import tabulate

        return str(tabulate([list(r) for r in rows], headers=list(headers), tablefmt="presto"))
    # tabulate right-aligns a column only when every non-empty cell is a number; a column of
    # only empty cells stays left-aligned text.
    numeric = [bool(k) and any(v not in (None, "") for v in k) and all(_intlike(v) for v in k) for k in _known(kinds)]
    text = [["" if v is None else str(v) for v in c] for c in cols]
    # tabulate keeps two spaces beside every header (its MIN_PADDING).
    widths = [max(len(h) + 2, max(map(len, c), default=0)) for h, c in zip(headers, text, strict=True)]

    def pad(c: Sequence[str], w: int, num: bool) -> list[str]:
        return [v.rjust(w) for v in c] if num else [v.ljust(w) for v in c]

    # Padded a column at a time (not a call per cell): with 10k rows the per-cell layout was most
    # of `det e list`'s own time. Each line is " a | b | c " with trailing spaces stripped, as
    # tabulate strips its last column.
    head = [pad([h], w, num)[0] for h, w, num in zip(headers, widths, numeric, strict=True)]
    body = [pad(c, w, num) for c, w, num in zip(text, widths, numeric, strict=True)]
    out = [(" " + " | ".join(head)).rstrip(), "+".join("-" * (w + 2) for w in widths)]
    out += [(" " + " | ".join(r)).rstrip() for r in zip(*body, strict=True)]
    return "\n".join(out)


def _distinct(col: Sequence[Any]) -> list[Any] | None:
    """The column's distinct cells (one per type and value), or None when a cell is unhashable
    (such a table goes to tabulate)."""
    try:
        return [v for _, v in {(type(v), v) for v in col}]
    except TypeError:
        return None


def _known(kinds: list[list[Any] | None]) -> list[list[Any]]:
    # presto() only gets here when every column had distinct cells; this narrows the type.
    return [k if k is not None else [] for k in kinds]


def _simple(col: Sequence[Any]) -> bool:
    """Ints, empty cells and strings that tabulate would not read as floats."""
    return all(
        v is None
        or (isinstance(v, int) and not isinstance(v, bool))
        # bool is an int subclass, and tabulate prints "True"/"False" strings as booleans: both
        # go to tabulate so the fast path never lays them out differently.
        or (isinstance(v, str) and (_intlike(v) or not _floatlike(v)) and v not in ("True", "False"))
        for v in col
    )


def _floatlike(v: str) -> bool:
    if "_" in v:
        return False  # Python reads "12_3" as 123, and so would tabulate: array task ids are text
    try:
        float(v)
    except ValueError:
        return False
    return True


def _intlike(v: Any) -> bool:
    if v is None or v == "" or isinstance(v, int):
        return True
    try:
        int(v)
    except ValueError:
        return False
    # int() accepts " 7 " and "1_000", which tabulate would not align as numbers.
    return v.strip() == v and "_" not in v


def dump_json(obj: Any) -> None:
    # default=str: datetimes and enums print as text instead of failing the whole --json output.
    click.echo(json.dumps(obj, indent=2, sort_keys=True, default=str))


def write_csv(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """``--csv``: the table's headers and cells as CSV (Determined's CLI uses the same columns)."""
    import csv
    import io

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(headers)
    w.writerows([["" if v is None else v for v in r] for r in rows])
    click.echo(buf.getvalue(), nl=False)
