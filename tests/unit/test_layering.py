"""The two sides of the shared-filesystem protocol stay apart (see detslurm/protocol/__init__.py).

In-job code (core, pytorch, exec, launch) runs on compute nodes inside the user's job: it may
import only detslurm.protocol and leaf modules, never the store, Slurm parsing or the
controller. Login-side code never imports the in-job packages. Both talk only through
detslurm.protocol. Imports are read with ``ast`` (function-local ones included), so nothing is
executed.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Source dir -> the package name it is installed as (pyproject's package-dir).
SOURCES = {"detslurm": "detslurm", "cli": "detslurm.cli", "launchers": "detslurm.launch"}

IN_JOB = ("detslurm.core", "detslurm.pytorch", "detslurm.exec", "detslurm.launch")
# ckpt_settings: the checkpoint settings that the trial and the login side's config check share.
# settings: every DETSLURM_* variable, the job protocol's included (standard library only).
# expconf.view: the typed view of a stored config that both sides read (standard library only).
LEAVES = (
    "detslurm.util",
    "detslurm.errors",
    "detslurm.context",
    "detslurm.ckpt_settings",
    "detslurm.settings",
    "detslurm.expconf.view",
)
PROTOCOL = "detslurm.protocol"
LOGIN = (
    "detslurm.controller",
    "detslurm.slurm",
    "detslurm.store",
    "detslurm.cli",
    "detslurm.daemon",
    "detslurm.jobenv",
    "detslurm.views",
    "detslurm.queue",
    # Not in the list, but login-side all the same: none of them runs in a job.
    "detslurm.client",
    "detslurm.searcher",
    "detslurm.expconf",
    "detslurm.doctor",
    "detslurm.dashboard",
    "detslurm.tbevents",
)


def _within(module: str, packages: tuple[str, ...] | str) -> bool:
    pkgs = (packages,) if isinstance(packages, str) else packages
    return any(module == p or module.startswith(p + ".") for p in pkgs)


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    parts = [SOURCES[rel.parts[0]], *rel.with_suffix("").parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(source: str, module: str, is_package: bool) -> Iterator[str]:
    """Every detslurm module ``module`` imports (``from a import b`` yields a and a.b)."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            yield from (f"{base}.{a.name}" for a in node.names)


def forbidden(importer: str, imported: str) -> str | None:
    """Why ``importer`` may not import ``imported``, or None."""
    if not _within(imported, "detslurm") or imported == "detslurm":
        return None
    if _within(importer, IN_JOB) and not _within(imported, (*IN_JOB, *LEAVES, PROTOCOL)):
        return "in-job code may import only detslurm.protocol and leaf modules"
    if _within(importer, PROTOCOL) and not _within(imported, (PROTOCOL, *LEAVES)):
        return "the protocol is shared by both sides: it may import only leaf modules"
    if _within(importer, LEAVES) and not _within(imported, LEAVES):
        return "leaf modules import no other detslurm module"
    if _within(importer, LOGIN) and _within(imported, IN_JOB):
        return "the login side reaches trials only through detslurm.protocol"
    return None


def edges() -> Iterator[tuple[str, str]]:
    for src in SOURCES:
        for path in sorted((ROOT / src).rglob("*.py")):
            mod = module_name(path)
            yield from ((mod, imp) for imp in imports(path.read_text(), mod, path.name == "__init__.py"))


def test_no_forbidden_import_edges() -> None:
    seen = list(edges())
    assert any(a.startswith("detslurm.core") and b.startswith(PROTOCOL) for a, b in seen)  # the walk works
    bad = sorted({f"{a} -> {b}: {why}" for a, b in seen if (why := forbidden(a, b))})
    assert bad == []


def test_the_checker_catches_each_kind_of_edge() -> None:
    cases = {
        ("detslurm.core._info", "from detslurm.slurm.parse import expand_nodelist"): "in-job",
        ("detslurm.launch._common", "from detslurm.store import open_store"): "in-job",
        ("detslurm.controller.apply", "import detslurm.core._info"): "login side",
        ("detslurm.cli.job", "from ..exec import launch"): "login side",
        ("detslurm.protocol.env", "from detslurm.controller import apply"): "protocol",
        ("detslurm.util", "from detslurm.store import db"): "leaf",
    }
    for (mod, source), want in cases.items():
        whys = [w for imp in imports(source, mod, False) if (w := forbidden(mod, imp))]
        assert whys and want in whys[0], (mod, source)
    allowed = [
        ("detslurm.core._train", "from detslurm.protocol import RunPaths"),
        ("detslurm.controller.apply", "from detslurm.protocol import decode"),
        ("detslurm.exec.launch", "from detslurm.context import extract"),
    ]
    for mod, source in allowed:
        assert not [imp for imp in imports(source, mod, False) if forbidden(mod, imp)], source


# -- the CLI's import graph ------------------------------------------------------------------
CLI = "detslurm.cli"
REMOTE = "detslurm.cli.remote"
# Argument spellings that the local commands and remote mode share; they import nothing of the CLI.
SHARED_ARGS = ("detslurm.cli.create_args",)


def lazy_modules(source: str) -> Iterator[str]:
    """Modules named to cli/lazy.py's ``lazy_module("...")``: loaded on first use, edges all the same."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_module" and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                yield arg.value


def cli_graph() -> dict[str, set[str]]:
    """Module -> the modules of detslurm.cli it imports, at module level, in functions or lazily."""
    graph: dict[str, set[str]] = {}
    for path in sorted((ROOT / "cli").rglob("*.py")):
        mod = module_name(path)
        source = path.read_text()
        graph[mod] = {*imports(source, mod, path.name == "__init__.py"), *lazy_modules(source)}
    # Only edges between modules of the CLI; importing a package's name is an edge to its __init__.
    return {mod: {m for m in deps if m in graph and m != mod} for mod, deps in graph.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cli_imports_form_no_cycle() -> None:
    graph = cli_graph()
    assert REMOTE + ".dispatch" in graph and CLI + ".main" in graph  # the walk found the CLI
    assert cycles(graph) == []


def test_the_remote_transport_imports_no_module_of_the_cli_above_it() -> None:
    """cli/remote is the transport cli.main uses; the commands whose arguments it reads are
    handed to it (cli.main.local_command), never imported."""
    graph = cli_graph()
    bad = sorted(
        f"{a} -> {b}"
        for a, deps in graph.items()
        if _within(a, REMOTE)
        for b in deps
        if not _within(b, REMOTE) and b not in SHARED_ARGS
    )
    assert bad == []
    assert {m: graph[m] for m in SHARED_ARGS} == {m: set() for m in SHARED_ARGS}


def test_the_cycle_check_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c"]]
    source = 'views = lazy_module("detslurm.cli.logs")\ndef f():\n    from detslurm.cli import slurm\n'
    assert list(lazy_modules(source)) == ["detslurm.cli.logs"]
    assert "detslurm.cli.slurm" in set(imports(source, "detslurm.cli.x", False))
