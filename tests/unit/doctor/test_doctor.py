"""The site doctor's pure parts: checks over facts captured from the real 22.05 test cluster,
the probe's script and report (run here, without Slurm), and the wait loop against a fake Slurm."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Optional

import pytest
from fake_runner import FakeRunner

from detslurm.doctor import checks, node_checks, probe, starter
from detslurm.doctor.facts import SiteFacts, StoreFacts, store_facts
from detslurm.doctor.findings import Finding, Status, report_json, worst
from detslurm.doctor.report import ReportError, parse_report
from detslurm.doctor.run import probe_pools
from detslurm.exec import node_probe
from detslurm.slurm.client import Result, SlurmClient
from detslurm.slurm.parse import REC_END, SEP, SQUEUE_FIELDS, parse_config, parse_sinfo
from detslurm.slurm.partitions import AssocLimit, parse_assoc_limits, parse_partitions
from detslurm.slurm.site import Pool, SiteConfig, load_site_config

ROOT = Path(__file__).resolve().parents[3]
DATA = Path(__file__).parents[2] / "data" / "slurm-22.05"
TEST_SITE = ROOT / "site-configs" / "test-cluster.yaml"


def facts(site: Optional[SiteConfig] = None, site_path: Optional[Path] = TEST_SITE, **changes: object) -> SiteFacts:
    """SiteFacts as the doctor gathers them from the captured 22.05 output."""
    f = SiteFacts(
        caps=parse_config((DATA / "show-config.txt").read_text()),
        partitions=parse_partitions((DATA / "show-partition.txt").read_text()),
        sinfo=parse_sinfo((DATA / "sinfo.txt").read_text()),
        site=site if site is not None else load_site_config(TEST_SITE),
        site_path=site_path,
        experiments_dir=Path("/shared/exps"),
        checkpoint_dir=Path("/shared/ckpts"),
        user_poll_interval_s=0.5,
    )
    return dataclasses.replace(f, **changes)  # type: ignore[arg-type]


def by_subject(findings: Sequence[Finding]) -> dict[str, Finding]:
    return {f.subject: f for f in findings}


# -- site checks ----------------------------------------------------------------------------


def test_site_findings_of_the_22_05_test_cluster() -> None:
    found = by_subject(checks.site_findings(facts()))
    assert found["slurm"].status is Status.OK and "Slurm 22.05.8, cluster detslurm" in found["slurm"].detail
    assert found["plugins"].status is Status.WARNING and "proctrack/linuxproc" in found["plugins"].action
    assert "select/cons_tres (CR_CORE)" in found["plugins"].detail
    assert found["accounting"].status is Status.WARNING and "MinJobAge (300 s)" in found["accounting"].detail
    pre = found["preemption"]
    # KillWait 5 s and no GraceTime: a preempted trial has 5 s to checkpoint.
    assert pre.status is Status.WARNING and "KillWait 5 s, GraceTime cpu 0 s, gpu 0 s, high 0 s" in pre.detail
    assert "signal USR2 60 s before the time limit" in pre.detail and "5 s before SIGKILL" in pre.action
    assert found["job limits"].detail == (
        "MaxArraySize 1001, MaxJobCount 10000, MaxSubmitJobs: no accounting, no per-user limit"
    )
    assert found["enable_user_top"].status is Status.OK
    assert found["polling"].status is Status.WARNING and "every 1 s" in found["polling"].action
    assert found["partition gpu"].status is Status.OK and "gpu:2" in found["partition gpu"].detail
    assert [found[f"pool {p}"].status for p in ("cpu", "gpu", "high")] == [Status.OK] * 3
    assert worst(found.values()) is Status.WARNING


def test_preemption_window_and_signal() -> None:
    f = facts()
    roomy = dataclasses.replace(f, partitions=[dataclasses.replace(p, grace_time_s=120) for p in f.partitions])
    assert checks.check_preemption(roomy).status is Status.OK
    assert "125 s before SIGKILL" in checks.check_preemption(roomy).action
    off = dataclasses.replace(f, caps=dataclasses.replace(f.caps, preemption=False))
    assert checks.check_preemption(off).status is Status.OK and checks.check_preemption(off).detail.startswith("none")
    no_lead = facts(site=f.site.model_copy(update={"signal_lead_s": 0}))
    assert checks.check_preemption(no_lead).status is Status.WARNING
    assert "no warning before its time limit" in checks.check_preemption(no_lead).action
    suspend = dataclasses.replace(f, caps=dataclasses.replace(f.caps, preempt_mode="SUSPEND,GANG"))
    assert (
        checks.check_preemption(suspend).status is Status.WARNING
        and "suspended" in checks.check_preemption(suspend).action
    )


def test_pools_against_partitions() -> None:
    site = SiteConfig(
        default_pool="a",
        pools={
            "a": Pool(partition="nope"),
            "b": Pool(partition="cpu", slot_type="gpu"),
            "c": Pool(partition="gpu", slot_type="gpu", slots_per_node=4),
            "d": Pool(partition="gpu", slot_type="gpu", slots_per_node=2, time_limit_min=10),
        },
    )
    found = by_subject(checks.site_findings(facts(site=site)))
    assert found["pool a"].status is Status.PROBLEM and "'nope' does not exist" in found["pool a"].detail
    assert found["pool b"].status is Status.PROBLEM and "no GPU GRES" in found["pool b"].detail
    assert found["pool c"].status is Status.WARNING and "set slots_per_node 2" in found["pool c"].action
    assert found["pool d"].status is Status.OK
    mixed = checks.check_pool(facts(), "h", Pool(partition="high", slot_type="gpu", slots_per_node=2))
    assert mixed.status is Status.OK and "2 of its 4 nodes have GPUs" in mixed.detail
    assert found["partition high"].action == "not used by any pool"
    f = facts(site=site)
    down = dataclasses.replace(f, partitions=[dataclasses.replace(p, up=p.name != "gpu") for p in f.partitions])
    assert by_subject(checks.site_findings(down))["partition gpu"].status is Status.PROBLEM


def test_gres_types_without_gpu_is_a_problem_for_gpu_pools() -> None:
    f = facts()
    caps = dataclasses.replace(f.caps, plugins=dataclasses.replace(f.caps.plugins, gres_types=""))
    plugins = checks.check_plugins(dataclasses.replace(f, caps=caps))
    assert plugins.status is Status.PROBLEM and "gpu" in plugins.detail


def test_limits_accounting_rate_limit_and_missing_site_config() -> None:
    f = facts(site=SiteConfig(), site_path=None)
    assert (
        checks.check_site_config(f).status is Status.WARNING and "det site init" in checks.check_site_config(f).action
    )
    acct = dataclasses.replace(
        f,
        caps=dataclasses.replace(f.caps, accounting=True, rate_limited=True, max_array_size=1),
        assoc=[AssocLimit("ml", "", 500, None), AssocLimit("ml", "gpu", 50, 8)],
    )
    limits = checks.check_limits(acct)
    assert limits.status is Status.WARNING and "MaxSubmitJobs 50, MaxJobs 8" in limits.detail
    assert checks.check_accounting(acct).status is Status.OK
    assert "rl_enable" in checks.check_rate_limit(acct).detail
    broken = dataclasses.replace(acct, assoc=None, assoc_error="sacctmgr failed (exit 1): no slurmdbd")
    assert checks.check_accounting(broken).status is Status.WARNING
    # Without a site config every partition is probed as a pool (GPU slots where sinfo shows GPUs).
    # high mixes CPU and GPU nodes: a CPU pool.
    assert [(n, p.slot_type) for n, p in probe_pools(f, ())] == [("cpu", "cpu"), ("gpu", "gpu"), ("high", "cpu")]
    with pytest.raises(Exception, match="--pool nope: no such pool"):
        probe_pools(f, ("nope",))


def test_association_limits_captured_from_sacctmgr() -> None:
    # Captured on the test cluster with accounting after `sacctmgr modify user root set
    # MaxSubmitJobs=50 MaxJobs=8`.
    assoc = parse_assoc_limits((DATA / "sacctmgr-assoc.txt").read_text())
    assert assoc == [AssocLimit("default", "", 50, 8), AssocLimit("root", "", 50, 8)]
    f = facts(caps=dataclasses.replace(facts().caps, accounting=True), assoc=assoc)
    assert "MaxSubmitJobs 50, MaxJobs 8" in checks.check_limits(f).detail


def test_json_document_schema() -> None:
    findings = [Finding("a", Status.OK, "x"), Finding("b", Status.PROBLEM, "y", "fix it")]
    doc = report_json(findings, "detslurm", "22.05.8")
    assert doc == {
        "schema": 1,
        "cluster": "detslurm",
        "slurm_version": "22.05.8",
        "status": "problem",
        "counts": {"ok": 1, "warning": 0, "problem": 1},
        "findings": [
            {"subject": "a", "status": "ok", "detail": "x", "action": ""},
            {"subject": "b", "status": "problem", "detail": "y", "action": "fix it"},
        ],
    }


# -- the probe, run here without Slurm -------------------------------------------------------


def test_both_sides_agree_on_names() -> None:
    assert (node_probe.LOGIN_TOKEN, node_probe.EXIT_BASE) == (probe.LOGIN_TOKEN, probe.EXIT_BASE)


def _run_script(script: str, env: Mapping[str, str]) -> int:
    return subprocess.run(["bash", "-c", script], env=dict(env), cwd="/", timeout=600, check=False).returncode


def _pool_probe(name: str, dirs: Sequence[probe.ProbeDir], code: int, slot_type: str = "cpu") -> probe.PoolProbe:
    return probe.PoolProbe(
        name,
        name,
        slot_type,
        job_id="7",
        state="COMPLETED" if code == 0 else "FAILED",
        exit_code=code,
        node="n1",
        dirs=tuple(d.name for d in dirs),
        bases=tuple(str(d.base) for d in dirs),
    )


def test_probe_script_reports_shared_dirs_both_ways(tmp_path: Path) -> None:
    dirs, failed = probe.make_probe_dirs([("experiments", tmp_path / "exps"), ("checkpoints", tmp_path / "ckpts")])
    assert not failed and all(oct(d.path.stat().st_mode)[-3:] == "700" for d in dirs)
    # A pool name that would break a comment line or a file name if it were pasted in.
    pool = "gpu\nrm -rf /; 'x'"
    script = probe.render_script(pool, SiteConfig(), sys.executable, dirs, "")
    env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "7", "SLURMD_NODENAME": "n1", "TMPDIR": str(tmp_path)}
    assert _run_script(script, env) == 0
    result = probe.collect(_pool_probe(pool, dirs, 0), dirs)
    assert result.report is not None and result.report.node == "n1"
    # Read back cleaned: what a node writes never reshapes the table.
    assert result.report.pool == "gpu | rm -rf /; 'x'"
    assert result.login_reads == (("experiments", True), ("checkpoints", True))
    found = by_subject(node_checks.pool_findings(result, "0.1.0"))
    assert found[f"pool {pool}: experiments dir"].status is Status.OK
    assert found[f"pool {pool}: experiments dir"].detail == f"{tmp_path / 'exps'}: shared with n1 both ways"
    assert found[f"pool {pool}: python"].status is Status.OK
    # TMPDIR here is ours and 0700-free: a shared scratch, not a per-job private one.
    assert found[f"pool {pool}: containers"].detail == "container_runtime none"
    probe.remove_probe_dirs(dirs)
    assert not any(d.path.exists() for d in dirs)


def test_a_dir_the_node_sees_differently_is_named(tmp_path: Path) -> None:
    dirs, _ = probe.make_probe_dirs([("experiments", tmp_path / "exps"), ("checkpoints", tmp_path / "ckpts")])
    # What a node with another filesystem at the experiments dir's path sees: not our token.
    (dirs[0].path / probe.LOGIN_TOKEN).write_text("someone else's")
    script = probe.render_script("cpu", SiteConfig(), sys.executable, dirs, "")
    code = _run_script(script, {"PATH": os.environ["PATH"]})
    assert code == probe.EXIT_BASE + 1
    assert probe.dir_failures(code, ("experiments", "checkpoints")) == [("experiments", True, False)]
    result = probe.collect(_pool_probe("cpu", dirs, code), dirs)
    found = by_subject(node_checks.pool_findings(result, "0.1.0"))
    bad = found["pool cpu: experiments dir"]
    assert (
        bad.status is Status.PROBLEM
        and "holds something else" in bad.detail
        and "DETSLURM_EXPERIMENTS_DIR" in bad.action
    )
    assert found["pool cpu: checkpoints dir"].status is Status.OK
    assert "exit code 33" in found["pool cpu: node"].detail


def test_no_report_back_is_read_from_the_exit_code(tmp_path: Path) -> None:
    p = _pool_probe("gpu", [], probe.EXIT_BASE + 0b1011)
    p = dataclasses.replace(p, dirs=("experiments", "checkpoints"), bases=("/e", "/c"))
    found = node_checks.pool_findings(p, "0.1.0")
    assert [(f.subject, f.status) for f in found] == [
        ("pool gpu: experiments dir", Status.PROBLEM),
        ("pool gpu: checkpoints dir", Status.PROBLEM),
    ]
    assert "in /e the node cannot see the login node's test file and cannot write" in found[0].detail
    assert found[1].detail.endswith("in /c the node cannot write")
    silent = dataclasses.replace(p, exit_code=0, state="COMPLETED")
    assert "no report reached the login node" in node_checks.pool_findings(silent, "0.1.0")[0].detail
    lost = dataclasses.replace(p, exit_code=0, state="NODE_FAIL")
    assert "ended before the probe could report" in node_checks.pool_findings(lost, "0.1.0")[0].detail


def test_a_missing_interpreter_is_reported(tmp_path: Path) -> None:
    dirs, _ = probe.make_probe_dirs([("experiments", tmp_path / "exps")])
    script = probe.render_script("cpu", SiteConfig(), str(tmp_path / "no-python"), dirs, "")
    code = _run_script(script, {"PATH": os.environ["PATH"]})
    assert code == 127
    result = probe.collect(_pool_probe("cpu", dirs, code), dirs)
    (py,) = node_checks.pool_findings(result, "0.1.0")
    assert py.subject == "pool cpu: python" and py.status is Status.PROBLEM and "rc=127" in py.detail


def test_setup_lines_run_first_and_detslurm_missing_is_a_problem(tmp_path: Path) -> None:
    dirs, _ = probe.make_probe_dirs([("experiments", tmp_path / "exps")])
    # -I (isolated): the interpreter ignores PYTHONPATH and user site dirs; with -S it cannot see
    # the venv's detslurm either, as on a node without detslurm installed.
    wrapper = tmp_path / "bare-python"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} -I -S "$@"\n')
    wrapper.chmod(0o755)
    site = SiteConfig(setup=["export DOCTOR_SETUP_RAN=1"], container_runtime="apptainer")
    script = probe.render_script("cpu", site, str(wrapper), dirs, "")
    assert script.index("DOCTOR_SETUP_RAN") < script.index("_det_py=")
    assert _run_script(script, {"PATH": "/usr/bin:/bin"}) == 0
    result = probe.collect(_pool_probe("cpu", dirs, 0), dirs)
    found = by_subject(node_checks.pool_findings(result, "0.1.0"))
    assert (
        found["pool cpu: detslurm"].status is Status.PROBLEM
        and "ModuleNotFoundError" in found["pool cpu: detslurm"].detail
    )
    assert found["pool cpu: node scratch"].status is Status.WARNING
    # The runtime named in the site config is asked for its version.
    containers = found["pool cpu: containers"]
    assert containers.status is Status.PROBLEM and "apptainer: not found" in containers.detail


def test_probe_request_asks_for_one_gpu_and_no_output_file() -> None:
    pool = Pool(
        partition="gpu", slot_type="gpu", gres_name="gpu", account="ml", extra_sbatch_args=["--constraint=a100"]
    )
    req = probe.probe_request("g p", pool, SiteConfig(), "/usr/bin/python3", [], "")
    assert req.args == [
        "--job-name=det-doctor-g_p",
        "--comment=detslurm:doctor",
        "--partition=gpu",
        "--nodes=1",
        "--ntasks=1",
        "--time=15",
        "--output=/dev/null",
        "--chdir=/",
        "--no-requeue",
        "--gres=gpu:1",
        "--account=ml",
        "--constraint=a100",
    ]


# -- the report is untrusted -----------------------------------------------------------------


def _good_report(tmp_path: Path) -> dict[str, object]:
    dirs, _ = probe.make_probe_dirs([("experiments", tmp_path / "exps")])
    report, _ = node_probe.probe(
        {"pool": "cpu", "key": "k", "dirs": [{"name": d.name, "path": str(d.path), "token": d.token} for d in dirs]}
    )
    return report


def test_report_decodes_and_hostile_reports_are_clear_errors(tmp_path: Path) -> None:
    good = _good_report(tmp_path)
    assert parse_report(json.dumps(good)).dirs[0].seen
    hostile = dict(good, node="n1\x1b[2J\nFAKE ok line")
    assert parse_report(json.dumps(hostile)).node == "n1 [2J | FAKE ok line"
    cases = [
        ("[]", "is not an object"),
        ("{", "not JSON"),
        (json.dumps(dict(good, version=2)), "unknown version 2"),
        (json.dumps(dict(good, dirs="x")), "report.dirs: expected list"),
        (json.dumps(dict(good, dirs=[{"name": "e"}])), "report.dirs[0].path: expected str"),
        (json.dumps(dict(good, python={"version": 3, "executable": "x"})), "report.python.version: expected str"),
        (
            json.dumps(
                dict(good, scratch=dict(good["scratch"], chosen={**good["scratch"]["chosen"], "free_bytes": True}))
            ),
            "free_bytes: expected int",
        ),  # type: ignore[dict-item]
        (" " * (300 * 1024), "larger than"),
    ]
    for text, message in cases:
        with pytest.raises(ReportError, match=message.replace("[", r"\[").replace("]", r"\]")):
            parse_report(text)


# -- waiting, against a fake Slurm -----------------------------------------------------------


class FakeSlurm(FakeRunner):
    """sbatch hands out ids; squeue shows every job PENDING for ``reason``; calls are recorded."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__()
        self.jobs: list[str] = []

    def answer(self, argv: list[str], input: Optional[str]) -> Result:
        if argv[0] == "sbatch":
            if "--partition=bad" in argv:
                return Result(1, "", "sbatch: error: invalid partition specified: bad")
            self.jobs.append(str(100 + len(self.jobs)))
            return Result(0, self.jobs[-1] + "\n", "")
        if argv[0] == "squeue":
            return Result(0, "".join(_squeue_record(j, self.reason) for j in self.jobs), "")
        return Result(0, "", "")


