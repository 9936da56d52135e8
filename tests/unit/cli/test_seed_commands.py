"""Every command line the seed documents print, as written, parses; the launcher ones also run.

The lines are listed here with the seed file and line they come from (the seeds are not part of
this repository). Where the seeds' own checkout is next to the repo (a ``shared/seeds`` dir beside it),
``test_the_list_covers_every_seed_command`` re-extracts them and checks that none is missing.
Placeholders (``<configuration file>``, ``$CUSTOM_RDZV_ADDR``, ``$RANK CMD [ARGS...]``) get
stand-ins; ``dlprof`` (NVIDIA's profiler, not installable here) is a stand-in script that drops
its own options and runs the rest, which is all a nested launcher needs from it.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
import pytest
from conftest import EXAMPLES, write

from detslurm.cli.main import cli
from detslurm.exec.launch import entrypoint_argv
from detslurm.launch import deepspeed as ds_launcher
from detslurm.launch._common import Nodes, help_requested, parse_args
from detslurm.launch._horovod_args import parse_overrides
from detslurm.launch.horovod import take_autohorovod
from detslurm.launch.torch_distributed import build_torchrun_cmd
from detslurm.launch.wrap_rank import resolve_rank

SEEDS_DIR = Path(__file__).resolve().parents[4] / "shared" / "seeds"

# (seed file prefix, line, command line as printed). Lines the seeds repeat are listed once per seed.
DET_LINES = [
    ("000", 184, "det experiment create <configuration file> <context directory>"),
    ("000", 258, "det experiment create --local --test-mode <configuration file> <context directory>"),
    ("001", 135, "det experiment create <configuration file> <context directory>"),
    ("001", 180, "det job list"),
    ("001", 181, "det job ls"),
    ("001", 185, "det job list --resource-pool compute-pool"),
    ("001", 229, "det job update jobID --priority 10"),
    ("001", 230, "det job update jobID --resource-pool a100"),
    ("001", 231, "det job update jobID --ahead-of jobID-2"),
    ("001", 235, 'det job update-batch job1.priority=1 job2.resource-pool="compute" job3.ahead-of=job1'),
    ("001", 245, "det job update 73853c5c --ahead-of 0d714127"),
    ("001", 253, "det job update-batch 73853c5c.priority=1 0d714127.priority=1"),
    ("002", 9, "det experiment create <configuration file> <context directory>"),
    ("002", 25, "det experiment create --local --test-mode <configuration file> <context directory>"),
    ("003", 210, "det e create det.yaml . --local --test"),
    ("003", 298, "det e create det.yaml ."),
    ("004", 72, "det e create const.yaml . -f"),
    ("004", 172, "det e create metrics.yaml ."),
    ("004", 271, "det e create checkpoints.yaml . -f"),
    ("004", 362, "det e create adaptive.yaml ."),
    ("004", 482, "det e create distributed.yaml ."),
]
ENTRYPOINTS = [
    ("000", 30, "python3 script.py arg1 arg2"),
    (
        "000",
        98,
        "python3 -m determined.launch.horovod --fusion-threshold-mb 1 --cycle-time-ms 2 -- --trial model_def:MyTrial",
    ),
    (
        "000",
        117,
        "python3 -m determined.launch.torch_distributed --rdzv_endpoint=$CUSTOM_RDZV_ADDR -- --trial model_def:MyTrial",
    ),
    ("000", 134, "python3 -m determined.launch.deepspeed --trial model_def:MyTrial"),
    ("000", 160, "python3 -m determined.launch.horovod --trial model_def:TrialClass"),
    ("000", 173, "dlprof --mode=simple python3 -m determined.launch.autohorovod --trial model_def:MnistTrial"),
    ("001", 27, "python3 script.py arg1 arg2"),
    (
        "001",
        69,
        "python3 -m determined.launch.horovod --fusion-threshold-mb 1 --cycle-time-ms 2 -- --trial model_def:MyTrial",
    ),
    (
        "001",
        81,
        "python3 -m determined.launch.torch_distributed --rdzv_endpoint=$CUSTOM_RDZV_ADDR -- --trial model_def:MyTrial",
    ),
    ("001", 101, "python3 -m determined.launch.deepspeed --trial model_def:MyTrial"),
    ("001", 105, "python3 -m determined.launch.deepspeed -h"),
    ("001", 111, "model_def:TrialClass"),
    ("001", 121, "python3 -m determined.launch.horovod --trial model_def:TrialClass"),
    ("001", 129, "dlprof --mode=simple python3 -m determined.launch.autohorovod --trial model_def:MnistTrial"),
    # Prose in 001 ("wrap each rank worker in ..."), with a rank and a command filled in.
    ("001", 9, "python3 -m determined.launch.wrap_rank $RANK python3 script.py arg1"),
    ("003", 292, "python3 -m determined.launch.torch_distributed python3 train.py"),
    ("004", 412, "python3 -m determined.launch.torch_distributed python3 model_def_distributed.py"),
]
# Format descriptions, not commands: "python3 -m (LAUNCH_MODULE) (--trial TRIAL)|(SCRIPT...)", ...
NOT_COMMANDS = re.compile(r"\(LAUNCH|\(LAUNCHER\)|\(TRIAL_DEFINITION\)|\[\[|--trial TRIAL$|^script\.py \[args")


def parse_det(argv: Sequence[str]) -> click.Context:
    """Parse a `det` command line the way `det` would, without running it."""
    cmd: click.Command = cli
    ctx: click.Context | None = None
    name, rest = "det", list(argv)
    while isinstance(cmd, click.Group):
        # Groups parse resiliently (no callbacks, no "missing command"); the leaf parses strictly.
        ctx = cmd.make_context(name, [], parent=ctx, resilient_parsing=True)
        found, sub, rest = cmd.resolve_command(ctx, rest)
        assert sub is not None and found is not None
        name, cmd = found, sub
    return cmd.make_context(name, rest, parent=ctx)


def stand_in_files(tmp_path: Path) -> dict[str, str]:
    ctx = tmp_path / "ctx"
    cfg = "entrypoint: python3 script.py\nsearcher: {name: single, metric: loss}\n"
    for name in ("det.yaml", "const.yaml", "metrics.yaml", "checkpoints.yaml", "adaptive.yaml", "distributed.yaml"):
        write(ctx / name, cfg)
    write(ctx / "script.py", "print('hi')\n")
    return {"<configuration file>": str(ctx / "det.yaml"), "<context directory>": str(ctx)}


@pytest.mark.parametrize("seed,line,command", DET_LINES, ids=[f"{s}:{n}" for s, n, _ in DET_LINES])
def test_det_command_lines_parse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: str, line: int, command: str
) -> None:
    subst = stand_in_files(tmp_path)
    for k, v in subst.items():
        command = command.replace(k, shlex.quote(v))
    monkeypatch.chdir(tmp_path / "ctx")
    ctx = parse_det(shlex.split(command)[1:])
    assert ctx.command.name in ("create", "list", "update", "update-batch", "ls")


def test_det_parsing_does_catch_bad_lines(tmp_path: Path) -> None:
    with pytest.raises(click.UsageError):
        parse_det(["e", "create", "c.yaml", ".", "--no-such-flag"])
    with pytest.raises(click.UsageError):
        parse_det(["job", "update", "j1", "--priority", "high"])


def _launcher_args(argv: list[str]) -> tuple[str, list[str]] | None:
    for i in range(len(argv) - 1):
        if argv[i] == "-m" and argv[i + 1].startswith(("determined.launch.", "detslurm.launch.")):
            return argv[i + 1].rsplit(".", 1)[1], argv[i + 2 :]
    return None


def check_launcher(kind: str, args: list[str]) -> list[str]:
    """Parse one launcher's arguments exactly as its main() does; the command it would start."""
    if help_requested(args, "usage"):
        return []
    if kind == "wrap_rank":
        assert resolve_rank(args[0], {"RANK": "0"}) is not None
        return args[2:] if args[1] == "--" else args[1:]
    if kind == "horovod":
        args, _ = take_autohorovod(args)
    overrides, script = parse_args(args)
    if kind in ("horovod", "autohorovod"):
        parse_overrides(overrides)
    elif kind == "torch_distributed":
        from torch.distributed.run import get_args_parser

        cmd = build_torchrun_cmd(Nodes(["127.0.0.1"], 0, 2), 29400, overrides, script)
        get_args_parser().parse_args(cmd[3:])  # torchrun's own parser accepts the overrides
    elif kind == "deepspeed":
        pytest.importorskip("deepspeed")
        from deepspeed.launcher.runner import parse_args as ds_parse

        cmd = ds_launcher.build_deepspeed_cmd(Nodes(["127.0.0.1"], 0, 2), "/hf", 29400, overrides, script)
        ds_parse(cmd[3:])
    return script


