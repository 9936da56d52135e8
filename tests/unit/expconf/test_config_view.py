"""One typed view of a stored experiment config (detslurm/expconf/view.py): its reads, and a
check that product code reads a stored config only through it, never as raw JSON."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT

from detslurm.expconf import validate
from detslurm.expconf.view import ConfigView, LengthView

# The view's fields: a product module that reads one of these keys from a stored config reads it
# through ConfigView (expconf/ itself builds and validates configs, and is exempt).
VIEW_KEYS = {
    "searcher",
    "resources",
    "labels",
    "entrypoint",
    "debug",
    "data",
    "optimizations",
    "records_per_epoch",
    "preemption_timeout",
    "reproducibility",
    "hyperparameters",
    "scheduling_unit",
    "checkpoint_policy",
    "perform_initial_validation",
    "min_validation_period",
    "min_checkpoint_period",
}
# Names that hold a whole config in product code.
CONFIG_NAMES = {"config", "cfg", "exp_config", "experiment_config"}
CONFIG_ATTRS = {"config", "_config"}


def _key(node: ast.AST) -> str | None:
    """The string key a `.get("k")` call or a `["k"]`/`[("k", ...)]` subscript reads, if any."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
        first = node.args[0]
    elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
        first = node.slice.elts[0] if isinstance(node.slice, ast.Tuple) and node.slice.elts else node.slice
    else:
        return None
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def _receiver(node: ast.AST) -> ast.AST:
    return node.func.value if isinstance(node, ast.Call) else node.value  # type: ignore[attr-defined,no-any-return]


def _is_config(node: ast.AST, key: str) -> bool:
    """Whether ``node`` holds a stored config: ``x.config``, ``x._config``, the result of
    ``json.loads(...)`` or ``get_experiment_config()``, or a variable named like a config (read
    for one of the view's own keys)."""
    if isinstance(node, ast.Attribute):
        return node.attr in CONFIG_ATTRS
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr in ("loads", "get_experiment_config")
    if isinstance(node, ast.BoolOp):  # (cfg.get("searcher") or {})
        return any(_is_config(v, key) for v in node.values)
    return isinstance(node, ast.Name) and node.id in CONFIG_NAMES and key in VIEW_KEYS