def _squeue_record(job: str, reason: str) -> str:
    fields = dict.fromkeys(SQUEUE_FIELDS, "")
    fields.update({"JobArrayID": job, "JobID": job, "State": "PENDING", "Reason": reason, "NumNodes": "1"})
    fields.update({"NumCPUs": "1", "RestartCnt": "0"})
    return SEP.join(fields[k] for k in SQUEUE_FIELDS) + REC_END


@pytest.mark.parametrize(("reason", "status"), [("Resources", Status.WARNING), ("PartitionDown", Status.PROBLEM)])
def test_a_probe_that_never_starts_is_cancelled_and_named(reason: str, status: Status) -> None:
    fake = FakeSlurm(reason)
    clock = iter(range(0, 1000, 5))
    slept: list[float] = []
    site = SiteConfig(poll_interval_s=5)
    pools = [("cpu", Pool(partition="cpu")), ("broken", Pool(partition="bad"))]
    results = probe.run_probes(
        SlurmClient(runner=fake, user="u"),
        site,
        pools,
        [],
        python="/usr/bin/python3",
        timeout_s=20,
        clock=lambda: float(next(clock)),
        sleep=slept.append,
    )
    # Polled at the site's floor, never faster; the never-started probe is cancelled.
    assert slept and set(slept) == {5}
    assert ["scancel", "100"] in fake.calls
    found = {f.subject: f for r in results for f in node_checks.pool_findings(r, "0.1.0")}
    assert found["pool cpu: probe"].status is status and f"reason {reason}" in found["pool cpu: probe"].detail
    refused = found["pool broken: probe"]
    assert refused.status is Status.PROBLEM and "invalid partition specified: bad" in refused.detail