@pytest.mark.parametrize("seed,line,command", ENTRYPOINTS, ids=[f"{s}:{n}" for s, n, _ in ENTRYPOINTS])
def test_entrypoint_lines_parse(seed: str, line: int, command: str) -> None:
    pytest.importorskip("torch")
    expanded = command.replace("$RANK", "0").replace("$CUSTOM_RDZV_ADDR", "127.0.0.1:29400")
    argv = entrypoint_argv(expanded, python="python3")
    if argv[0] == "dlprof":
        argv = [a for a in argv[1:] if not a.startswith("--mode")]  # what the stand-in dlprof runs
    # Nested launchers: each layer's arguments parse, down to the training script.
    seen = []
    while (found := _launcher_args(argv)) is not None:
        seen.append(found[0])
        argv = check_launcher(*found)
    assert command.endswith("-h") or argv, command
    if "--trial" in command or ":" in command.split()[-1]:
        assert argv[1:3] == ["-m", "detslurm.exec.harness"] and argv[3].startswith("model_def:")


def test_the_list_covers_every_seed_command() -> None:
    if not SEEDS_DIR.is_dir():
        pytest.skip(f"the seed documents are not next to the repo ({SEEDS_DIR})")
    listed = {c for _, _, c in DET_LINES + ENTRYPOINTS}
    pattern = re.compile(r"^\s*(?:\$ )?((?:det |python3 -m determined\.launch|dlprof |entrypoint: ).*)$")
    missing = []
    for path in sorted(SEEDS_DIR.glob("0*.txt")):
        lines = path.read_text().splitlines()
        n = 0
        while n < len(lines):
            m = pattern.match(lines[n])
            n += 1
            if not m:
                continue
            cmd = m.group(1).removeprefix("entrypoint: ").strip()
            if cmd == ">-":  # a folded YAML scalar: the command is the indented lines below
                folded = []
                while n < len(lines) and lines[n].strip():
                    folded.append(lines[n].strip())
                    n += 1
                cmd = " ".join(folded)
            if cmd and not NOT_COMMANDS.search(cmd) and cmd not in listed:
                missing.append(f"{path.name}:{n}: {cmd}")
    assert missing == []


