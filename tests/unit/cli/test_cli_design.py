"""The CLI stays thin: no SQL (queries live in detslurm/views.py), and no branching on executor
names outside cli/backend.py (docs/design/architecture.md: the Backend is chosen once, at the CLI's edge)."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

CLI = sorted((ROOT / "cli").glob("*.py"))
EXECUTOR_NAMES = {"local", "slurm"}
QUERY_METHODS = {"execute", "query", "scalars", "scalar"}


def imported_names(tree: ast.AST) -> set[str]:
    """Names bound by import statements (modules and functions, never a session)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return out


def sql_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    imported = imported_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sqlalchemy"):
            found.append(f"{path.name}:{node.lineno} imports {node.module}")
        if isinstance(node, ast.Import) and any(a.name.startswith("sqlalchemy") for a in node.names):
            found.append(f"{path.name}:{node.lineno} imports sqlalchemy")
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id == "select":
            found.append(f"{path.name}:{node.lineno} select(")
        # s.execute(...), session.query(...): a query on a session (a local name, not a module).
        if isinstance(f, ast.Attribute) and f.attr in QUERY_METHODS:
            receiver = f.value.id if isinstance(f.value, ast.Name) else None
            if receiver not in imported:
                found.append(f"{path.name}:{node.lineno} .{f.attr}(")
    return found


def executor_comparisons(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(isinstance(o, ast.Constant) and o.value in EXECUTOR_NAMES for o in operands):
                found.append(f"{path.name}:{node.lineno}")
        value = node.value if isinstance(node, ast.MatchValue) else None
        if isinstance(value, ast.Constant) and value.value in EXECUTOR_NAMES:
            found.append(f"{path.name}:{node.lineno} (match)")
    return found


def test_cli_has_no_sql() -> None:
    assert len(CLI) > 5
    assert [u for p in CLI for u in sql_uses(p)] == []


def test_cli_does_not_branch_on_executor_names_outside_the_backend_module() -> None:
    assert [c for p in CLI if p.name != "backend.py" for c in executor_comparisons(p)] == []


def test_the_checks_catch_what_they_look_for(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from sqlalchemy import select\n"
        "def f(s, kind):\n"
        "    s.execute(select(1))\n"
        "    s.query(1)\n"
        "    return kind == 'local' or 'slurm' != kind\n"
    )
    assert len(sql_uses(bad)) == 4
    assert len(executor_comparisons(bad)) == 2
    ok = tmp_path / "ok.py"
    ok.write_text("from detslurm import queue as q\ndef f(c):\n    q.execute(c, [])\n")
    assert sql_uses(ok) == []
