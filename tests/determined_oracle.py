"""The real ``determined`` 0.38.1 as the tests' oracle: its venv, its surface, the comparison.

The venv (.venv-determined) is made by scripts/oracle-venv, which the first caller here runs
(idempotent: a stamp check when it is already there), so a fresh clone needs nothing else.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ORACLE_PYTHON = ROOT / ".venv-determined/bin/python"
SURFACE_SCRIPT = Path(__file__).resolve().parent / "determined_surface.py"
COMPAT_DOC = ROOT / "docs/user/determined-compat.md"

Surface = dict[str, dict[str, Any]]


@functools.cache
def oracle_python() -> Path:
    """The oracle's interpreter, its venv made or checked first."""
    r = subprocess.run([str(ROOT / "scripts/oracle-venv")], capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"scripts/oracle-venv failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return ORACLE_PYTHON


# The start of every script that runs side by side under both interpreters: ``out`` is the
# record it dumps, and ``attempt(name, fn)`` records fn's result, or the exception it raised.
SCRIPT_RECORD = r"""
out = {}
def attempt(name, fn):
    try:
        out[name] = fn()
    except Exception as e:
        out[name] = f"raised {type(e).__name__}"
"""


def record_script(
    python: Path | str, script: str, work: Path, env: dict[str, str] | None = None, timeout: float = 300
) -> dict[str, Any]:
    """What ``script``, run as script.py in the new dir ``work`` by ``python``, dumped to the
    JSON file its first argument names."""
    work.mkdir()
    (work / "script.py").write_text(script)
    r = subprocess.run(
        [str(python), "script.py", "out.json"], capture_output=True, text=True, timeout=timeout, cwd=work, env=env
    )
    assert r.returncode == 0, f"{work.name}: {r.stderr[-3000:]}"
    got: dict[str, Any] = json.loads((work / "out.json").read_text())
    return got


ONEVAR = Path(__file__).resolve().parent / "fixtures/onevar_trial.py"


def onevar_start(python: Path | str, spec: Any, work: Path, name: str, env: dict[str, str]) -> subprocess.Popen[str]:
    """tests/fixtures/onevar_trial.py given ``spec``, started by ``python`` in work/cwd-NAME;
    it writes work/NAME.json."""
    cwd = work / f"cwd-{name}"
    cwd.mkdir(parents=True)
    args = [str(python), str(ONEVAR), str(work / f"{name}.json"), json.dumps(spec)]
    return subprocess.Popen(args, cwd=cwd, env={**os.environ, **env}, stderr=subprocess.PIPE, text=True)


def onevar_wait(proc: subprocess.Popen[str], work: Path, name: str, timeout: float = 600) -> Any:
    """What the run started by :func:`onevar_start` recorded."""
    err = proc.communicate(timeout=timeout)[1]
    assert proc.returncode == 0, f"{name}: {err[-4000:]}"
    return json.loads((work / f"{name}.json").read_text())


def onevar_runs(spec: Any, work: Path) -> tuple[Any, Any]:
    """(Determined's record, ours) of tests/fixtures/onevar_trial.py given ``spec``, the two run
    side by side, each with its own HOME (Determined's Trainer writes its off-cluster
    checkpoints under the user's data dir and copies the working dir into each: the two must
    not nest)."""
    sides = (("determined", oracle_python()), ("detslurm", Path(sys.executable)))
    procs = [(name, onevar_start(py, spec, work, name, {"HOME": str(work / f"home-{name}")})) for name, py in sides]
    theirs, ours = (onevar_wait(p, work, name) for name, p in procs)
    return theirs, ours


def same(a: Any, b: Any) -> bool:
    """Equal records, numbers to a relative 1e-6: Determined averages a window in float32,
    detslurm in float64."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def first_difference(theirs: list[Any], ours: list[Any]) -> str:
    for i, (a, b) in enumerate(zip(theirs, ours, strict=False)):
        if not same(a, b):
            return f"event {i}:\n  Determined: {a}\n  detslurm:   {b}"
    return f"Determined recorded {len(theirs)} events, detslurm {len(ours)}"


def surface(python: Path | str) -> Surface:
    """The JSON that tests/determined_surface.py prints under ``python``."""
    r = subprocess.run([str(python), str(SURFACE_SCRIPT)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    if r.returncode != 0:
        raise RuntimeError(f"{SURFACE_SCRIPT.name} under {python} failed:\n{r.stderr[-3000:]}")
    return dict(json.loads(r.stdout))


@functools.cache
def oracle_surface() -> Surface:
    return surface(oracle_python())


@functools.cache
def our_surface() -> Surface:
    return surface(sys.executable)


def _parent_missing(path: str, ours: Surface, missing: set[str]) -> bool:
    parts = path.split(".")
    return any(".".join(parts[:i]) in missing for i in range(1, len(parts)))


def _compared(entry: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in entry.items() if k != "bases"}


def _inherited_same(path: str, theirs: Surface, out: dict[str, str]) -> bool:
    """A member that Determined's class inherits unchanged from another API class whose same
    member already differs the same way: counted at the base, not again here."""
    owner, _, member = path.rpartition(".")
    for base in theirs.get(owner, {}).get("bases", []):
        there = f"{base}.{member}"
        if out.get(there) == out[path] and theirs.get(there) == theirs[path]:
            return True
    return False


def _describe(entry: dict[str, Any]) -> str:
    kind = entry["kind"]
    if kind == "alias":
        return f"the same object as {entry['of']}"
    detail = entry.get("signature") or entry.get("value") or entry.get("name") or entry.get("members") or ""
    return f"{kind} {detail}".strip()


def _difference(theirs: dict[str, Any], ours: dict[str, Any]) -> str | None:
    theirs, ours = _compared(theirs), _compared(ours)
    if theirs == ours:
        return None
    if theirs["kind"] == "enum" and ours["kind"] == "enum":
        a, b = theirs["members"], ours["members"]
        diffs = [
            f"{k}: {a.get(k, 'absent')} there, {b.get(k, 'absent')} here"
            for k in sorted({*a, *b})
            if a.get(k) != b.get(k)
        ]
        return "enum members differ: " + "; ".join(diffs)
    return f"Determined: {_describe(theirs)}; detslurm: {_describe(ours)}"


def differences(theirs: Surface, ours: Surface) -> dict[str, str]:
    """Each path of Determined's surface that detslurm lacks or has differently (a missing
    class or module counts once, not once per member), with what differs."""
    out: dict[str, str] = {}
    missing: set[str] = set()
    for path in sorted(theirs):
        if _parent_missing(path, ours, missing):
            continue
        if path not in ours:
            missing.add(path)
            diff: str | None = "missing"
        else:
            diff = _difference(theirs[path], ours[path])
        if diff is not None:
            out[path] = diff
    return {path: diff for path, diff in out.items() if not _inherited_same(path, theirs, out)}


_ROW = re.compile(r"^\|\s*`([\w.]+)`\s*\|(.*)\|\s*$")


def listed(section: str, doc: Path = COMPAT_DOC) -> dict[str, str]:
    """The table rows between ``<!-- determined-surface: SECTION -->`` and the next
    ``<!-- /determined-surface -->`` in the compatibility doc: path -> why."""
    text = doc.read_text()
    start = text.find(f"<!-- determined-surface: {section} -->")
    if start < 0:
        raise AssertionError(f"{doc}: no '<!-- determined-surface: {section} -->' block")
    end = text.find("<!-- /determined-surface -->", start)
    rows: dict[str, str] = {}
    for line in text[start:end].splitlines():
        m = _ROW.match(line)
        if m:
            path, why = m.group(1), m.group(2).strip()
            if not why:
                raise AssertionError(f"{doc}: `{path}` in {section} says no why")
            if path in rows:
                raise AssertionError(f"{doc}: `{path}` listed twice in {section}")
            rows[path] = why
    return rows


def covered_by(path: str, entries: dict[str, str]) -> str | None:
    """The entry for ``path`` (exact: a member of a listed class needs its own row; what lies
    under a missing class or module is not reported, so its one row covers it)."""
    return path if path in entries else None


def main() -> None:
    diffs = differences(oracle_surface(), our_surface())
    excluded, not_yet = listed("excluded"), listed("not-yet")
    n_excluded = sum(1 for p in diffs if covered_by(p, excluded))
    n_not_yet = sum(1 for p in diffs if covered_by(p, not_yet))
    print(
        f"{len(oracle_surface())} paths in determined 0.38.1's surface; {len(diffs)} differences: "
        f"{n_excluded} excluded, {n_not_yet} not yet built, {len(diffs) - n_excluded - n_not_yet} in no list"
    )
    for path, diff in diffs.items():
        if not covered_by(path, excluded) and ("-v" in sys.argv or not covered_by(path, not_yet)):
            print(f"  {path}: {diff}")


if __name__ == "__main__":
    main()
