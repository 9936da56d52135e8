"""`det e create` has one owner, detslurm/controller/create.py: the CLI takes no part in checking,
planning or storing an experiment, and a create validates its config once and computes its
resource plan once. Validation gives the config in its canonical form, the one the store's
read-back gives, so the refusal check, the dry run and the first submission plan from the config
the create validated, and every submission (the daemon's too) gives trials the same config."""

from __future__ import annotations

import ast
import importlib
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLES, ROOT, write
from test_refusals import FakeSlurm

from detslurm.errors import ConfigError
from detslurm.slurm.client import Result

CORE = EXAMPLES / "core_api"


@pytest.fixture
def validations(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every validation of an experiment config in this process (from a file or from the store)."""
    from detslurm.controller import create
    from detslurm.expconf import load

    seen: list[str] = []
    real = load.validate

    def counting(raw: Any, default_storage: Any = None) -> Any:
        seen.append(str(raw.get("name")))
        return real(raw, default_storage)

    # load.validate serves from_stored (the store's configs); create holds its own name for it.
    monkeypatch.setattr(load, "validate", counting)
    monkeypatch.setattr(create, "validate", counting)
    return seen


@pytest.fixture
def resource_plans(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every resource plan computed in this process (slurm.render.resource_plan), by config name."""
    from detslurm.slurm import render

    # Imported first: each module that plans holds its own name for resource_plan.
    for planner in ("detslurm.controller.placement", "detslurm.controller.slurm_plan", "detslurm.slurm.refusals"):
        importlib.import_module(planner)

    seen: list[str] = []
    real = render.resource_plan

    def counting(config: Any, site: Any) -> Any:
        seen.append(config.name)
        return real(config, site)

    for module in list(sys.modules.values()):
        if getattr(module, "resource_plan", None) is real:
            monkeypatch.setattr(module, "resource_plan", counting)
    return seen


class Slurm(FakeSlurm):
    """The test cluster as captured, which queues every job it is given (job 77 on)."""

    def answer(self, argv: list[str], input: str | None) -> Result:
        if argv[:2] == ["sbatch", "--parsable"]:
            return Result(0, f"{77 + self.count('sbatch', '--parsable') - 1}\n", "")
        return super().answer(argv, input)


@pytest.fixture
def slurm(monkeypatch: pytest.MonkeyPatch) -> Slurm:
    """A fake Slurm behind the CLI's client, and no daemon started after a create."""
    from detslurm import daemon
    from detslurm.slurm import client

    fake = Slurm()
    monkeypatch.setattr(client, "client_from_env", lambda runner=None: client.SlurmClient(fake, user="alice"))
    monkeypatch.setattr(daemon, "start", lambda settings: 0)
    return fake


def config(tmp_path: Path, name: str) -> Path:
    # A name of its own: the content caches of earlier tests must not answer for this one.
    return write(tmp_path / "c.yaml", (CORE / "const.yaml").read_text().replace("core-api-const", name))


def test_a_slurm_dry_run_validates_the_config_once(det: Any, tmp_path: Path, validations: list[str]) -> None:
    name = f"dry-{tmp_path.name}"
    code, out, err = det("e", "create", "--dry-run", config(tmp_path, name), CORE)
    assert code == 0, err
    assert "sbatch --parsable" in out and "nothing was created" in out
    # The file's; the refusal check's sample and the dry run read back what it gave.
    assert validations == [name]


def test_a_slurm_create_validates_and_plans_once_through_its_first_submission(
    det: Any, tmp_path: Path, validations: list[str], resource_plans: list[str], slurm: Slurm
) -> None:
    name = f"slurm-{tmp_path.name}"
    code, out, err = det("e", "create", config(tmp_path, name), CORE)
    assert code == 0, err
    assert "Created experiment 1" in out
    assert (slurm.count("sbatch", "--test-only"), slurm.count("sbatch", "--parsable")) == (1, 1)
    # The place's check computed the resource plan; the refusal check and the first submission
    # (one tick, in this process) used it, with the config the create validated.
    assert validations == [name] and resource_plans == [name]


def test_a_slurm_dry_run_plans_the_resources_once(det: Any, tmp_path: Path, resource_plans: list[str]) -> None:
    name = f"dry-plan-{tmp_path.name}"
    code, out, err = det("e", "create", "--dry-run", config(tmp_path, name), CORE)
    assert code == 0 and "sbatch --parsable" in out, err
    # The place's check; the refusal check's sample and the dry run's plan use what it computed.
    assert resource_plans == [name]


def test_a_local_create_validates_once_through_its_first_submissions(
    det: Any, tmp_path: Path, validations: list[str]
) -> None:
    name = f"local-{tmp_path.name}"
    code, out, err = det("e", "create", "--local", config(tmp_path, name), CORE)
    assert code == 0, err
    assert "Created experiment 1" in out and "Experiment 1 COMPLETED" in out
    # The driver's ticks read back the config the create validated and stored.
    assert validations == [name]


def canonical_examples() -> list[Path]:
    return sorted(EXAMPLES.glob("*/*.yaml"))


@pytest.mark.parametrize("example", canonical_examples(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_validating_the_stored_form_of_a_config_gives_the_same_config_in_the_same_order(
    example: Path, tmp_path: Path
) -> None:
    from detslurm.expconf import from_stored, parse_yaml, validate

    try:
        cfg = validate(parse_yaml(example.read_text()), {"type": "shared_fs", "host_path": "/ckpt"})
    except ConfigError:
        pytest.skip("not an experiment config")
    # What this process validated is what reading its stored form back returns.
    assert from_stored(cfg.as_dict()) is cfg
    # And what validating that form again would give: equal in every part, in the same order.
    again = validate(json.loads(json.dumps(cfg.as_dict(), sort_keys=True)))
    assert again == cfg
    assert json.dumps(again.as_dict()) == json.dumps(cfg.as_dict())


def test_a_config_with_unsorted_maps_is_stored_as_its_read_back_gives_it(tmp_path: Path) -> None:
    from detslurm.expconf import parse_yaml, validate

    cfg_path, _, _ = unsorted_experiment(tmp_path, f"canon-{tmp_path.name}")
    cfg = validate(parse_yaml(cfg_path.read_text()), {"type": "shared_fs", "host_path": str(tmp_path / "ckpts")})
    assert json.dumps(cfg.as_dict()) == as_the_daemon_reads_it(cfg_path, tmp_path / "ckpts")
    assert validate(json.loads(json.dumps(cfg.as_dict(), sort_keys=True))) == cfg


def test_a_row_stored_without_a_later_default_is_validated_once(tmp_path: Path, validations: list[str]) -> None:
    """A row an older detslurm stored, without a setting added since: it validates to more than
    it holds, and is still validated only at its first read."""
    from detslurm.expconf import from_stored, parse_yaml
    from detslurm.expconf.load import validate

    name = f"old-{tmp_path.name}"
    row = validate(parse_yaml(config(tmp_path, name).read_text()), {"type": "shared_fs", "host_path": str(tmp_path)})
    old = {k: v for k, v in row.as_dict().items() if k != "debug"}
    first = from_stored(old)
    assert from_stored(old) is first and first.top.debug is False
    assert validations == [name, name]  # the file's (above), then the row's at its first read


def test_a_stored_config_changed_since_it_was_validated_is_validated_again(tmp_path: Path) -> None:
    from detslurm.expconf import from_stored, parse_yaml, validate

    storage = {"type": "shared_fs", "host_path": str(tmp_path)}
    cfg = validate(parse_yaml(config(tmp_path, f"edit-{tmp_path.name}").read_text()), storage)
    assert from_stored(cfg.as_dict()) is cfg
    with pytest.raises(ConfigError, match=r"<experiment 1>\.max_restarts"):
        from_stored({**cfg.as_dict(), "max_restarts": "many"}, "<experiment 1>")
    # A row edited by hand, with a map out of order: validated, and given in the canonical order.
    edited = from_stored({**cfg.as_dict(), "data": {"b": 2, "a": 1}})
    assert edited is not cfg and list(edited.as_dict()["data"]) == list(edited.top.data) == ["a", "b"]


# Free-form maps (data, hyperparameters, a group inside them) out of order, and a log hparam
# whose base validation fills in: the config every submission puts in DET_EXPERIMENT_CONFIG has
# them as the store's read-back has them, sorted, from the first submission on.
UNSORTED = """\
name: NAME
entrypoint: python3 dump.py
searcher: {name: grid, metric: loss, max_length: {batches: 1}}
max_restarts: 0
reproducibility: {experiment_seed: 7}
data: {zeta: 1, alpha: {y: 2, b: 3}, mid: [3, 1]}
hyperparameters:
  width: {type: int, minval: 1, maxval: 2, count: 2}
  act: {type: categorical, vals: [relu, tanh]}
  lr: {type: log, minval: -3, maxval: -2, count: 1}
  opt: {momentum: 0.9, beta: {type: const, val: 2}}
environment: {environment_variables: [OUT=DIR]}
"""
DUMP = """\
import json, os, pathlib
seen = {k: os.environ[k] for k in ("DET_EXPERIMENT_CONFIG", "DET_HPARAMS")}
pathlib.Path(os.environ["OUT"], os.environ["DET_TRIAL_ID"] + ".json").write_text(json.dumps(seen))
"""
# Grid points in sorted-name order, the first name outermost, each trial's hparams sorted too;
# trials take them from the end, as Determined's do.
GRID = [
    {"act": act, "lr": 10.0**-2.5, "opt": {"beta": 2, "momentum": 0.9}, "width": width}
    for act in ("tanh", "relu")
    for width in (2, 1)
]


def unsorted_experiment(tmp_path: Path, name: str) -> tuple[Path, Path, Path]:
    """(config, context, where its trials write what they saw)."""
    out = tmp_path / "seen"
    out.mkdir()
    text = UNSORTED.replace("NAME", name).replace("DIR", str(out))
    return write(tmp_path / "c.yaml", text), write(tmp_path / "ctx" / "dump.py", DUMP).parent, out


def as_the_daemon_reads_it(config_path: Path, storage: Path) -> str:
    """DET_EXPERIMENT_CONFIG as a submission from the store gives it: the stored JSON, read back
    (sorted by the read's cache key) and validated. Computed here, apart from the create."""
    from detslurm.expconf import parse_yaml, validate

    first = validate(parse_yaml(config_path.read_text()), {"type": "shared_fs", "host_path": str(storage)})
    stored = json.loads(json.dumps(first.as_dict(), sort_keys=True))
    return json.dumps(validate(stored).as_dict())


def exports(script: str) -> tuple[dict[str, str], dict[int, dict[str, str]]]:
    """The variables an array script exports for all tasks, and those of each task."""
    shared = dict(shlex.split(m)[0].split("=", 1) for m in re.findall(r"^export (DET_.*)$", script, re.M))
    tasks = {
        int(m.group(1)): dict(shlex.split(line)[1].split("=", 1) for line in m.group(2).splitlines())
        for m in re.finditer(r"^(\d+)\)\n((?:  export .*\n)+)", script, re.M)
    }
    return shared, tasks


def test_a_dry_run_shows_the_config_and_grid_points_a_submission_from_the_store_gets(det: Any, tmp_path: Path) -> None:
    cfg, ctx, _ = unsorted_experiment(tmp_path, f"order-{tmp_path.name}")
    code, out, err = det("e", "create", "--dry-run", cfg, ctx)
    assert code == 0, err
    shared, tasks = exports(out)
    expected = as_the_daemon_reads_it(cfg, tmp_path / "ckpts")
    assert shared["DET_EXPERIMENT_CONFIG"] == expected
    seen = json.loads(expected)
    assert list(seen["data"]) == ["alpha", "mid", "zeta"] and list(seen["data"]["alpha"]) == ["b", "y"]
    assert list(seen["hyperparameters"]) == ["act", "lr", "opt", "width"]
    assert list(seen["hyperparameters"]["lr"]) == ["base", "count", "maxval", "minval", "type"]
    assert [tasks[i]["DET_HPARAMS"] for i in sorted(tasks)] == [json.dumps(hp) for hp in GRID]


def test_the_first_submission_gives_trials_the_config_and_grid_points_of_the_dry_run(det: Any, tmp_path: Path) -> None:
    cfg, ctx, out = unsorted_experiment(tmp_path, f"order-local-{tmp_path.name}")
    code, text, err = det("e", "create", "--local", cfg, ctx)
    assert "Created experiment 1" in text, err
    seen = {int(p.stem): json.loads(p.read_text()) for p in out.glob("*.json")}
    assert sorted(seen) == [1, 2, 3, 4], (text, err)
    expected = as_the_daemon_reads_it(cfg, tmp_path / "ckpts")
    assert [seen[t]["DET_EXPERIMENT_CONFIG"] for t in (1, 2, 3, 4)] == [expected] * 4
    assert [seen[t]["DET_HPARAMS"] for t in (1, 2, 3, 4)] == [json.dumps(hp) for hp in GRID]


# What only controller/create.py (and the Place it is given) may call: the CLI asks it to create.
CREATE_STEPS = {
    "detslurm.controller.create": {"execute_create", "dry_run"},
    "detslurm.slurm.render": {"resource_plan", "image_for", "container_warnings"},
    "detslurm.slurm.refusals": {"RequestRefused", "job_shape", "check_shape"},
    "detslurm.expconf": {"validate"},
}


def create_steps_used(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module in CREATE_STEPS:
            found += [f"{path.name}:{node.lineno} {a.name}" for a in node.names if a.name in CREATE_STEPS[node.module]]
        if isinstance(node, ast.Attribute) and node.attr in CREATE_STEPS["detslurm.controller.create"]:
            found.append(f"{path.name}:{node.lineno} .{node.attr}")
    return found


def test_the_cli_takes_no_part_in_checking_planning_or_storing_a_create() -> None:
    create_path = [ROOT / "cli" / name for name in ("experiment.py", "experiment_verbs.py", "backend.py", "local.py")]
    assert [u for p in create_path for u in create_steps_used(p)] == []


def test_the_create_step_check_finds_what_it_looks_for(tmp_path: Path) -> None:
    bad = write(
        tmp_path / "bad.py",
        "from detslurm.controller.create import dry_run\n"
        "from detslurm.slurm.render import resource_plan\n"
        "import detslurm.controller.create as c\n"
        "c.execute_create(1, 2, 3, 'slurm')\n",
    )
    assert len(create_steps_used(bad)) == 3