# -- The launcher lines, run for real as local experiments with several slots -----------------

STAND_IN_DLPROF = '#!/bin/sh\n# stand-in for NVIDIA dlprof: drop its options, run the command\nwhile [ "${1#--}" != "$1" ]; do shift; done\nexec "$@"\n'


def legacy_context(tmp_path: Path) -> Path:
    """The Trainer example's trial class under every name the seeds use, plus stand-ins."""
    ctx = tmp_path / "ctx"
    write(ctx / "model_def.py", (EXAMPLES / "pytorch_trainer/model_def.py").read_text())
    with open(ctx / "model_def.py", "a") as f:
        f.write(
            "\n\nclass MyTrial(MyPyTorchTrial):\n"
            "    def __init__(self, context, hparams=None):\n"
            "        d = context.distributed\n"
            "        ddp = (os.environ.get('USE_TORCH_DISTRIBUTED') or 'none').lower()\n"
            "        print(f'trial rank {d.rank}/{d.size} ddp={ddp} hvd={os.environ.get(\"USE_HOROVOD\")}', flush=True)\n"
            "        super().__init__(context, hparams)\n\n\n"
            "TrialClass = MnistTrial = MyTrial\n"
        )
    write(ctx / "bin/dlprof", STAND_IN_DLPROF).chmod(0o755)
    write(ctx / "startup-hook.sh", 'export PATH="$PWD/bin:$PATH"\n')
    return ctx


LEGACY_CFG = (
    "hyperparameters: {{global_batch_size: 16, lr: 0.5}}\n"
    "searcher: {{name: single, metric: validation_loss, max_length: {{batches: 8}}}}\n"
    "min_validation_period: {{batches: 4}}\nmin_checkpoint_period: {{batches: 8}}\nmax_restarts: 0\n"
    "resources: {{slots_per_trial: {slots}}}\nentrypoint: {entrypoint}\n"
)
RUNS = [
    ("000:98 horovod overrides, 2 slots", ENTRYPOINTS[1][2], 2, "horovod"),
    ("000:117 torch_distributed with an unset $CUSTOM_RDZV_ADDR, 2 slots", ENTRYPOINTS[2][2], 2, None),
    ("000:134 deepspeed, 2 slots", ENTRYPOINTS[3][2], 2, "deepspeed"),
    ("001:111 legacy model_def:TrialClass, 2 slots", "model_def:TrialClass", 2, "horovod"),
    ("000:173 dlprof + autohorovod, 1 slot", ENTRYPOINTS[5][2], 1, None),
]


# The lines that need Horovod or DeepSpeed wait for scripts/test's background build of them
# (marker `late_build`): run before it ends they would be skipped, which fails CI's run.
@pytest.mark.e2e
@pytest.mark.torch
@pytest.mark.parametrize(
    "entrypoint,slots,needs",
    [pytest.param(*r[1:], id=r[0], marks=pytest.mark.late_build if r[3] else ()) for r in RUNS],
)
def test_seed_launcher_lines_run(det: Any, tmp_path: Path, entrypoint: str, slots: int, needs: str | None) -> None:
    pytest.importorskip("torch")
    if needs:
        pytest.importorskip(needs)
    ctx = legacy_context(tmp_path)
    cfg = write(tmp_path / "c.yaml", LEGACY_CFG.format(slots=slots, entrypoint=entrypoint))
    code, out, err = det("e", "create", "--local", cfg, ctx, "-f")
    assert code == 0, out + err
    code, logs, _ = det("t", "logs", "1")
    # Every rank built the trial, in one data-parallel group of `slots` (torch DDP when > 1).
    ddp = "true" if slots > 1 else "none"
    for r in range(slots):
        assert f"[rank={r}] trial rank {r}/{slots} ddp={ddp}" in logs, logs
    code, out, _ = det("e", "describe", "1", "--json")
    assert code == 0 and '"COMPLETED"' in out


def test_stand_in_dlprof_runs_the_rest(tmp_path: Path) -> None:
    import subprocess

    script = write(tmp_path / "dlprof", STAND_IN_DLPROF)
    script.chmod(0o755)
    r = subprocess.run(
        [str(script), "--mode=simple", sys.executable, "-c", "print('ran')"], capture_output=True, text=True
    )
    assert r.stdout == "ran\n" and os.access(script, os.X_OK)
