"""sbatch argument validation parses like sbatch's getopt_long (security review M3)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from detslurm.errors import ConfigError
from detslurm.expconf.load import check_sbatch_args
from detslurm.expconf.sbatch_args import BY_LONG, BY_SHORT, OPTIONS, Arg, Policy, SbatchArgError, resolve_long
from detslurm.slurm.site import load_site_config

BYPASSES = [
    (["--comm=x"], "--comm (--comment) is set by detslurm"),
    (["--outp=x"], "--outp (--output) is not configurable"),
    (["--sig=B:USR1@1"], "--sig (--signal) is set by detslurm"),
    (["--req"], "--req (--requeue) is set by detslurm"),
    (["--no-req"], "--no-req (--no-requeue) is set by detslurm"),
    (["--job-nam="], "--job-nam (--job-name) is set by detslurm"),
    (["--chd=/tmp"], "--chd (--chdir) is not configurable"),
    (["--parti=gpu"], "--parti (--partition) is not configurable"),
    (["--arr=1-5"], "--arr (--array) is set by detslurm"),
    (["--wra=id"], "--wra (--wrap) is set by detslurm"),
    # sbatch itself refuses --gre (it could also be --gres-flags); --gres= and --gres are refused for GPUs.
    (["--gre=gpu:8"], "--gre is ambiguous (it could mean --gres, --gres-flags)"),
    (["--gres=gpu:8"], "--gres may not be used to configure GPU resources"),
    (["--tres-per=gpu:1"], "--tres-per (--tres-per-task) may not be used to configure GPU resources"),
    (["--gres=shard:1,gpu:a100:2"], "--gres may not be used to configure GPU resources"),
    (["--tres-per-task=gres/gpu:1"], "--tres-per-task may not be used to configure GPU resources"),
    (["--gpus-per-node=8"], "--gpus-per-node is not configurable"),
    (["--gpus-per-task", "1"], "--gpus-per-task is not configurable"),
    (["--ntasks-per-gpu=1"], "--ntasks-per-gpu is not configurable"),
    (["--tasks-per-node=4"], "--tasks-per-node is not configurable"),
    (["-vJx"], "-J is set by detslurm"),
    (["-Jname"], "-J is set by detslurm"),
    (["-HN2"], "-N is not configurable"),
    (["-o", "out.log"], "-o is not configurable"),
    (["--export=NONE"], "--export is set by detslurm"),
    (["--exp=ALL"], "is ambiguous (it could mean --export, --export-file)"),
    (["--parsable"], "--parsable is set by detslurm"),
    (["--wait"], "--wait would stop detslurm"),
    (["-W"], "-W would stop detslurm"),
    (["-Q"], "-Q would stop detslurm"),
    (["--test-only"], "--test-only would stop detslurm"),
    (["-M", "other"], "-M would stop detslurm"),
    (["--help"], "--help would stop detslurm"),
    (["/path/other.sh"], "'/path/other.sh' is not an option"),
    (["--mem=4G", "/path/other.sh"], "'/path/other.sh' is not an option"),
    (["--", "--mem=4G"], "'--' is not an option"),
    (["--no-such-option"], "--no-such-option is not an sbatch option"),
    (["-y"], "-y is not an sbatch option"),
    (["--time"], "--time requires a value"),
    (["--exclusive=user", "--hold=1"], "--hold does not take a value"),
]


@pytest.mark.parametrize(("args", "why"), BYPASSES)
def test_every_bypass_is_refused(args: list[str], why: str) -> None:
    errors = check_sbatch_args(args, "<c>")
    assert errors, args
    assert any(why in e for e in errors), errors
    assert all(e.startswith("<c>[") for e in errors)


LEGIT = [
    ["--mem=4G"],
    ["--time=10"],
    ["--exclusive"],
    ["--exclusive=user"],
    ["--constraint=a100"],
    ["-t", "10"],
    ["-t10"],
    ["--mail-type=END"],
    ["--account=x"],
    ["--qos=y"],
    ["-A", "proj", "-q", "high"],
    ["--accou", "proj"],  # a unique prefix of --account
    ["--gres=shard:1"],
    ["--gres", "nvme:1"],
    ["--cpus-per-gpu=8", "--mem-per-gpu=40G"],
    ["-vH"],
    ["--nice"],
    ["--dependency", "afterok:12"],
    ["-k"],
    ["--mem", "--time"],  # getopt takes the next word as --mem's value, whatever it looks like
]


@pytest.mark.parametrize("args", LEGIT)
def test_legitimate_options_pass(args: list[str]) -> None:
    assert check_sbatch_args(args, "<c>") == []


def test_error_lines_keep_the_index_of_the_word() -> None:
    args = ["--partition", "gpu", "--comm=x", "a\nb", "-A", "p", "--gres", "gpu:1", "--mem-per", "4G", "-t1"]
    assert check_sbatch_args(args, "<config>.slurm.sbatch_args") == [
        "<config>.slurm.sbatch_args[0]: slurm option --partition is not configurable",
        "<config>.slurm.sbatch_args[2]: slurm option --comm (--comment) is set by detslurm and is not configurable",
        "<config>.slurm.sbatch_args[3]: control characters are not allowed in sbatch arguments",
        "<config>.slurm.sbatch_args[6]: slurm option --gres may not be used to configure GPU resources",
        "<config>.slurm.sbatch_args[8]: slurm option --mem-per is ambiguous (it could mean --mem-per-cpu, --mem-per-gpu)",
    ]
    # A control character in a value taken from the next word is reported at that word.
    assert check_sbatch_args(["--mem", "4G\n"], "<c>") == [
        "<c>[1]: control characters are not allowed in sbatch arguments"
    ]


def test_resolve_long_is_getopt_long() -> None:
    assert resolve_long("mem").long == "mem"  # an exact match wins over longer options
    assert resolve_long("mem-per-c").long == "mem-per-cpu"
    with pytest.raises(SbatchArgError, match="--mem-per-cpu, --mem-per-gpu"):
        resolve_long("mem-per")


def test_option_table_is_consistent() -> None:
    assert len(BY_LONG) == len(OPTIONS)
    assert len(BY_SHORT) == len([o for o in OPTIONS if o.short])
    # Every forbidden resource, identity or output option is in the table.
    for name in ("nodes", "ntasks", "partition", "output", "error", "input", "chdir", "requeue", "job-name"):
        assert BY_LONG[name].policy is not Policy.ALLOWED


def test_site_pool_extra_sbatch_args_are_validated(tmp_path: Path) -> None:
    site = tmp_path / "site.yaml"
    site.write_text(
        "default_pool: gpu\npools:\n  gpu:\n    partition: g\n    extra_sbatch_args: ['--mem=4G', '--parti=x', '-Jn']\n"
    )
    with pytest.raises(ConfigError) as e:
        load_site_config(site)
    assert e.value.errors == [
        "<site-config>.pools.gpu.extra_sbatch_args[1]: slurm option --parti (--partition) is not configurable",
        "<site-config>.pools.gpu.extra_sbatch_args[2]: slurm option -J is set by detslurm and is not configurable",
    ]


def _help_options(text: str) -> tuple[set[str], set[str]]:
    longs = set(re.findall(r"--([a-z][a-z0-9-]+)", text))
    shorts = set(re.findall(r"(?m)^\s+-([A-Za-z]),", text))
    return longs, shorts


@pytest.mark.skipif(shutil.which("sbatch") is None, reason="sbatch is not installed")
def test_table_covers_the_installed_sbatch() -> None:
    """Every option the installed ``sbatch --help`` lists is in our table with the same short form,
    so a new Slurm option is noticed (it is refused as unknown until it is added)."""
    out = subprocess.run(["sbatch", "--help"], capture_output=True, text=True, timeout=30)
    longs, shorts = _help_options(out.stdout + out.stderr)
    missing = sorted(n for n in longs if n not in BY_LONG)
    assert missing == [], f"sbatch options missing from detslurm/expconf/sbatch_args.py: {missing}"
    assert sorted(s for s in shorts if s not in BY_SHORT) == []
    for line in (out.stdout + out.stderr).splitlines():
        m = re.match(r"\s+-([A-Za-z]), --([a-z0-9-]+)", line)
        if m:
            assert BY_SHORT[m.group(1)].long == m.group(2), line


def test_help_parser_finds_options() -> None:
    """The parser used against the installed sbatch reads the help text's shape."""
    sample = (
        "Usage: sbatch [OPTIONS(0)...] [ : [OPTIONS(N)...]] script(0) [args(0)...]\n"
        "  -A, --account=name          charge job to specified account\n"
        "      --bb=<spec>             burst buffer specifications\n"
        "  -W, --wait                  wait for completion of submitted job\n"
    )
    assert _help_options(sample) == ({"account", "bb", "wait"}, {"A", "W"})
    assert BY_LONG["bb"].arg is Arg.REQUIRED
