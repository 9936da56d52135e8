"""sbatch argument validation parses like sbatch's getopt_long (docs/design/security.md)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from detslurm.errors import ConfigError
from detslurm.expconf.load import check_sbatch_args
from detslurm.expconf.sbatch_args import (
    BY_LONG,
    BY_SHORT,
    OPTIONS,
    Arg,
    Policy,
    SbatchArgError,
    parse_sbatch_args,
    resolve_long,
)
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
    (["--=x"], "'--' followed by '=' is not an sbatch option"),
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
    ["--mail-user", "-J@example.org"],  # getopt takes the next word as the value, whatever it looks like
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


def _check_against(text: str) -> None:
    longs, shorts = _help_options(text)
    missing = sorted(n for n in longs if n not in BY_LONG)
    assert missing == [], f"sbatch options missing from detslurm/expconf/sbatch_args.py: {missing}"
    assert sorted(s for s in shorts if s not in BY_SHORT) == []
    for line in text.splitlines():
        m = re.match(r"\s+-([A-Za-z]), --([a-z0-9-]+)", line)
        if m:
            assert BY_SHORT[m.group(1)].long == m.group(2), line


@pytest.mark.skipif(shutil.which("sbatch") is None, reason="sbatch is not installed")
def test_table_covers_the_installed_sbatch(tmp_path: Path) -> None:
    """Every option the installed ``sbatch --help`` lists is in our table with the same short form,
    so a new Slurm option is noticed (it is refused as unknown until it is added)."""
    # sbatch reads a slurm.conf before it prints its help; any syntactically valid one will do.
    conf = tmp_path / "slurm.conf"
    conf.write_text(
        "ClusterName=x\nSlurmctldHost=localhost\nNodeName=localhost CPUs=1\nPartitionName=p Nodes=localhost\n"
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    out = subprocess.run(["sbatch", "--help"], capture_output=True, text=True, timeout=600, env=env)
    assert "--account" in out.stdout, out.stderr
    _check_against(out.stdout)


@pytest.mark.skipif(shutil.which("sbatch") is None or shutil.which("man") is None, reason="no sbatch man page")
def test_table_covers_the_installed_man_page() -> None:
    """The man page also lists the options ``--help`` leaves out."""
    out = subprocess.run(
        ["man", "sbatch"], capture_output=True, text=True, timeout=600, env={**os.environ, "MANWIDTH": "200"}
    )
    if out.returncode != 0 or "--account" not in out.stdout:
        pytest.skip("the sbatch man page is not installed")
    options = "\n".join(re.findall(r"(?m)^ {7}(?:-[A-Za-z], )?--[a-z][a-z0-9-]+.*$", out.stdout))
    assert len(options.splitlines()) > 80
    _check_against(options)


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


def _sbatch_view(args: list[str], conf: Path) -> tuple[set[str], str]:
    """The options the installed sbatch parsed from ``args`` (its ``-v`` dump, printed before it
    contacts a controller), and its error output. The submission itself is never attempted."""
    env = {**os.environ, "SLURM_CONF": str(conf)}
    proc = subprocess.Popen(
        ["sbatch", "-v", "--wrap=true", *args], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env
    )
    assert proc.stderr is not None
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if "end of defined options" in line:
                break
    finally:
        proc.kill()
        proc.wait()
    names = {m.group(1) for line in lines if (m := re.match(r"sbatch: ([a-z][a-z0-9-]*)\s+: ", line))}
    return names - {"verbose", "wrap"}, "".join(lines)


# Options of Slurm releases newer than the installed 22.05, and ones that end sbatch before its
# dump (help) or conflict with the -v that asks for it (quiet).
_NOT_COMPARABLE = {"tres-per-task", "tres-bind", "extra", "container-id", "oom-kill-step", "stepmgr", "help", "quiet"}
_ALIASES = {"tasks-per-node": "ntasks-per-node"}  # sbatch's dump names the option an alias stands for


def _comparable(args: list[str]) -> bool:
    try:
        return not _NOT_COMPARABLE & {p.option.long for p in parse_sbatch_args(args)}
    except SbatchArgError:
        return False  # unparseable: test_sbatch_refuses_what_we_cannot_parse


COMPARABLE = [a for a in LEGIT + [a for a, _ in BYPASSES] if _comparable(a)]


@pytest.mark.skipif(shutil.which("sbatch") is None, reason="sbatch is not installed")
@pytest.mark.parametrize("args", COMPARABLE)
def test_sbatch_resolves_options_as_we_do(tmp_path: Path, args: list[str]) -> None:
    """The installed sbatch reads each list as the same options our parser does, prefixes and
    clusters included (so what we refuse is what sbatch would have applied)."""
    conf = tmp_path / "slurm.conf"
    # Port 1: nothing listens there, should sbatch ever get as far as submitting.
    conf.write_text("ClusterName=x\nSlurmctldHost=localhost\nSlurmctldPort=1\nNodeName=localhost CPUs=1\n")
    theirs, log = _sbatch_view(args, conf)
    ours = {_ALIASES.get(p.option.long, p.option.long) for p in parse_sbatch_args(args)} - {"verbose", "wrap"}
    assert theirs == ours, log


@pytest.mark.skipif(shutil.which("sbatch") is None, reason="sbatch is not installed")
@pytest.mark.parametrize(
    ("args", "theirs"),
    [
        (["--gre=gpu:8"], "is ambiguous"),
        (["--exp=ALL"], "is ambiguous"),
        (["--no-such-option"], "unrecognized option"),
        (["-y"], "invalid option"),
        (["--hold=1"], "doesn't allow an argument"),
        (["--time"], "requires an argument"),
    ],
)
def test_sbatch_refuses_what_we_cannot_parse(tmp_path: Path, args: list[str], theirs: str) -> None:
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=x\nSlurmctldHost=localhost\nSlurmctldPort=1\nNodeName=localhost CPUs=1\n")
    _, log = _sbatch_view(args, conf)
    assert theirs in log
    with pytest.raises(SbatchArgError):
        parse_sbatch_args(args)


_EXITS_EARLY = {"help", "usage", "version", "quiet"}  # print and exit, or conflict with -v


@pytest.mark.skipif(shutil.which("sbatch") is None, reason="sbatch is not installed")
def test_table_arity_matches_the_installed_sbatch(tmp_path: Path) -> None:
    """For every option the installed sbatch knows: it requires a value exactly when our table
    says so, and a short option without a value leaves the rest of its cluster to be options."""
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=x\nSlurmctldHost=localhost\nSlurmctldPort=1\nNodeName=localhost CPUs=1\n")
    wrong = []
    for opt in OPTIONS:
        if opt.long in _EXITS_EARLY | _NOT_COMPARABLE:
            continue
        _, log = _sbatch_view([f"--{opt.long}"], conf)
        if "unrecognized option" in log:
            continue  # an option of a newer Slurm, or an alias this one lacks
        if ("requires an argument" in log) != (opt.arg is Arg.REQUIRED):
            wrong.append(f"--{opt.long}: {log.strip().splitlines()[0]}")
        if opt.short:
            # -XJzz: J is an option of its own only when X takes no value (for -J: -JH and hold).
            probe, name = ("Jzz", "job-name") if opt.short != "J" else ("H", "hold")
            names, log = _sbatch_view([f"-{opt.short}{probe}"], conf)
            if (name in names) != (opt.arg is Arg.NONE):
                wrong.append(f"-{opt.short}{probe}: {log.strip().splitlines()[:2]}")
    assert wrong == []