# -- det site init ---------------------------------------------------------------------------


def test_starter_config_from_the_test_cluster(tmp_path: Path) -> None:
    text = starter.starter_yaml(facts(site=SiteConfig(), site_path=None))
    path = tmp_path / "site.yaml"
    starter.write_starter(text, path, force=False)
    site = load_site_config(path)
    assert site.default_pool == "cpu" and site.poll_interval_s == 10
    assert {n: (p.partition, p.slot_type, p.slots_per_node) for n, p in site.pools.items()} == {
        "cpu": ("cpu", "cpu", 2),
        "gpu": ("gpu", "gpu", 2),
        "high": ("high", "cpu", 2),
    }
    assert site.pools["gpu"].description == "2 nodes (g[1-2]), 2 GPUs each"
    assert site.pools["high"].description == "4 nodes (c[1-2],g[1-2]), 2 CPUs each (2 of them with GPUs)"
    with pytest.raises(starter.SiteInitError, match="exists; use --force"):
        starter.write_starter("x", path, force=False)
    starter.write_starter(text, path, force=True)
    busy = facts(site=SiteConfig(), site_path=None)
    busy = dataclasses.replace(busy, caps=dataclasses.replace(busy.caps, rate_limited=True))
    assert "poll_interval_s: 30" in starter.starter_yaml(busy)
    assert "#        PreemptMode REQUEUE (preempt/partition_prio), KillWait 5 s; MaxArraySize 1001" in text