def raw_config_reads(source: str, name: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        key = _key(node)
        if key is not None and _is_config(_receiver(node), key):
            found.append(f"{name}:{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def product_files() -> list[Path]:
    files = [p for src in ("detslurm", "cli", "launchers") for p in sorted((ROOT / src).rglob("*.py"))]
    return [p for p in files if "expconf" not in p.relative_to(ROOT).parts]


def test_product_code_reads_stored_configs_only_through_the_view() -> None:
    files = product_files()
    assert len(files) > 100
    found = [r for p in files for r in raw_config_reads(p.read_text(), str(p.relative_to(ROOT)))]
    assert found == []


def test_the_raw_read_check_catches_each_shape() -> None:
    bad = (
        "a = exp.config.get('searcher', {}).get('metric')\n"
        "b = t.experiment.config['resources']\n"
        "c = json.loads(env.get('DET_EXPERIMENT_CONFIG') or '{}').get('preemption_timeout')\n"
        "d = self.context.get_experiment_config().get('records_per_epoch')\n"
        "e = (config.get('searcher') or {}).get('max_length')\n"
        "f = self._config.get('data', {})\n"
        "g = e.config[('searcher', 'name')]\n"
    )
    assert len(raw_config_reads(bad, "bad.py")) == 7
    ok = (
        "a = ConfigView(exp.config).searcher.metric\n"
        "b = e.config[SEARCHER_NAME]\n"  # a path the view names
        "c = site_config.get('pools')\n"
        "d = config.get('environment')\n"  # not a field the view reads (a redaction rewrites it)
        "e = node_config['pool']\n"
    )
    assert raw_config_reads(ok, "ok.py") == []


CONFIG = {
    "name": "mnist",
    "entrypoint": "python3 train.py",
    "labels": ["a", "b"],
    "records_per_epoch": 6000,
    "preemption_timeout": 30,
    "searcher": {"name": "adaptive_asha", "metric": "acc", "smaller_is_better": False, "max_trials": 4,
                 "max_length": {"epochs": 3}},
    "resources": {"slots_per_trial": 2, "resource_pool": "gpu"},
    "hyperparameters": {"global_batch_size": 64, "lr": {"type": "log", "minval": -4, "maxval": -1, "base": 10}},
    "optimizations": {"aggregation_frequency": 2},
    "min_validation_period": {"batches": 50},
    "reproducibility": {"experiment_seed": 7},
}  # fmt: skip


def test_the_view_reads_what_validation_stored() -> None:
    typed = validate(CONFIG, {"type": "shared_fs", "host_path": "/tmp"})
    view = ConfigView(typed.as_dict())
    assert view.name == typed.name == "mnist"
    assert (view.searcher.name, view.searcher.metric, view.searcher.smaller_is_better) == (
        "adaptive_asha",
        "acc",
        False,
    )
    assert typed.searcher.max_length is not None
    assert (
        view.searcher.max_length
        == LengthView("epochs", 3)
        == LengthView(*next(iter(typed.searcher.max_length.to_json().items())))
    )
    assert view.resources.slots_per_trial == typed.resources.slots_per_trial == 2
    assert view.resources.resource_pool == typed.resources.resource_pool == "gpu"
    assert view.labels == ["a", "b"] and view.entrypoint == typed.entrypoint
    assert (view.records_per_epoch, view.preemption_timeout, view.experiment_seed) == (6000, 30, 7)
    assert view.aggregation_frequency == 2 and view.average_aggregated_gradients is True
    assert view.length("min_validation_period") == LengthView("batches", 50)
    assert view.length("min_checkpoint_period") == LengthView("batches", 0)  # the default validation filled
    assert view.constant_hparam("global_batch_size") == 64  # stored as {"type": "const", "val": 64}
    assert view.constant_hparam("lr") is None and view.constant_hparam("absent") is None
    assert (view.scheduling_unit, view.checkpoint_policy, view.perform_initial_validation) == (100, "best", False)


def test_missing_null_or_mistyped_fields_read_as_the_schema_defaults() -> None:
    for raw in ({}, {"searcher": None, "resources": "x", "labels": "a", "debug": 1, "records_per_epoch": True}):
        view = ConfigView(raw)
        assert (view.searcher.metric, view.searcher.smaller_is_better, view.searcher.max_length) == ("", True, None)
        assert (view.resources.slots_per_trial, view.resources.resource_pool) == (1, "")
        assert (view.labels, view.debug, view.records_per_epoch, view.data) == ([], False, 0, {})
        assert (view.name, view.entrypoint, view.preemption_timeout) == ("Experiment", None, None)
    # A bare number of batches is Determined's pre-0.38 length; true is not one batch.
    assert ConfigView({"searcher": {"max_length": 100}}).searcher.max_length == LengthView("batches", 100)
    assert ConfigView({"searcher": {"max_length": True}}).searcher.max_length is None
    assert ConfigView({"searcher": {"max_length": {"batches": 1, "epochs": 2}}}).searcher.max_length is None
    assert ConfigView({"preemption_timeout": -1}).preemption_timeout is None
    assert ConfigView({"entrypoint": ["python3", 3]}).entrypoint is None


@pytest.mark.parametrize("text", [None, "", "not json", "[1, 2]", '"a string"', "null"])
def test_config_json_that_is_not_an_object_reads_as_an_empty_config(text: str | None) -> None:
    view = ConfigView.from_json(text)
    assert view.raw == {} and view.searcher.metric == "" and view.entrypoint is None
    assert ConfigView.from_json(json.dumps({"entrypoint": ["a", "b"]})).entrypoint == ["a", "b"]


def test_merge_config_lays_a_patch_over_a_copy() -> None:
    from detslurm.expconf import merge_config

    base: dict[str, Any] = {"resources": {"slots_per_trial": 2, "resource_pool": "a"}, "labels": ["x"]}
    out = merge_config(base, {"resources": {"resource_pool": "b"}, "labels": []})
    assert out == {"resources": {"slots_per_trial": 2, "resource_pool": "b"}, "labels": []}
    assert base["resources"]["resource_pool"] == "a" and base["labels"] == ["x"]  # untouched


def test_importing_the_view_loads_neither_pydantic_nor_yaml() -> None:
    import subprocess
    import sys

    code = (
        "import sys\nfrom detslurm.expconf.view import ConfigView\n"
        "print(sorted(m for m in ('pydantic', 'yaml', 'detslurm.expconf.load') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"
