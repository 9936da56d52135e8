"""A neighbour on the node cannot plant code in, or read, a trial's node-local files (docs/design/security.md).

Replays the review's reproduction on the real test cluster: the second user pre-creates the
old predictable working dirs for the next job ids (mode 777, with a ``startup-hook.sh``, a
``json.py`` that would shadow the standard library, and symlinks at the old ``.hook-env`` and
DeepSpeed hostfile names), then our trial runs on that node. While the trial holds (it signals
readiness through a file in its run dir), the attacker tries to read its working dir, code,
any environment dump and its checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import write
from security_harness import Attacker, victim_base

from detslurm.exec.launch import _run_hook

pytestmark = [pytest.mark.security, pytest.mark.slurm]

SECRET = "topsecret-4c1d"
PLANTED = 20

# The attacker's planting, for each job id on argv: a dir per predictable old name, plus symlinks
# at the old fixed names, all aimed at a file only the victim may write.
PLANT = r"""
import json, os, sys
target, ids, done = sys.argv[1], sys.argv[2:], []
for j in ids:
    d = "/tmp/detslurm-%s-node0" % j
    try:
        os.mkdir(d)
    except FileExistsError:  # someone else's (another test run's): leave it alone
        continue
    done.append(j)
    os.chmod(d, 0o777)
    with open(d + "/startup-hook.sh", "w") as f:
        f.write("id > %s/HOOK_RAN\n" % d)
    with open(d + "/json.py", "w") as f:
        f.write("open(%r, 'w').write('imported')\n" % (d + "/JSON_IMPORTED"))
    os.symlink(target, d + "/.hook-env")
    os.symlink(target, d + "/hostfile-%s.txt" % j)
    for name in os.listdir(d):
        if not os.path.islink(d + "/" + name):
            os.chmod(d + "/" + name, 0o777)
print(json.dumps(done))
"""

# Everything under /tmp whose name says detslurm: what the attacker can list, read, or find the
# trial's secret in.
SNOOP = r"""
import json, os, sys
secret = sys.argv[1]
seen = {"entered": [], "leaks": [], "names": []}
for name in sorted(os.listdir("/tmp")):
    if not name.startswith("detslurm-") or name.startswith("detslurm-mallory"):
        continue
    seen["names"].append(name)
    for dirpath, dirnames, filenames in os.walk("/tmp/" + name):
        seen["entered"].append(dirpath)
        for f in filenames:
            try:
                if secret in open(os.path.join(dirpath, f), "rb").read().decode("latin-1"):
                    seen["leaks"].append(os.path.join(dirpath, f))
            except OSError:
                pass
print(json.dumps(seen))
"""

TRAIN = """
import json, os, pathlib, time
import determined as det

run = pathlib.Path(os.environ["DET_RUN_DIR"])
with det.core.init() as ctx:
    with ctx.checkpoint.store_path({"steps_completed": 1}) as (path, uuid):
        (path / "weights.bin").write_text("weights " + os.environ["API_TOKEN"])
    ready = {"cwd": os.getcwd(), "ckpt": str(ctx.checkpoint.base / uuid), "hook": os.environ.get("FROM_HOOK"),
             "json": json.__file__}
    (run / "ready.tmp").write_text(json.dumps(ready))
    os.replace(run / "ready.tmp", run / "ready")
    deadline = time.time() + 120
    while not os.path.exists(os.environ["GO_FILE"]) and time.time() < deadline:
        time.sleep(0.2)
    ctx.train.report_validation_metrics(steps_completed=1, metrics={"validation_loss": 0.5})
"""


def last_job_id() -> int:
    """The newest job id now: a held job, cancelled at once (job ids are sequential and public)."""
    out = subprocess.run(
        ["sbatch", "--parsable", "--hold", "--wrap", "true"], capture_output=True, text=True, check=True
    ).stdout
    job = int(out.strip().split(";")[0])
    subprocess.run(["scancel", str(job)], check=False)
    return job


def plant(mallory: Attacker, target: Path, ids: list[str]) -> Iterator[list[str]]:
    """Plant for ``ids``; yields the ids actually planted (a dir that exists already is skipped)."""
    r = mallory.python_snippet(PLANT, str(target), *ids)
    assert r.returncode == 0, r.stderr
    done: list[str] = json.loads(r.stdout)
    try:
        yield done
    finally:
        for j in done:
            shutil.rmtree(f"/tmp/detslurm-{j}-node0", ignore_errors=True)


@pytest.fixture
def planted(slurm_env: Path, mallory: Attacker, tmp_path: Path) -> Iterator[tuple[list[int], Path]]:
    """The attacker's dirs for the next PLANTED job ids, and the file their symlinks aim at."""
    target = tmp_path / "clobber-me"
    target.write_text("original")
    first = last_job_id() + 1
    for done in plant(mallory, target, [str(j) for j in range(first, first + PLANTED)]):
        yield [int(j) for j in done], target


