"""`det e create` has one owner, detslurm/controller/create.py: the config is validated once per
create (its dry run and its first submission read back the config it validated), and the CLI
takes no part in checking, planning or storing it."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLES, ROOT, write

from detslurm.errors import ConfigError

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


def config(tmp_path: Path, name: str) -> Path:
    # A name of its own: the content caches of earlier tests must not answer for this one.
    return write(tmp_path / "c.yaml", (CORE / "const.yaml").read_text().replace("core-api-const", name))


def test_a_slurm_dry_run_validates_the_config_once(det: Any, tmp_path: Path, validations: list[str]) -> None:
    name = f"dry-{tmp_path.name}"
    code, out, err = det("e", "create", "--dry-run", config(tmp_path, name), CORE)
    assert code == 0, err
    assert "sbatch --parsable" in out and "nothing was created" in out
    # The plan's own validation; the refusal check's sample and the dry run plan from it.
    assert validations == [name]


def test_a_local_create_validates_once_through_its_first_submission(
    det: Any, tmp_path: Path, validations: list[str]
) -> None:
    name = f"local-{tmp_path.name}"
    code, out, err = det("e", "create", "--local", config(tmp_path, name), CORE)
    assert code == 0, err
    assert "Created experiment 1" in out and "Experiment 1 COMPLETED" in out
    # The driver's ticks submitted and followed the trial with the config the create validated.
    assert validations == [name]


@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("*/*.yaml")), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_the_config_a_create_remembers_is_what_validating_its_stored_form_gives(example: Path) -> None:
    """The first submission reads back the validated config instead of validating the stored
    JSON again: both must be the same config."""
    from detslurm.expconf import parse_yaml, validate

    try:
        cfg = validate(parse_yaml(example.read_text()), {"type": "shared_fs", "host_path": "/ckpt"})
    except ConfigError:
        pytest.skip("not an experiment config")
    again = validate(cfg.as_dict())
    assert again.as_dict() == cfg.as_dict()
    assert (again.searcher, again.storage, again.hyperparameters) == (cfg.searcher, cfg.storage, cfg.hyperparameters)
    # The top level keeps these three as written (raw); code reads their typed forms above.
    raw = {"checkpoint_storage", "hyperparameters", "searcher"}
    assert again.top.model_dump(exclude=raw) == cfg.top.model_dump(exclude=raw)


def test_a_stored_config_changed_since_it_was_validated_is_validated_again(tmp_path: Path) -> None:
    from detslurm.expconf import from_stored, parse_yaml, validate
    from detslurm.expconf.load import remember

    cfg = validate(parse_yaml(config(tmp_path, f"edit-{tmp_path.name}").read_text()), {"type": "shared_fs", "host_path": str(tmp_path)})
    remember(cfg)
    assert from_stored(cfg.as_dict()) is cfg
    edited = {**cfg.as_dict(), "max_restarts": "many"}
    with pytest.raises(ConfigError, match="max_restarts"):
        from_stored(edited, "<experiment 1>")


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