class FailingSqueue(FakeSlurm):
    """squeue answers with ``stderr`` (exit 1); everything else as FakeSlurm."""

    def __init__(self, stderr: str) -> None:
        super().__init__("Resources")
        self.stderr = stderr

    def answer(self, argv: list[str], input: Optional[str]) -> Result:
        if argv[0] == "squeue":
            return Result(1, "", self.stderr)
        return super().answer(argv, input)


def test_slurm_failing_while_waiting_leaves_no_probe_queued() -> None:
    clock = iter(range(0, 1000, 5))
    kwargs = {"python": "/p", "timeout_s": 12, "clock": lambda: float(next(clock)), "sleep": lambda s: None}
    # A busy slurmctld is no news: the doctor keeps waiting until its timeout, then cancels.
    busy = FailingSqueue("squeue: error: Unable to contact slurm controller (connect failure)")
    (result,) = probe.run_probes(
        SlurmClient(runner=busy, user="u"), SiteConfig(), [("cpu", Pool(partition="cpu"))], [], **kwargs
    )  # type: ignore[arg-type]
    assert result.timed_out and ["scancel", "100"] in busy.calls
    # Any other failure ends the doctor, but not before the probes are cancelled.
    broken = FailingSqueue("squeue: error: Invalid user")
    with pytest.raises(Exception, match="Invalid user"):
        probe.run_probes(
            SlurmClient(runner=broken, user="u"), SiteConfig(), [("cpu", Pool(partition="cpu"))], [], **kwargs
        )  # type: ignore[arg-type]
    assert ["scancel", "100"] in broken.calls


