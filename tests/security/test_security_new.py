"""Attacks by a second Unix user on this session's new surfaces: detached runs, containers, the
site doctor and its node probe, and the ``sbatch --test-only`` refusal check.

Each test names the property it proves. Where an attack once worked (docs/design/security.md),
the test replays the attack and fails on the code before the fix; where a surface was sound,
the test shows the attack does not work and a comment says why.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from security_harness import Attacker, run_as, victim_base

from detslurm import settings
from detslurm.controller.detached import DetachedIngest
from detslurm.doctor import probe as doctor_probe
from detslurm.doctor.report import clean
from detslurm.doctor.starter import write_starter
from detslurm.exec import node_probe
from detslurm.expconf import validate
from detslurm.identity import os_user
from detslurm.protocol import BadRecord, trial_env
from detslurm.protocol.detached import (
    DetachedError,
    DetachedLayout,
    DetachedRun,
    RunClosed,
    allocate_run,
    detached_root,
)
from detslurm.slurm import container_lib
from detslurm.slurm.client import Result, SlurmClient
from detslurm.slurm.render import ContainerPaths, Identity, plan_trial_run, resource_plan
from detslurm.slurm.site import SiteConfig
from detslurm.store import Experiment, open_store

pytestmark = pytest.mark.security


@pytest.fixture
def base() -> Iterator[Path]:
    """victim_base(): the attacker may traverse it, not list it; removed afterwards."""
    path = victim_base()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _shared_dir(path: Path) -> Path:
    """A dir every user may create entries in, as /tmp or a site's shared scratch (1777)."""
    path.mkdir()
    os.chmod(path, 0o1777)
    return path


# -- detached runs ------------------------------------------------------------------------------

# The attacker makes <experiments>/detached itself (a dir of hers, or a symlink to one) and
# plants a well-formed run in it, hoping the victim's daemon records it as the victim's.
PLANT_DETACHED = r"""
import json, os, sys
root, how = sys.argv[1], sys.argv[2]
real = root if how == "dir" else root + "-mallory"
run = os.path.join(real, "e-" + "a" * 24, "trials", "7", "runs", "1")
os.makedirs(run, mode=0o700)
os.chmod(real, 0o700)
with open(os.path.join(run, "detached.json"), "w") as f:
    json.dump({"v": 1, "external_experiment_id": "planted", "external_trial_id": "1",
               "name": "planted-by-mallory", "checkpoint_base": "/tmp"}, f)
if how == "symlink":
    os.symlink(real, root)
"""


