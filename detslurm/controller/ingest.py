"""Read what trials appended to their event files since the recorded byte offset.

Only complete lines are consumed: a torn last line (a writer killed mid-write, or one still
writing) is left for the next read, and its bytes are not counted in the new offset.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_new(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n")
    if end < 0:
        return [], offset
    events: list[dict[str, Any]] = []
    for line in data[: end + 1].splitlines():
        if not line.strip():
            continue
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            ev = {"type": "corrupt", "raw": line[:200].decode(errors="replace")}
        if isinstance(ev, dict):
            events.append(ev)
    return events, offset + end + 1


def event_files(run_dir: Path) -> list[Path]:
    d = run_dir / "events"
    if not d.is_dir():
        return []
    return sorted(d.glob("rank-*.jsonl"))