def wait_ready(exps: Path, timeout_s: float = 180) -> Path:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = sorted(exps.glob("*/trials/*/runs/*/ready"))
        if found:
            return found[0]
        time.sleep(0.2)
    raise AssertionError("the trial never signalled readiness")


def test_planted_hook_and_module_would_run_from_the_old_dir(mallory: Attacker, tmp_path: Path) -> None:
    """Control: the planted payloads work when a victim uses the attacker's dir as its workdir."""
    d = Path(f"/tmp/detslurm-control{os.getpid()}-node0")
    for done in plant(mallory, tmp_path / "clobber-me", [f"control{os.getpid()}"]):
        assert done
        assert _run_hook(d, {"PATH": os.environ["PATH"]}) == 0
        subprocess.run(["python3", "-c", "import json"], cwd=d, env={"PATH": os.environ["PATH"], "PYTHONPATH": str(d)})
        assert (d / "HOOK_RAN").exists() and (d / "JSON_IMPORTED").exists()


def test_neighbour_cannot_plant_into_or_read_a_trials_node_files(
    det: Any, mallory: Attacker, planted: tuple[list[int], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids, target = planted
    base = victim_base()
    monkeypatch.setenv("DETSLURM_CHECKPOINT_DIR", str(base / "ckpts"))
    monkeypatch.delenv("TMPDIR", raising=False)  # the job's scratch is the shared /tmp, as in the review
    go = tmp_path / "go"
    write(tmp_path / "ctx/train.py", TRAIN)
    write(tmp_path / "ctx/startup-hook.sh", "export FROM_HOOK=yes\n")
    cfg = write(
        tmp_path / "c.yaml",
        "entrypoint: python3 train.py\nsearcher: {name: single, metric: validation_loss}\nmax_restarts: 0\n"
        f"environment: {{environment_variables: [GO_FILE={go}, API_TOKEN={SECRET}]}}\n",
    )
    try:
        code, out, err = det("e", "create", cfg, tmp_path / "ctx")
        assert code == 0, out + err
        ready_file = wait_ready(tmp_path / "exps")
        ready = json.loads(ready_file.read_text())
        job = int((ready_file.parent / "job_id").read_text().split(";")[0].split("_")[0])
        cwd, ckpt = Path(ready["cwd"]), Path(ready["ckpt"])
        live = {p: mallory.can_read(p) for p in (cwd.parent, cwd, cwd / "train.py", ckpt, ckpt / "weights.bin")}
        snoop = mallory.python_snippet(SNOOP, SECRET)
        go.touch()
        code, out, err = det("e", "wait", "1")
    finally:
        go.touch()
        shutil.rmtree(base, ignore_errors=True)
    assert code == 0, out + err
    assert job in ids, f"job {job} is not one of the planted ids {ids[0]}..{ids[-1]}: the attack was not tested"
    assert ready["hook"] == "yes" and "/tmp/detslurm-" not in ready["json"]
    assert cwd.parent.name.startswith(f"detslurm-{job}-node0-") and cwd.parent.parent == Path("/tmp")
    assert not [p for p, readable in live.items() if readable], live
    assert snoop.returncode == 0, snoop.stderr
    seen = json.loads(snoop.stdout)
    assert cwd.parent.name in seen["names"]  # the attacker sees the name, and nothing more
    assert str(cwd.parent) not in seen["entered"] and seen["leaks"] == []
    for j in ids:
        d = Path(f"/tmp/detslurm-{j}-node0")
        assert not (d / "HOOK_RAN").exists() and not (d / "JSON_IMPORTED").exists(), d
    assert target.read_text() == "original"
    assert not cwd.parent.exists()  # removed when the trial ended
