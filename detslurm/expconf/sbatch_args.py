"""Validate user- and site-supplied sbatch arguments the way sbatch itself parses them.

sbatch parses its command line with GNU ``getopt_long`` (with a leading ``+``: parsing stops at
the first non-option). That accepts unique prefixes of long options (``--comm=x`` is
``--comment=x``), clustered short options (``-vJx`` is ``-v -J x``), short options glued to
their value (``-Jname``) and a value in the next word (``--partition gpu``). A check that only
compares exact names is therefore easy to bypass, so this module carries
sbatch's option table and resolves every word exactly as getopt_long would, then refuses the
options detslurm controls and any positional word (sbatch would run that file as the batch
script instead of the one detslurm pipes in).

The table covers Slurm 22.05 through 24.11. An option missing from it is refused as unknown,
which is the safe direction: a newer Slurm's option is rejected until it is added here.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class Arg(enum.Enum):
    """Whether an option takes a value (getopt's has_arg)."""

    NONE = "none"
    REQUIRED = "required"
    OPTIONAL = "optional"  # only in the same word: --opt=value or -kvalue


class Policy(enum.Enum):
    ALLOWED = "allowed"
    # Resources and placement detslurm computes from the experiment config and the site's pools.
    FORBIDDEN = "is not configurable"
    # Set by detslurm itself: trial identity (the comment), logs, the signal contract, requeueing.
    OURS = "is set by detslurm and is not configurable"
    # Would stop detslurm from submitting or tracking the job (no job id, another cluster, ...).
    BREAKS = "would stop detslurm from submitting or tracking the job and is not allowed"


@dataclass(frozen=True)
class Option:
    long: str
    arg: Arg
    short: str | None = None
    policy: Policy = Policy.ALLOWED


# Short names keep the table below one line per option.
REQ, NO, OPT = Arg.REQUIRED, Arg.NONE, Arg.OPTIONAL
FORB, OURS, BREAKS = Policy.FORBIDDEN, Policy.OURS, Policy.BREAKS

# sbatch's long options (Slurm 22.05 .. 24.11, including accepted aliases such as
# --tasks-per-node and --cluster, since getopt_long resolves prefixes against those too).
OPTIONS: tuple[Option, ...] = (
    Option("account", REQ, "A"),
    Option("acctg-freq", REQ),
    Option("array", REQ, "a", OURS),
    Option("batch", REQ),
    Option("bb", REQ),
    Option("bbf", REQ),
    Option("begin", REQ, "b"),
    Option("chdir", REQ, "D", FORB),
    Option("cluster", REQ, None, BREAKS),
    Option("cluster-constraint", REQ),
    Option("clusters", REQ, "M", BREAKS),
    Option("comment", REQ, None, OURS),
    Option("constraint", REQ, "C"),
    Option("container", REQ),
    Option("container-id", REQ),
    Option("contiguous", NO),
    Option("core-spec", REQ, "S"),
    Option("cores-per-socket", REQ),
    Option("cpu-freq", REQ),
    Option("cpus-per-gpu", REQ),
    Option("cpus-per-task", REQ, "c"),
    Option("deadline", REQ),
    Option("delay-boot", REQ),
    Option("dependency", REQ, "d"),
    Option("distribution", REQ, "m"),
    Option("error", REQ, "e", FORB),
    Option("exclude", REQ, "x"),
    Option("exclusive", OPT),
    Option("export", REQ, None, OURS),
    Option("export-file", REQ, None, OURS),
    Option("extra", REQ),
    Option("extra-node-info", REQ, "B"),
    Option("get-user-env", OPT),
    Option("gid", REQ, None, BREAKS),
    Option("gpu-bind", REQ),
    Option("gpu-freq", REQ),
    Option("gpus", REQ, "G", FORB),
    Option("gpus-per-node", REQ, None, FORB),
    Option("gpus-per-socket", REQ, None, FORB),
    Option("gpus-per-task", REQ, None, FORB),
    Option("gres", REQ),  # refused only when it asks for GPUs: see _gpu_gres
    Option("gres-flags", REQ),
    Option("help", NO, "h", BREAKS),
    Option("hint", REQ),
    Option("hold", NO, "H"),
    Option("ignore-pbs", NO),
    Option("input", REQ, "i", FORB),
    Option("job-name", REQ, "J", OURS),
    Option("kill-on-invalid-dep", REQ),
    Option("licenses", REQ, "L"),
    Option("mail-type", REQ),
    Option("mail-user", REQ),
    Option("mcs-label", REQ),
    Option("mem", REQ),
    Option("mem-bind", REQ),
    Option("mem-per-cpu", REQ),
    Option("mem-per-gpu", REQ),
    Option("mincpus", REQ),
    Option("network", REQ),
    Option("nice", OPT),
    Option("no-kill", OPT, "k"),
    Option("no-requeue", NO, None, OURS),
    Option("nodefile", REQ, "F"),
    Option("nodelist", REQ, "w"),
    Option("nodes", REQ, "N", FORB),
    Option("ntasks", REQ, "n", FORB),
    Option("ntasks-per-core", REQ, None, FORB),
    Option("ntasks-per-gpu", REQ, None, FORB),
    Option("ntasks-per-node", REQ, None, FORB),
    Option("ntasks-per-socket", REQ, None, FORB),
    Option("oom-kill-step", OPT),
    Option("open-mode", REQ, None, OURS),
    Option("output", REQ, "o", FORB),
    Option("overcommit", NO, "O"),
    Option("oversubscribe", NO, "s"),
    Option("parsable", NO, None, OURS),
    Option("partition", REQ, "p", FORB),
    Option("power", REQ),
    Option("prefer", REQ),
    Option("priority", REQ),
    Option("profile", REQ),
    Option("propagate", OPT),
    Option("qos", REQ, "q"),
    Option("quiet", NO, "Q", BREAKS),  # with --parsable, -Q suppresses the job id sbatch prints
    Option("reboot", NO),
    Option("requeue", NO, None, OURS),
    Option("reservation", REQ),
    Option("resv-ports", OPT),
    Option("signal", REQ, None, OURS),
    Option("sockets-per-node", REQ),
    Option("spread-job", NO),
    Option("stepmgr", NO),
    Option("switches", REQ),
    Option("tasks-per-node", REQ, None, FORB),  # an alias of --ntasks-per-node
    Option("test-only", NO, None, BREAKS),
    Option("thread-spec", REQ),
    Option("threads-per-core", REQ),
    Option("time", REQ, "t"),
    Option("time-min", REQ),
    Option("tmp", REQ),
    Option("tres-bind", REQ),
    Option("tres-per-task", REQ),  # refused only when it asks for GPUs: see _gpu_gres
    Option("uid", REQ, None, BREAKS),
    Option("usage", NO, "u", BREAKS),
    Option("use-min-nodes", NO),
    Option("verbose", NO, "v"),
    Option("version", NO, "V", BREAKS),
    Option("wait", NO, "W", BREAKS),  # sbatch would block until the job ends: the submit times out
    Option("wait-all-nodes", REQ),
    Option("wckey", REQ),
    Option("wrap", REQ, None, OURS),
)
BY_LONG = {o.long: o for o in OPTIONS}
BY_SHORT = {o.short: o for o in OPTIONS if o.short}
# Options whose value may request GPUs, which detslurm allocates itself (--gres=gpu:N from the pool).
_GRES_LIKE = {"gres", "tres-per-task"}


class SbatchArgError(ValueError):
    """One word of an sbatch argument list that cannot be accepted."""


def resolve_long(name: str) -> Option:
    """The option ``--name`` means to getopt_long: an exact match, else the one option that
    ``name`` is a prefix of. Raises SbatchArgError for unknown or ambiguous names."""
    exact = BY_LONG.get(name)
    if not name:  # "--=value": a prefix of every option
        raise SbatchArgError("'--' followed by '=' is not an sbatch option")
    if exact is not None:
        return exact
    matches = [o for o in OPTIONS if o.long.startswith(name)]
    if not matches:
        raise SbatchArgError(f"--{name} is not an sbatch option")
    if len(matches) > 1:
        names = ", ".join(f"--{o.long}" for o in matches)
        raise SbatchArgError(f"slurm option --{name} is ambiguous (it could mean {names})")
    return matches[0]


@dataclass(frozen=True)
class Parsed:
    """One option as sbatch would see it: ``index`` is the word it starts at."""

    index: int
    written: str  # as the user wrote it: --comm, -J
    option: Option
    value: str | None


def _gpu_gres(value: str) -> bool:
    """Whether a --gres/--tres-per-task value asks for GPUs (``gpu:2``, ``gres/gpu:a100:1``, ``shard:1,gpu``)."""
    for item in value.split(","):
        name = item.strip().lower().removeprefix("gres/").removeprefix("gres:").split(":", 1)[0]
        if name.split("=", 1)[0] == "gpu":
            return True
    return False


def _check(p: Parsed) -> str | None:
    """Why this option is refused, or None."""
    opt = p.option
    shown = p.written if p.written in (f"--{opt.long}", f"-{opt.short}") else f"{p.written} (--{opt.long})"
    if opt.policy is not Policy.ALLOWED:
        return f"slurm option {shown} {opt.policy.value}"
    if opt.long in _GRES_LIKE and p.value is not None and _gpu_gres(p.value):
        return f"slurm option {shown} may not be used to configure GPU resources"
    return None


def _parse_short(args: Sequence[str], i: int) -> tuple[list[Parsed], int]:
    """A cluster of short options at ``args[i]`` (``-vJx``, ``-t10``, ``-t 10``)."""
    word, found, j = args[i], [], 1
    while j < len(word):
        opt = BY_SHORT.get(word[j])
        if opt is None:
            raise SbatchArgError(f"-{word[j]} is not an sbatch option")
        rest = word[j + 1 :]
        if opt.arg is Arg.NONE:
            found.append(Parsed(i, f"-{word[j]}", opt, None))
            j += 1
            continue
        if rest or opt.arg is Arg.OPTIONAL:
            found.append(Parsed(i, f"-{word[j]}", opt, rest or None))
            return found, i + 1
        if i + 1 >= len(args):
            raise SbatchArgError(f"slurm option -{word[j]} requires a value")
        found.append(Parsed(i, f"-{word[j]}", opt, args[i + 1]))
        return found, i + 2
    return found, i + 1


def _parse_long(args: Sequence[str], i: int) -> tuple[Parsed, int]:
    name, eq, value = args[i][2:].partition("=")
    opt = resolve_long(name)
    written = f"--{name}"
    if opt.arg is Arg.NONE and eq:
        raise SbatchArgError(f"slurm option {written} does not take a value")
    if eq or opt.arg is not Arg.REQUIRED:
        return Parsed(i, written, opt, value if eq else None), i + 1
    if i + 1 >= len(args):  # getopt takes the next word as the value, whatever it looks like
        raise SbatchArgError(f"slurm option {written} requires a value")
    return Parsed(i, written, opt, args[i + 1]), i + 2


def parse_sbatch_args(args: Sequence[str]) -> list[Parsed]:
    """The options in ``args`` as sbatch's getopt_long reads them, allowed or not. Raises
    SbatchArgError at the first word sbatch would refuse or take as the batch script."""
    found: list[Parsed] = []
    i = 0
    while i < len(args):
        word = args[i]
        if word == "--" or not word.startswith("-") or word == "-":
            raise SbatchArgError(f"{word!r} is not an option")
        if word.startswith("--"):
            parsed, i = _parse_long(args, i)
            found.append(parsed)
        else:
            cluster, i = _parse_short(args, i)
            found += cluster
    return found


def check_sbatch_args(args: Sequence[str], prefix: str) -> list[str]:
    """Every problem with ``args`` as extra sbatch arguments, one line each: ``<prefix>[i]: why``.

    Used for an experiment's ``slurm.sbatch_args`` and a site pool's ``extra_sbatch_args``.
    """
    errors: list[tuple[int, str]] = []
    # A word with a control character is reported on its own, also when it is an option's value.
    bad = {i for i, word in enumerate(args) if any(ch in word for ch in "\n\r\0")}
    errors += [(i, "control characters are not allowed in sbatch arguments") for i in sorted(bad)]
    i = 0
    while i < len(args):
        word = args[i]
        if i in bad:
            i += 1
            continue
        if word == "--" or not word.startswith("-") or word == "-":
            # sbatch stops parsing at the first positional word and runs it as the batch script.
            why = "sbatch would take it (and every word after it) as the batch script instead of detslurm's"
            errors.append((i, f"{word!r} is not an option; {why}"))
            break
        try:
            if word.startswith("--"):
                parsed, nxt = _parse_long(args, i)
                found = [parsed]
            else:
                found, nxt = _parse_short(args, i)
        except SbatchArgError as e:
            errors.append((i, str(e)))
            # The option's arity is unknown: skip the words that look like its value.
            i += 1
            while i < len(args) and not args[i].startswith("-"):
                i += 1
            continue
        errors += [(i, why) for why in map(_check, found) if why]
        i = nxt
    return [f"{prefix}[{i}]: {why}" for i, why in sorted(errors, key=lambda e: e[0])]