def test_probe_time_fits_the_partition() -> None:
    f = facts()
    short = dataclasses.replace(f, partitions=[dataclasses.replace(p, max_time_s=300) for p in f.partitions])
    pools = dict(probe_pools(short, ("cpu",)))
    assert pools["cpu"].time_limit_min == 5
    assert "--time=5" in probe.probe_request("cpu", pools["cpu"], f.site, "/p", [], "").args
    assert "--time=15" in probe.probe_request("cpu", dict(probe_pools(f, ()))["cpu"], f.site, "/p", [], "").args


def test_a_report_cannot_add_or_drop_dirs(tmp_path: Path) -> None:
    dirs, _ = probe.make_probe_dirs([("experiments", tmp_path / "exps"), ("checkpoints", tmp_path / "ckpts")])
    assert (
        _run_script(probe.render_script("cpu", SiteConfig(), sys.executable, dirs, ""), {"PATH": os.environ["PATH"]})
        == 0
    )
    result = probe.collect(_pool_probe("cpu", dirs, 0), dirs)
    assert result.report is not None
    forged = dataclasses.replace(
        result.report, dirs=(dataclasses.replace(result.report.dirs[0], name="elsewhere"), result.report.dirs[1])
    )
    found = by_subject(node_checks.pool_findings(dataclasses.replace(result, report=forged), "0.1.0"))
    assert "pool cpu: elsewhere dir" not in found
    assert found["pool cpu: experiments dir"].status is Status.PROBLEM
    assert found["pool cpu: experiments dir"].detail == f"the report says nothing about {tmp_path / 'exps'}"


MOUNTINFO = (
    "22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n40 22 0:50 / /home rw,relatime - nfs4 server:/home rw,vers=4.2\n"
)


def test_store_line() -> None:
    local = store_facts("sqlite:////var/tmp/det/detslurm.db", MOUNTINFO)
    assert local == StoreFacts("sqlite", Path("/var/tmp/det/detslurm.db"), None)
    assert checks.check_store(facts(store=local)).status is Status.OK
    nfs = store_facts("sqlite:////home/alice/.local/share/detslurm/detslurm.db", MOUNTINFO)
    assert nfs.network_fs == "nfs4"
    line = checks.check_store(facts(store=nfs))
    assert line.status is Status.WARNING and "DETSLURM_DATA_DIR" in line.action
    pg = checks.check_store(facts(store=store_facts("postgresql+psycopg://bob:s3cret@db/det", MOUNTINFO)))
    assert pg.status is Status.OK and pg.detail == "postgresql (db_url)" and "s3cret" not in pg.detail + pg.action
