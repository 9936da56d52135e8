"""`det e create` has one owner, detslurm/controller/create.py: the CLI takes no part in checking,
planning or storing an experiment, and a create validates its config twice at most: the file,
then the stored form that its refusal check, its dry run and its first submission all plan from
(what the daemon plans from too, so that the dry run shows what every submission gets)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLES, ROOT, write

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
    # The file, then its stored form: the refusal check's sample and the dry run share the latter.
    assert validations == [name, name]


def test_a_local_create_validates_its_stored_form_once_through_its_submissions(
    det: Any, tmp_path: Path, validations: list[str]
) -> None:
    name = f"local-{tmp_path.name}"
    code, out, err = det("e", "create", "--local", config(tmp_path, name), CORE)
    assert code == 0, err
    assert "Created experiment 1" in out and "Experiment 1 COMPLETED" in out
    # The file, then its stored form, which the driver's ticks read back without validating again.
    assert validations == [name, name]


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
