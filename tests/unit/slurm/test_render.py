"""sbatch rendering: golden files per site config, resources, forbidden flags, hostile strings."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest

from detslurm.errors import ConfigError
from detslurm.expconf import ExperimentConfig, validate
from detslurm.protocol import trial_env
from detslurm.slurm.render import ArrayTask, Identity, index_ranges, plan_array, plan_trial_run, resource_plan
from detslurm.slurm.site import load_site_config

ROOT = Path(__file__).resolve().parents[3]
GOLDEN = Path(__file__).parents[2] / "golden"
STORAGE = {"type": "shared_fs", "host_path": "/shared/ckpt"}


def config(**over: Any) -> ExperimentConfig:
    raw: dict[str, Any] = {
        "name": "golden",
        "entrypoint": "python3 train.py --flag 1",
        "searcher": {"name": "single", "metric": "loss"},
        "reproducibility": {"experiment_seed": 1},
        "hyperparameters": {"lr": 0.1},
    }
    raw.update(over)
    return validate(raw, STORAGE)


def render(
    cfg: ExperimentConfig,
    site_name: str,
    run_dir: str = "/shared/exps/exp-1/trials/2/runs/3",
    hparams: dict[str, Any] | None = None,
) -> Any:
    site = load_site_config(ROOT / "site-configs" / f"{site_name}.yaml")
    env = trial_env(
        experiment_id=1,
        trial_id=2,
        run_id=3,
        seed=42,
        hparams=hparams or {"lr": 0.1},
        config=cfg.as_dict(),
        latest_checkpoint=None,
        steps_completed=0,
        run_dir=Path(run_dir),
        trial_dir=Path(run_dir).parent,
        exp_dir=Path("/shared/exps/exp-1"),
        checkpoint_base="/shared/ckpt",
        resources_type="slurm-job",
        slot_ids=[],
        container_addrs=[],
        user="alice",
    )
    env["MY_VAR"] = "x"
    return plan_trial_run(
        config=cfg,
        site=site,
        res=resource_plan(cfg, site),
        ident=Identity(1, 2, 3),
        env=env,
        run_dir=run_dir,
        log_path=f"{run_dir}/output.log",
        python="/opt/venv/bin/python",
    )


@pytest.mark.parametrize(
    "site,cfg",
    [
        ("test-cluster", {}),
        ("test-cluster", {"resources": {"slots_per_trial": 4, "resource_pool": "gpu"}, "slurm": {"gpu_type": "a100"}}),
        ("generic", {"resources": {"slots_per_trial": 16}, "slurm": {"sbatch_args": ["--mem=64G", "--exclusive"]}}),
    ],
)
def test_golden(site: str, cfg: dict[str, Any]) -> None:
    req = render(config(**cfg), site)
    slots = cfg.get("resources", {}).get("slots_per_trial", 1)
    path = GOLDEN / f"{site}-{slots}slots.sbatch"
    text = req.render()
    if os.environ.get("DETSLURM_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"golden file {path.name} is missing: run with DETSLURM_UPDATE_GOLDEN=1 once, review it"
    assert text == path.read_text()


def test_resources() -> None:
    site = load_site_config(ROOT / "site-configs/test-cluster.yaml")
    plan = resource_plan(config(), site)
    assert (list(plan.args), plan.nodes) == (
        ["--partition=cpu", "--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=1"],
        1,
    )
    plan = resource_plan(config(resources={"slots_per_trial": 4, "resource_pool": "gpu"}), site)
    assert plan.nodes == 2 and "--gres=gpu:2" in plan.args and "--partition=gpu" in plan.args
    plan = resource_plan(config(resources={"slots_per_trial": 3}, slurm={"slots_per_node": 1}), site)
    assert plan.nodes == 3 and "--cpus-per-task=1" in plan.args
    with pytest.raises(ConfigError, match="resource pool 'nope' does not exist; valid pools: cpu, gpu, high"):
        resource_plan(config(resources={"resource_pool": "nope"}), site)


def test_percent_in_log_path_is_escaped() -> None:
    req = render(config(), "test-cluster", run_dir="/shared/100%done/run")
    assert "--output=/shared/100%%done/run/output.log" in req.args


HOSTILE = ["it's", "$(touch PWNED)", "`touch PWNED`", "a\nb", "x; touch PWNED", "\\", '"quoted"', "$HOME", "*"]


@pytest.mark.fault
@pytest.mark.parametrize("evil", HOSTILE)
def test_hostile_strings_never_execute(tmp_path: Path, evil: str) -> None:
    cfg = config(
        name=f"exp {evil}",
        entrypoint=f"python3 train.py {evil}",
        description=evil,
        labels=[evil],
        hyperparameters={"h": evil, "nested": {"k": evil}},
    )
    run_dir = str(tmp_path / f"run {evil}".replace("\n", "_").replace("/", "_"))
    req = render(cfg, "test-cluster", run_dir=run_dir, hparams={"h": evil, "nested": {"k": evil}})
    # Run every export of the script in a shell: values must come back byte for byte, nothing runs.
    exports = "".join(
        line + "\n"
        for line in req.script.splitlines()
        if line.startswith("export ") and "$" not in line.split("=", 1)[0]
    )
    probe = exports + 'printf "%s" "$DET_HPARAMS"'
    out = subprocess.run(["bash", "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert out == req.env["DET_HPARAMS"]
    assert not (tmp_path / "PWNED").exists()
    assert subprocess.run(["bash", "-n"], input=req.script, text=True).returncode == 0
    assert f"cd {shlex.quote(run_dir)} ||" in req.script
    assert all("\n" not in a for a in req.args)


def array_tasks(tmp_path: Path, hps: list[Any]) -> list[ArrayTask]:
    cfg = config()
    out = []
    for i, h in enumerate(hps):
        run_dir = tmp_path / f"trials/{10 + i}/runs/1"
        env = trial_env(
            experiment_id=1,
            trial_id=10 + i,
            run_id=1,
            seed=i,
            hparams={"h": h},
            config=cfg.as_dict(),
            latest_checkpoint=None,
            steps_completed=0,
            run_dir=run_dir,
            trial_dir=run_dir.parent.parent,
            exp_dir=tmp_path,
            checkpoint_base="/shared/ckpt",
            resources_type="slurm-job",
            slot_ids=[],
            container_addrs=[],
            user="alice",
        )
        out.append(ArrayTask(10 + i, str(run_dir), env))
    return out


def test_index_ranges() -> None:
    assert index_ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert index_ranges([3]) == "3"


@pytest.mark.fault
@pytest.mark.parametrize("evil", HOSTILE)
def test_array_script_gives_each_task_its_own_trial(tmp_path: Path, evil: str) -> None:
    site = load_site_config(ROOT / "site-configs/test-cluster.yaml")
    tasks = array_tasks(tmp_path, [evil, f"{evil}-2", 3])
    req = plan_array(
        config=config(),
        site=site,
        res=resource_plan(config(), site),
        ident=Identity(1, 10, 1, array=True),
        tasks=tasks,
        links_dir=str(tmp_path / "arrays/t10-r1"),
        log_name="output.log",
        python="/opt/venv/bin/python",
    )
    assert "--array=0-2" in req.args and "--comment=detslurm:exp=1,trial=10+,run=1" in req.args
    assert f"--output={tmp_path}/arrays/t10-r1/%a/output.log" in req.args
    assert req.script.count("DET_EXPERIMENT_CONFIG=") == 1  # shared values are exported once
    prologue = req.script[: req.script.index("export DETSLURM_PREEMPT_SIGNAL")]
    probe = prologue + 'printf "%s\\n%s\\n%s" "$DET_TRIAL_ID" "$DET_RUN_DIR" "$DET_HPARAMS"'
    for i, task in enumerate(tasks):
        out = subprocess.run(
            ["bash", "-c", probe],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=True,
            env=dict(os.environ, SLURM_ARRAY_TASK_ID=str(i)),
        ).stdout
        assert out.split("\n", 2) == [str(task.trial_id), task.run_dir, task.env["DET_HPARAMS"]]
    stray = subprocess.run(
        ["bash", "-c", prologue],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=dict(os.environ, SLURM_ARRAY_TASK_ID="7"),
    )
    assert stray.returncode == 1 and "array task 7 has no trial run" in stray.stderr
    assert not (tmp_path / "PWNED").exists()
    assert subprocess.run(["bash", "-n"], input=req.script, text=True).returncode == 0


def test_array_golden(tmp_path: Path) -> None:
    site = load_site_config(ROOT / "site-configs/test-cluster.yaml")
    tasks = [
        ArrayTask(
            t.trial_id,
            t.run_dir.replace(str(tmp_path), "/shared/exps/exp-1"),
            {k: v.replace(str(tmp_path), "/shared/exps/exp-1") for k, v in t.env.items()},
        )
        for t in array_tasks(tmp_path, [0.1, 0.2])
    ]
    cfg = config(resources={"max_slots": 1})
    req = plan_array(
        config=cfg,
        site=site,
        res=resource_plan(cfg, site),
        ident=Identity(1, 10, 1, array=True),
        tasks=tasks,
        links_dir="/shared/exps/exp-1/arrays/t10-r1",
        log_name="output.log",
        python="/opt/venv/bin/python",
    )
    path = GOLDEN / "test-cluster-array.sbatch"
    if os.environ.get("DETSLURM_UPDATE_GOLDEN") == "1":
        path.write_text(req.render())
    assert req.render() == path.read_text()


def test_env_names_are_checked_again_at_render() -> None:
    """A stored config edited after validation: a variable name that is shell code
    never reaches the script, where names are written unquoted."""
    site = load_site_config(ROOT / "site-configs/test-cluster.yaml")
    for evil in ("X;touch PWNED;Y", "A B", "1X", "$(id)"):
        with pytest.raises(ConfigError, match="not a valid shell variable name"):
            plan_trial_run(
                config=config(),
                site=site,
                res=resource_plan(config(), site),
                ident=Identity(1, 2, 3),
                env={evil: "1"},
                run_dir="/r",
                log_path="/r/output.log",
                python="/p",
            )
