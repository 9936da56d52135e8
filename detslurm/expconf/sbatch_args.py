"""Validate user- and site-supplied sbatch arguments the way sbatch itself parses them.

sbatch parses its command line with GNU ``getopt_long`` (with a leading ``+``: parsing stops at
the first non-option). That accepts unique prefixes of long options (``--comm=x`` is
``--comment=x``), clustered short options (``-vJx`` is ``-v -J x``), short options glued to
their value (``-Jname``) and a value in the next word (``--partition gpu``). A check that only
compares exact names is therefore easy to bypass (security review M3), so this module carries
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


R, N, O = Arg.REQUIRED, Arg.NONE, Arg.OPTIONAL
F, US, BR = Policy.FORBIDDEN, Policy.OURS, Policy.BREAKS

# sbatch's long options (Slurm 22.05 .. 24.11, including accepted aliases such as
# --tasks-per-node and --cluster, since getopt_long resolves prefixes against those too).
OPTIONS: tuple[Option, ...] = (
    Option("account", R, "A"),
    Option("acctg-freq", R),
    Option("array", R, "a", US),
    Option("batch", R),
    Option("bb", R),
    Option("bbf", R),
    Option("begin", R, "b"),
    Option("chdir", R, "D", F),
    Option("cluster", R, None, BR),
    Option("cluster-constraint", R),
    Option("clusters", R, "M", BR),
    Option("comment", R, None, US),
    Option("constraint", R, "C"),
    Option("container", R),
    Option("container-id", R),
    Option("contiguous", N),
    Option("core-spec", R, "S"),
    Option("cores-per-socket", R),
    Option("cpu-freq", R),
    Option("cpus-per-gpu", R),
    Option("cpus-per-task", R, "c"),
    Option("deadline", R),
    Option("delay-boot", R),
    Option("dependency", R, "d"),
    Option("distribution", R, "m"),
    Option("error", R, "e", F),
    Option("exclude", R, "x"),
    Option("exclusive", O),
    Option("export", R, None, US),
    Option("export-file", R, None, US),
    Option("extra", R),
    Option("extra-node-info", R, "B"),
    Option("get-user-env", O),
    Option("gid", R, None, BR),
    Option("gpu-bind", R),
    Option("gpu-freq", R),
    Option("gpus", R, "G", F),
    Option("gpus-per-node", R, None, F),
    Option("gpus-per-socket", R, None, F),
    Option("gpus-per-task", R, None, F),
    Option("gres", R),  # refused only when it asks for GPUs: see _gpu_gres
    Option("gres-flags", R),
    Option("help", N, "h", BR),
    Option("hint", R),
    Option("hold", N, "H"),
    Option("ignore-pbs", N),
    Option("input", R, "i", F),
    Option("job-name", R, "J", US),
    Option("kill-on-invalid-dep", R),
    Option("licenses", R, "L"),
    Option("mail-type", R),
    Option("mail-user", R),
    Option("mcs-label", R),
    Option("mem", R),
    Option("mem-bind", R),
    Option("mem-per-cpu", R),
    Option("mem-per-gpu", R),
    Option("mincpus", R),
    Option("network", R),
    Option("nice", O),
    Option("no-kill", O, "k"),
    Option("no-requeue", N, None, US),
    Option("nodefile", R, "F"),
    Option("nodelist", R, "w"),
    Option("nodes", R, "N", F),
    Option("ntasks", R, "n", F),
    Option("ntasks-per-core", R, None, F),
    Option("ntasks-per-gpu", R, None, F),
    Option("ntasks-per-node", R, None, F),
    Option("ntasks-per-socket", R, None, F),
    Option("oom-kill-step", O),
    Option("open-mode", R, None, US),
    Option("output", R, "o", F),
    Option("overcommit", N, "O"),
    Option("oversubscribe", N, "s"),
    Option("parsable", N, None, US),
    Option("partition", R, "p", F),
    Option("power", R),
    Option("prefer", R),
    Option("priority", R),
    Option("profile", R),
    Option("propagate", O),
    Option("qos", R, "q"),
    Option("quiet", N, "Q", BR),  # with --parsable, -Q suppresses the job id sbatch prints
    Option("reboot", N),
    Option("requeue", N, None, US),
    Option("reservation", R),
    Option("resv-ports", O),
    Option("signal", R, None, US),
    Option("sockets-per-node", R),
    Option("spread-job", N),
    Option("stepmgr", N),
    Option("switches", R),
    Option("tasks-per-node", R, None, F),  # an alias of --ntasks-per-node
    Option("test-only", N, None, BR),
    Option("thread-spec", R),
    Option("threads-per-core", R),
    Option("time", R, "t"),
    Option("time-min", R),
    Option("tmp", R),
    Option("tres-bind", R),
    Option("tres-per-task", R),  # refused only when it asks for GPUs: see _gpu_gres
    Option("uid", R, None, BR),
    Option("usage", N, "u", BR),
    Option("use-min-nodes", N),
    Option("verbose", N, "v"),
    Option("version", N, "V", BR),
    Option("wait", N, "W", BR),  # sbatch would block until the job ends: the submit times out
    Option("wait-all-nodes", R),
    Option("wckey", R),
    Option("wrap", R, None, US),
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
