"""Our fast presto tables are tabulate's, cell for cell (on every kind of cell we lay out)."""

from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone

from hypothesis import given, settings
from hypothesis import strategies as st
from tabulate import tabulate

from detslurm.cli.render import fmt_time, presto

CELLS = [
    None,
    "",
    0,
    7,
    12345,
    -3,
    "5",
    "abc",
    "a b",
    "COMPLETED",
    "2026-01-01 00:00:00+0000",
    "10.0%",
    "x" * 30,
    " ",
    "007",
    "-4",
    "1e3",
    "3.5",
    "nan",
    "True",
    2.5,
    True,
]


def test_presto_matches_tabulate_on_random_tables() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        ncol, nrow = rng.randint(1, 5), rng.randint(0, 6)
        headers = [rng.choice(["ID", "Name", "A long header", "x", ""]) for _ in range(ncol)]
        rows = [[rng.choice(CELLS) for _ in range(ncol)] for _ in range(nrow)]
        assert presto(headers, rows) == tabulate(rows, headers=headers, tablefmt="presto"), (headers, rows)


def test_array_task_ids_stay_text() -> None:
    out = presto(["ID", "N"], [["388_998", 1], ["12", 22]])
    assert out.splitlines()[2] == " 388_998 |   1" and out.splitlines()[3] == " 12      |  22"


@settings(max_examples=300, deadline=None)
@given(
    st.datetimes(min_value=datetime(1000, 1, 1), max_value=datetime(9999, 12, 30)),
    st.one_of(st.none(), st.integers(-23 * 60, 23 * 60).map(lambda m: timezone(timedelta(minutes=m)))),
)
def test_times_print_as_determined_prints_them_in_utc(when: datetime, tz: timezone | None) -> None:
    """fmt_time: UTC, to the second, with a literal +0000 (naive datetimes are the store's UTC);
    the same text strftime gives, which it replaced for speed."""
    t = when if tz is None else when.replace(tzinfo=tz)
    utc = t.replace(tzinfo=timezone.utc) if tz is None else t.astimezone(timezone.utc)
    assert fmt_time(t) == utc.strftime("%Y-%m-%d %H:%M:%S+0000")
    assert fmt_time(None) == ""