@pytest.mark.parametrize("how", ["dir", "symlink"])
def test_detached_root_planted_by_another_user_is_not_ingested(
    mallory: Attacker, base: Path, det_env: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Sound: ingest and the in-job side both lstat the detached root and take only a real dir
    owned by the user with mode 0700 (protocol/detached.check_private_dir). Even where the
    experiments dir is shared and the attacker gets to create ``detached/`` first, nothing of
    hers is recorded, and the victim's jobs refuse to write into it."""
    exps = _shared_dir(base / "exps")
    monkeypatch.setenv("DETSLURM_EXPERIMENTS_DIR", str(exps))
    root = detached_root(exps)
    r = mallory.python_snippet(PLANT_DETACHED, str(root), how)
    assert r.returncode == 0, r.stderr
    assert (root / ("e-" + "a" * 24)).is_dir()  # the planted run is really there, and root can read it
    s = settings.load()
    store = open_store(s.db_url)
    result = DetachedIngest(store, root, os_user(), None).step()
    assert result.recorded == 0
    with store.read() as session:
        assert session.query(Experiment).count() == 0
    with pytest.raises(DetachedError, match="not a directory owned by you"):
        DetachedLayout.open(root)


def test_detached_records_and_key_are_private(mallory: Attacker, base: Path) -> None:
    """Sound: the root is 0700, its key 0600 and every dir below 0700, so a neighbour can
    neither read a run's records nor compute (or pre-create) its names: the names come from an
    HMAC under the 32-byte random key, not from the public Slurm job id."""
    control = base / "public.txt"
    control.write_text("x")
    control.chmod(0o644)
    root = base / "exps" / "detached"
    layout = DetachedLayout.open(root)
    paths = allocate_run(layout.exp_dir("slurm-4242"), layout.trial_key("slurm-4242", "4242"))
    DetachedRun("slurm-4242", "4242", "victim", "/ckpt", job_id="4242").write(paths)
    assert mallory.can_read(control)  # the probe reads what it is allowed to
    for target in (root, root / ".key", paths.dir, paths.dir / "detached.json"):
        assert target.exists() and not mallory.can_read(target), target
    for d in (root, *[p for p in paths.dir.parents if p.is_relative_to(root)], paths.dir):
        assert d.stat().st_mode & 0o077 == 0, f"{d} is open to others"
    assert (root / ".key").stat().st_mode & 0o777 == 0o600
    # The key is random: another root names the same public id differently.
    assert "4242" not in str(paths.dir.relative_to(root))
    assert DetachedLayout.open(base / "other").exp_dir("slurm-4242").name != layout.exp_dir("slurm-4242").name


# -- containers ---------------------------------------------------------------------------------

_POOLS = {
    "cpu": {"partition": "cpu", "slots_per_node": 2},
    "gpu": {"partition": "gpu", "slot_type": "gpu", "slots_per_node": 4},
}
HOSTILE_IMAGE = "img$(touch MARK-image)`touch MARK-tick`;touch MARK-semi 'q\" x"
HOSTILE_BIND = "/data dir/$(touch MARK-bind);x"


def _config(environment: dict[str, Any], **over: Any) -> Any:
    raw: dict[str, Any] = {
        "name": "sec",
        "entrypoint": "python3 train.py",
        "searcher": {"name": "single", "metric": "loss"},
        "hyperparameters": {"lr": 0.1},
        "environment": environment,
        **over,
    }
    return validate(raw, {"type": "shared_fs", "host_path": "/shared/ckpt"})


def _site(runtime: str, executable: str = "") -> SiteConfig:
    container = {"executable": executable} if executable else {}
    return SiteConfig.model_validate(
        {"default_pool": "cpu", "pools": _POOLS, "container_runtime": runtime, "container": container}
    )


def _plan(cfg: Any, site: SiteConfig, run_dir: Path) -> Any:
    env = trial_env(
        experiment_id=1,
        trial_id=2,
        run_id=3,
        seed=1,
        hparams={"lr": 0.1},
        config=cfg.as_dict(),
        latest_checkpoint=None,
        steps_completed=0,
        run_dir=run_dir,
        trial_dir=run_dir.parent.parent,
        exp_dir=run_dir.parent.parent.parent.parent,
        checkpoint_base=cfg.storage_base,
        resources_type="slurm-job",
        slot_ids=[0],
        container_addrs=["127.0.0.1"],
        user="alice",
    )
    env.update(cfg.environment.variables())
    return plan_trial_run(
        config=cfg,
        site=site,
        res=resource_plan(cfg, site),
        ident=Identity(1, 2, 3, tag="abcd"),
        env=env,
        run_dir=str(run_dir),
        log_path=str(run_dir / "output.log"),
        python="python3",
        container=ContainerPaths(str(run_dir.parent.parent.parent.parent), "/shared/lib/0123"),
    )


@pytest.mark.parametrize("pool", ["cpu", "gpu"])
def test_hostile_image_and_bind_paths_reach_podman_as_single_arguments(tmp_path: Path, pool: str) -> None:
    """Sound: the rendered batch script, run by bash with a stand-in podman, hands the image and
    bind paths over as exactly the strings configured (one argument each), and none of the
    shell syntax inside them runs, also through the GPU path's nested ``sh -c``."""
    fake = tmp_path / "bin" / "podman"
    fake.parent.mkdir()
    # The stand-in records each call's argv (one JSON line) and succeeds.
    fake.write_text(
        '#!/usr/bin/env python3\nimport json, os, sys\nwith open(os.environ["ARGV_LOG"], "a") as f:\n'
        "    f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
    )
    fake.chmod(0o755)
    run_dir = tmp_path / "exp" / "trials" / "2" / "runs" / "3"
    run_dir.mkdir(parents=True)
    binds = [{"host_path": HOSTILE_BIND, "container_path": "/mnt/x y", "read_only": True}]
    resources = {"slots_per_trial": 1, "resource_pool": pool}
    cfg = _config({"image": HOSTILE_IMAGE}, bind_mounts=binds, resources=resources)
    req = _plan(cfg, _site("podman", str(fake)), run_dir)
    log = tmp_path / "argv.jsonl"
    env = {"PATH": f"{fake.parent}:/usr/bin:/bin", "ARGV_LOG": str(log), "SLURM_JOB_ID": "77", "SLURM_JOB_GPUS": "0"}
    res = subprocess.run(["bash", "-s"], input=req.script, env=env, cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    run = next(c for c in calls if c and c[0] == "run")
    assert run[-4:] == [HOSTILE_IMAGE, "python3", "-m", "detslurm.exec.launch"]
    assert f"{HOSTILE_BIND}:/mnt/x y:ro" in run
    assert any(HOSTILE_IMAGE in c for c in calls if c[0] != "run")  # the prepare step's check/pull
    assert not list(tmp_path.rglob("MARK-*")) and not list(run_dir.rglob("MARK-*"))


def test_registry_password_stays_out_of_argv_and_the_trial_environment(tmp_path: Path) -> None:
    """Hole (fixed): ``DET_EXPERIMENT_CONFIG`` carried environment.registry_auth, password and
    all, into every trial's environment (and with Podman into the image's processes, with
    ``--env=DET_*``). Only the runtime's own variables may hold it; no argv (``ps``) ever does."""
    auth = {"username": "alice", "password": "s3cret-pw", "serveraddress": "ghcr.io"}
    run_dir = tmp_path / "exp" / "trials" / "2" / "runs" / "3"
    for runtime in ("apptainer", "podman", "pyxis"):
        cfg = _config({"image": "ghcr.io/alice/img:1", "registry_auth": auth})
        req = _plan(cfg, _site(runtime), run_dir)
        assert not [a for a in req.args if "s3cret" in a]
        config = json.loads(req.env["DET_EXPERIMENT_CONFIG"])
        assert config["environment"]["registry_auth"]["username"] == "alice"
        assert "s3cret" not in req.env["DET_EXPERIMENT_CONFIG"]
        # Only the runtime's pull variables (Apptainer's) carry it: exported, never a command line.
        carriers = [line.split("=")[0] for line in req.script.splitlines() if "s3cret" in line]
        assert carriers == (["export APPTAINER_DOCKER_PASSWORD"] if runtime == "apptainer" else [])


def test_container_library_copy_is_private(mallory: Attacker, base: Path) -> None:
    """Sound: the in-job library is built in a mkdtemp dir (0700), its files made 0400, then
    renamed into place; the path lies in the 0700 experiment dir, so nobody else can swap it
    between the copy and the mount. Even with a parent others may enter, the copy is closed."""
    src = base / "mod.py"
    src.write_text("X = 1\n")
    target = container_lib.lib_dir(base / "container-lib", [container_lib.Source(src, "mod.py")])
    container_lib.ensure_lib(target, [container_lib.Source(src, "mod.py")])
    os.chmod(base / "container-lib", 0o755)  # the worst case: the parent is listable
    assert target.stat().st_mode & 0o777 == 0o700 and (target / "mod.py").stat().st_mode & 0o777 == 0o400
    assert not mallory.can_read(target)


# -- the site doctor ----------------------------------------------------------------------------

PLANT_PROBE_DIR = r"""
import os, sys
d = os.path.join(sys.argv[1], ".detslurm-doctor")
os.mkdir(d)
os.chmod(d, 0o777)
"""


def test_doctor_refuses_a_probe_dir_another_user_made(mallory: Attacker, base: Path) -> None:
    """Hole (fixed): in a shared checkpoint or experiments base (a site's 1777 scratch), the
    doctor reused a ``.detslurm-doctor`` someone else had made. Its owner may rename entries in
    it: she could swap the doctor's run dir for her own, plant the report the doctor trusts,
    or leave symlinks the token writes follow. Now such a dir is refused, with what to do."""
    shared = _shared_dir(base / "scratch")
    r = mallory.python_snippet(PLANT_PROBE_DIR, str(shared))
    assert r.returncode == 0, r.stderr
    made, failed = doctor_probe.make_probe_dirs([("checkpoints", shared)])
    assert not made, "the doctor wrote into another user's dir"
    assert [(n, b) for n, b, _ in failed] == [("checkpoints", shared)]
    assert "not a private dir of yours" in failed[0][2]
    assert os.listdir(shared / ".detslurm-doctor") == []
    # Control: a base of the user's own still works.
    mine, bad = doctor_probe.make_probe_dirs([("experiments", base / "mine")])
    assert not bad and len(mine) == 1 and (mine[0].path / doctor_probe.LOGIN_TOKEN).stat().st_mode & 0o777 == 0o600


# The attacker owns a dir the probe is told to use and plants a symlink at the temporary name
# the node probe writes its token through (the old name was ``<file>.tmp-<pid>``).
PLANT_LINK = r"""
import os, sys
d, target, key, pid = sys.argv[1:5]
os.mkdir(d)
os.chmod(d, 0o777)
os.symlink(target, os.path.join(d, "node-%s.token.tmp-%s" % (key, pid)))
open(os.path.join(d, "login-token"), "w").write(sys.argv[5])
"""


def test_node_probe_never_writes_into_a_dir_that_is_not_its_own(mallory: Attacker, base: Path) -> None:
    """Hole (fixed): the node probe wrote its token through ``<name>.tmp-<pid>`` with a plain
    open(), following a symlink planted there; in a dir another user controls, the job would
    overwrite any file of its user. Now it writes only into a private dir of its own, through
    a random name made with O_EXCL | O_NOFOLLOW."""
    precious = base / "precious.txt"
    precious.write_text("precious")
    precious.chmod(0o600)
    probe_dir = base / "shared-probe"
    os.chmod(base, 0o733)  # the attacker may create entries in base (a shared fs's common dir)
    try:
        r = mallory.python_snippet(PLANT_LINK, str(probe_dir), str(precious), "k1", str(os.getpid()), "tok")
    finally:
        os.chmod(base, 0o711)
    assert r.returncode == 0, r.stderr
    out = node_probe.check_dir({"name": "checkpoints", "path": str(probe_dir), "token": "tok"}, "k1", "NODETOKEN")
    assert precious.read_text() == "precious"
    assert not out["written"] and "not a private dir" in out["error"]
    # Control: in a private dir of its own the probe reads the login token and writes its own.
    own = base / "own"
    own.mkdir(mode=0o700)
    (own / "login-token").write_text("tok")
    out = node_probe.check_dir({"name": "checkpoints", "path": str(own), "token": "tok"}, "k1", "NODETOKEN")
    assert out["seen"] and out["written"] and (own / "node-k1.token").read_text() == "NODETOKEN"


def test_report_text_cannot_carry_terminal_controls() -> None:
    """Hole (fixed, low): report text was cleaned of C0 controls only; U+009B (a one-character
    CSI) and the rest of C1 passed into the doctor's table on the user's terminal."""
    text = clean("image failed\x9b2J\x1b[31mred\x07\x85done")
    assert not any(0x80 <= ord(ch) <= 0x9F or ord(ch) < 0x20 for ch in text)
    assert text.startswith("image failed") and text.endswith("done")


# -- refusals: sbatch --test-only ----------------------------------------------------------------


def test_sbatch_test_only_gets_its_arguments_without_a_shell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sound: ``sbatch --test-only`` runs from an argv list (no shell) with the script on stdin,
    so user sbatch_args with shell syntax reach sbatch as the very strings given and run nothing.
    A stand-in sbatch on PATH records what it got."""
    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text(
        '#!/usr/bin/env python3\nimport json, os, sys\nopen(os.environ["ARGV_LOG"], "w").write(json.dumps('
        '{"argv": sys.argv[1:], "stdin": sys.stdin.read()}))\nprint("sbatch: error: refused", file=sys.stderr)\n'
        "sys.exit(1)\n"
    )
    fake.chmod(0o755)
    log = tmp_path / "argv.json"
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    monkeypatch.setenv("ARGV_LOG", str(log))
    monkeypatch.chdir(tmp_path)
    args = ["--comment=$(touch MARK-a)", "--job-name=x;touch MARK-b", "--account=`touch MARK-c`"]
    message = SlurmClient().sbatch_test_only(args, "#!/bin/bash\ntrue\n")
    assert message is not None and "refused" in message
    got = json.loads(log.read_text())
    assert got["argv"] == ["--test-only", *args] and got["stdin"] == "#!/bin/bash\ntrue\n"
    assert not list(tmp_path.glob("MARK-*"))
    # The injected runner sees the same argv: nothing between the client and exec reshapes it.
    seen: list[list[str]] = []

    def runner(argv: Any, **kw: Any) -> Result:
        seen.append(list(argv))
        return Result(0, "", "")

    assert SlurmClient(runner=runner).sbatch_test_only(args, "x") is None
    assert seen == [["sbatch", "--test-only", *args]]


def test_a_fifo_in_place_of_a_record_does_not_block_the_daemon(tmp_path: Path) -> None:
    """Fixed (reliability): a FIFO where a record belongs (``closed.json`` of a detached run, an
    exit record) blocked the reader's open() until someone wrote to it, and the reader is the
    daemon serving every experiment. Now only regular files are read, without blocking."""
    layout = DetachedLayout.open(tmp_path / "detached")
    paths = allocate_run(layout.exp_dir("e"), layout.trial_key("e", "t"))
    fifo = paths.dir / "closed.json"
    os.mkfifo(fifo, 0o600)
    outcome: list[str] = []

    def read() -> None:
        try:
            RunClosed.read(paths)
            outcome.append("read")
        except BadRecord as e:
            outcome.append(e.reason)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(5)
    blocked = reader.is_alive()
    if blocked:  # the old code: unblock its open() so the test ends either way
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(5)
    assert not blocked, "reading the record blocked on a FIFO"
    assert outcome and "not a regular file" in outcome[0]


PLANT_TMP_LINKS = r"""
import os, sys
d, target, name, pid = sys.argv[1:5]
os.symlink(target, os.path.join(d, ".%s.tmp-%s" % (name, pid)))
"""


def test_site_init_never_writes_through_a_planted_link(mallory: Attacker, base: Path) -> None:
    """Hole (fixed, low): ``det site init --output DIR/site.yaml`` wrote through
    ``.site.yaml.tmp-<pid>`` with a plain open(); in a config dir others may write (a group's
    shared dir, not sticky), a symlink planted at that predictable name made it overwrite any
    file of the user running it (often an admin). Now the temp name is random and made with
    O_EXCL | O_NOFOLLOW."""
    precious = base / "precious.txt"
    precious.write_text("precious")
    precious.chmod(0o600)
    shared = base / "site-config"
    shared.mkdir()
    os.chmod(shared, 0o777)  # writable by the group/everyone, and not sticky
    r = mallory.python_snippet(PLANT_TMP_LINKS, str(shared), str(precious), "site.yaml", str(os.getpid()))
    assert r.returncode == 0, r.stderr
    write_starter("pools: {}\n", shared / "site.yaml", force=False)
    assert precious.read_text() == "precious"
    assert (shared / "site.yaml").read_text() == "pools: {}\n"


@pytest.mark.slurm
def test_registry_password_in_a_queued_job_is_hidden_from_other_users(
    mallory: Attacker, base: Path, slurm_cluster: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sound (on the real cluster): Apptainer's pull password is in the batch script, which
    reaches slurmctld on sbatch's stdin; another user's ``scontrol show job`` (also ``-dd``),
    ``squeue -o %all`` and ``scontrol write batch_script`` show none of it (Slurm hands the script
    to its owner and operators only). The job is held, so it never runs."""
    conf = str(slurm_cluster / "etc" / "slurm.conf")
    monkeypatch.setenv("SLURM_CONF", conf)
    run_dir = base / "exp" / "trials" / "2" / "runs" / "3"
    run_dir.mkdir(parents=True)
    auth = {"username": "alice", "password": "s3cret-q7w", "serveraddress": "ghcr.io"}
    req = _plan(_config({"image": "ghcr.io/alice/img:1", "registry_auth": auth}), _site("apptainer"), run_dir)
    client = SlurmClient()
    job = client.sbatch([*req.args, "--hold"], req.script)
    try:
        env = {"PATH": "/usr/bin:/bin", "SLURM_CONF": conf, "LANG": "C.UTF-8", "HOME": "/nonexistent"}
        seen = {
            " ".join(argv): run_as(mallory.user, argv, env=env, cwd=str(mallory.home))
            for argv in (
                ["scontrol", "show", "job", job],
                ["scontrol", "-dd", "show", "job", job],
                ["squeue", "-j", job, "-o", "%all"],
                ["scontrol", "write", "batch_script", job, "-"],
            )
        }
        assert req.name in seen[f"scontrol show job {job}"].stdout  # she does see the job itself
        leaks = [cmd for cmd, r in seen.items() if "s3cret" in r.stdout + r.stderr]
        assert not leaks, f"{mallory.user.pw_name} read the registry password through {leaks}"
        # Control: the password is in the stored script, for its owner.
        own = subprocess.run(["scontrol", "write", "batch_script", job, "-"], capture_output=True, text=True)
        assert "s3cret-q7w" in own.stdout
    finally:
        client.scancel([job])
