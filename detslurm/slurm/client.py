"""The one module that talks to Slurm (docs/design/architecture.md, rule 6).

Every call goes through :class:`SlurmClient` with a timeout and returns typed results; the
command runner is injected so unit tests can pass a fake that behaves like the real commands.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Optional, Protocol

from detslurm import settings
from detslurm.errors import DetSlurmError
from detslurm.identity import os_user
from detslurm.jobenv import daemon_env
from detslurm.slurm import parse
from detslurm.slurm.allocation import Allocation, parse_allocation
from detslurm.slurm.parse import Capabilities, PartitionNodes, QueuedJob
from detslurm.slurm.partitions import ASSOC_FIELDS, AssocLimit, PartitionInfo, parse_assoc_limits, parse_partitions

DEFAULT_TIMEOUT_S = settings.SLURM_TIMEOUT_S.default


# What Slurm's commands print when slurmctld is down or restarting (not a problem of the job).
_UNREACHABLE = (
    "Unable to contact slurm controller",
    "Socket timed out",
    "Connection refused",
    "Zero Bytes were transmitted or received",
    "Slurm backup controller in standby mode",
    # Per-user RPC rate limiting (23.02+, SlurmctldParameters=rl_enable) that outlasted our
    # retries: slurmctld is answering, just not to us yet; the next tick tries again.
    "Rate limit exceeded",
)

# What slurmctld's rate limiter makes a client print (SLURMCTLD_COMMUNICATIONS_BACKOFF is
# "Rate limit exceeded, please retry momentarily"; its give-up form ends "retry later"). The
# 23.02+ commands themselves sleep a second and resend while slurmctld says "back off", so
# usually we only see a slower command; the text appears where a client gives up.
_RATE_LIMITED = "Rate limit exceeded"
# slurmctld's EAGAIN: it declined the request without acting on it. 24.11 answers an
# `scontrol update` of a pending job so when it comes right after a release (seen on the test
# cluster in about half the runs of test_queue_as_root; 22.05 never did); sbatch prints it when
# its own resends ran out. Like rate limiting, the request is safe to resend.
_TRY_AGAIN = "Resource temporarily unavailable"
_RESENDABLE = (_RATE_LIMITED, _TRY_AGAIN)


# What Slurm's commands print on a machine where no cluster is configured (no slurm.conf and no
# configless DNS record; a config file named by SLURM_CONF that does not exist): no slurmctld to
# ask at all, as opposed to one that is down.
_NOT_CONFIGURED = ("Could not establish a configuration source", "Unable to process configuration file")


class SlurmCommandError(DetSlurmError):
    def __init__(self, argv: Sequence[str], returncode: int, stderr: str) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr.strip()
        if self.not_configured:
            # Slurm's own lines here are DNS SRV errors that send a newcomer the wrong way.
            fatal = self.stderr.splitlines()[-1].split("fatal: ")[-1]
            super().__init__(
                f"no Slurm cluster is configured on this machine ({argv[0]}: {fatal}); "
                "run this on a Slurm login node, or use local mode: det e create --local CONFIG DIR"
            )
            return
        super().__init__(f"{argv[0]} failed (exit {returncode}): {self.stderr or 'no message'}")

    @property
    def unreachable(self) -> bool:
        """slurmctld did not answer (down, restarting, overloaded): try again later."""
        return self.returncode == 124 or any(m in self.stderr for m in _UNREACHABLE)

    @property
    def not_configured(self) -> bool:
        """No Slurm cluster is configured on this machine (local mode on a laptop)."""
        return any(m in self.stderr for m in _NOT_CONFIGURED)

    @property
    def rate_limited(self) -> bool:
        """slurmctld refused the RPC before doing anything (rate limiting): safe to resend."""
        return _RATE_LIMITED in self.stderr

    @property
    def reply_lost(self) -> bool:
        """The request may have reached slurmctld, but its answer never came back (our own
        timeout, or Slurm's socket timeout). For sbatch this means the job may exist: a busy
        slurmctld often accepts a job and then times out the reply."""
        return self.returncode == 124 or "Socket timed out" in self.stderr


class SlurmUnavailable(DetSlurmError):
    pass


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str
    stderr: str


class Runner(Protocol):
    def __call__(
        self,
        argv: Sequence[str],
        *,
        input: Optional[str] = None,
        timeout: float,
        env: Optional[Mapping[str, str]] = None,
    ) -> Result: ...


def subprocess_runner(
    argv: Sequence[str], *, input: Optional[str] = None, timeout: float, env: Optional[Mapping[str, str]] = None
) -> Result:
    try:
        p = subprocess.run(
            list(argv), input=input, capture_output=True, text=True, timeout=timeout, check=False, env=env
        )
    except FileNotFoundError:
        raise SlurmUnavailable(
            f"{argv[0]} not found: is this a Slurm login node (or is the test cluster up)?"
        ) from None
    except subprocess.TimeoutExpired as e:
        # What it printed before we gave up says why (sbatch retrying a full job queue, say).
        said = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        msg = f"timed out after {timeout:.0f} s (is slurmctld responding?)"
        raise SlurmCommandError(argv, 124, f"{said.strip()}\n{msg}" if said.strip() else msg) from None
    return Result(p.returncode, p.stdout, p.stderr)


class SlurmClient:
    def __init__(
        self,
        runner: Runner = subprocess_runner,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        user: Optional[str] = None,
        *,
        retry_budget_s: Optional[float] = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._run_cmd = runner
        self.timeout_s = timeout_s
        # The OS's name for our uid: `squeue -u` must list this process's jobs, whatever $USER says.
        self.user = user or os_user()
        self._caps: Optional[Capabilities] = None
        self.calls = 0  # commands issued by this client (benchmarks count controller load)
        # How long one call may spend waiting out rate limiting (sleeps between resends); past
        # it the error is raised, and callers treat it like an unreachable slurmctld.
        self.retry_budget_s = timeout_s if retry_budget_s is None else retry_budget_s
        self._sleep = sleep  # a seam: tests count the back-off instead of waiting it out
        self.rate_limited_calls = 0  # resends caused by rate limiting (benchmarks, doctor)
        self._nodes_argv: Optional[list[str]] = None

    def _run(
        self,
        argv: Sequence[str],
        input: Optional[str] = None,
        check: bool = True,
        env: Optional[Mapping[str, str]] = None,
    ) -> Result:
        """Run one command; one slurmctld declined without acting on it (rate limiting, EAGAIN)
        is resent after 1, 2, 4 ... s within the budget."""
        waited, delay = 0.0, 1.0
        while True:
            self.calls += 1
            res = self._run_cmd(argv, input=input, timeout=self.timeout_s, env=env)
            said = res.stderr or res.stdout
            if res.returncode == 0 or not any(m in said for m in _RESENDABLE):
                break
            if waited + delay > self.retry_budget_s:
                break
            # slurmctld rejected the RPC before acting on it, so even sbatch is safe to resend.
            if _RATE_LIMITED in said:
                self.rate_limited_calls += 1
            self._sleep(delay)
            waited += delay
            delay = min(delay * 2, 8.0)
        if check and res.returncode != 0:
            raise SlurmCommandError(argv, res.returncode, res.stderr or res.stdout)
        return res

    # -- submission ------------------------------------------------------------------------
    def sbatch(self, args: Sequence[str], script: str) -> str:
        """Submit ``script`` (given on stdin: nothing is written that a user could swap)."""
        # sbatch hands its whole environment to the job (--export=ALL): never that of an
        # allocation `det` happens to run in (SLURM_*, SBATCH_*, its TMPDIR).
        res = self._run(["sbatch", "--parsable", *args], input=script, env=daemon_env(os.environ).env)
        return parse.parse_sbatch(res.stdout)

    def sbatch_test_only(self, args: Sequence[str], script: str) -> Optional[str]:
        """Ask slurmctld whether it would take this job, without queueing it (``sbatch
        --test-only``): None if it would, else sbatch's own message. Raises SlurmCommandError
        when slurmctld does not answer (that says nothing about the job)."""
        res = self._run(["sbatch", "--test-only", *args], input=script, check=False, env=daemon_env(os.environ).env)
        if res.returncode == 0:
            return None
        message = "\n".join(line for line in (res.stderr + res.stdout).splitlines() if line.strip())
        err = SlurmCommandError(["sbatch", "--test-only"], res.returncode, message)
        if err.unreachable:
            raise err
        # sbatch prints its usage text after an option error: its first lines are the message.
        return "; ".join(message.splitlines()[:3]) or f"sbatch --test-only failed (exit {res.returncode})"

    def start_step(self, script: str, log: IO[bytes], cwd: str) -> subprocess.Popen[bytes]:
        """Run ``script``, whose srun line starts a job step of a job this user holds
        (controller/step_executor.py), as a process of its own session that outlives this one.
        Slurm checks that the job is ours before it creates the step. The script is given on
        stdin and read whole before it runs: its exports never show on a command line."""
        proc = subprocess.Popen(
            ["bash", "-c", 'eval "$(cat)"'],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            # Like sbatch's jobs: nothing of an allocation this process may run in (SLURM_JOB_ID
            # would make srun start the step there, whatever --jobid says).
            env=daemon_env(os.environ).env,
            start_new_session=True,
            close_fds=True,
        )
        assert proc.stdin is not None
        self.calls += 1
        with proc.stdin:
            proc.stdin.write(script.encode())
        return proc

    # -- queries ---------------------------------------------------------------------------
    def squeue(self, all_users: bool = False) -> list[QueuedJob]:
        """One call for every job of this user (or all users): the only per-tick query."""
        # --states=all: finished jobs stay visible for MinJobAge, which is how we learn that a
        # job was PREEMPTED, hit its TIMEOUT or lost its node (without slurmdbd there is no sacct).
        argv = ["squeue", "-h", "-r", "--states=all", "-O", parse.SQUEUE_FORMAT]
        if not all_users:
            argv += ["-u", self.user]
        return parse.parse_squeue(self._run(argv).stdout)

    def sacct(self, job_ids: Sequence[str]) -> dict[str, parse.AccountedJob]:
        """Final states of jobs that left squeue (MinJobAge passed): one call for all of them.
        Only where accounting exists (slurmdbd); callers check capabilities().accounting."""
        if not job_ids:
            return {}
        argv = ["sacct", "-n", "-P", "-X", "-o", parse.SACCT_FIELDS, "-j", ",".join(job_ids)]
        return parse.parse_sacct(self._run(argv).stdout)

    def show_job(self, job_id: str) -> dict[str, str]:
        res = self._run(["scontrol", "show", "job", "-o", job_id], check=False)
        if res.returncode != 0:
            return {}
        return parse.parse_key_values(res.stdout.splitlines()[0] if res.stdout else "")

    def allocation(self, job_id: str, gres_name: str = "gpu") -> Optional[Allocation]:
        """A job this user holds, as a place for job steps: its state, end and nodes (one
        ``scontrol -d show job``); None once Slurm no longer knows the job."""
        res = self._run(["scontrol", "-d", "show", "job", job_id], check=False)
        if res.returncode != 0:
            if "Invalid job id" in res.stderr:
                return None
            raise SlurmCommandError(["scontrol", "show", "job"], res.returncode, res.stderr or res.stdout)
        return parse_allocation(job_id, res.stdout, gres_name)

    def sinfo(self) -> list[PartitionNodes]:
        return parse.parse_sinfo(self._run(["sinfo", "-h", "-o", parse.SINFO_FORMAT]).stdout)

    def nodes(self) -> list[parse.NodeInfo]:
        """Every node's partitions, state, CPUs and GPUs in use. The first call probes which
        command lists nodes one by one on this Slurm (see parse.json_lists_nodes)."""
        if self._nodes_argv is None:
            out = self._run(["sinfo", "--json"]).stdout
            if parse.json_lists_nodes(out):
                self._nodes_argv = ["sinfo", "--json"]
                return parse.parse_sinfo_json(out)
            self._nodes_argv = ["scontrol", "show", "nodes", "--json"]
        return parse.parse_sinfo_json(self._run(self._nodes_argv).stdout)

    def partitions(self) -> list[PartitionInfo]:
        """Every partition's limits (one RPC), for refusing what can never run."""
        return parse_partitions(self._run(["scontrol", "show", "partition", "-o"]).stdout)

    def assoc_limits(self) -> list[AssocLimit]:
        """This user's associations and their job limits (MaxSubmitJobs, MaxJobs). Only where
        accounting exists (slurmdbd); callers check capabilities().accounting."""
        argv = ["sacctmgr", "-n", "-P", "show", "assoc", f"user={self.user}", f"format={ASSOC_FIELDS}"]
        return parse_assoc_limits(self._run(argv).stdout)

    def capabilities(self, fresh: bool = False) -> Capabilities:
        """``scontrol show config``, read once per client; ``fresh`` reads it again (limits an
        admin may have raised since, ``SlurmExecutor.capacity``)."""
        if self._caps is None or fresh:
            self._caps = parse.parse_config(self._run(["scontrol", "show", "config"]).stdout)
        return self._caps

    def may_raise_priority(self) -> bool:
        """Whether Slurm takes a negative nice (a raised priority) from us: root, or the
        SlurmUser slurmctld runs as. Operators and admins listed in slurm.conf may too, but a
        user cannot see that list; they get nice 0, the best any user may ask for."""
        if os.geteuid() == 0:
            return True
        try:
            return self.user == self.capabilities().slurm_user
        except (SlurmCommandError, SlurmUnavailable):
            return False

    # -- control ---------------------------------------------------------------------------
    def scancel(
        self,
        job_id: str | Sequence[str],
        signal: Optional[str] = None,
        batch_too: bool = False,
        pending_only: bool = False,
    ) -> None:
        """One call for one job or many (scancel takes a list: an experiment's 256 array tasks
        are one RPC round, not 256). ``pending_only``: slurmctld skips jobs that have started,
        so a job that began since our last look is never killed by mistake."""
        argv = ["scancel", *(["--state=PENDING"] if pending_only else [])]
        if signal:
            argv += [f"--signal={signal}"]
            if batch_too:
                argv += ["--full"]
        self._run([*argv, *([job_id] if isinstance(job_id, str) else job_id)])

    def update(self, job_id: str | Sequence[str], **fields: str) -> None:
        """scontrol update of one job, or of many in one call (JobId takes a comma list)."""
        ids = job_id if isinstance(job_id, str) else ",".join(job_id)
        self._run(["scontrol", "update", f"JobId={ids}", *(f"{k}={v}" for k, v in fields.items())])

    def hold(self, job_id: str) -> None:
        self._run(["scontrol", "hold", job_id])

    def release(self, job_id: str) -> None:
        self._run(["scontrol", "release", job_id])

    def requeue(self, job_id: str) -> None:
        self._run(["scontrol", "requeue", job_id])

    def top(self, job_id: str) -> None:
        self._run(["scontrol", "top", job_id])


def client_from_env(runner: Runner = subprocess_runner) -> SlurmClient:
    return SlurmClient(runner, timeout_s=settings.SLURM_TIMEOUT_S.get())
