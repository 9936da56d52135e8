"""Tables and times in Determined's CLI formats (tabulate "presto", UTC times)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import click
from tabulate import tabulate


def fmt_time(t: datetime | None) -> str:
    if t is None:
        return ""
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return t.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S+0000")


def fmt_pct(x: float) -> str:
    return f"{x:.1%}"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    click.echo(tabulate([list(r) for r in rows], headers=list(headers), tablefmt="presto"))


def dump_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=True, default=str))
