"""The doctor's probe on a compute node: what only a node can tell, as one JSON report.

Sent inside the probe job's script and run as ``python - CONFIG_JSON`` with the site's
interpreter, so it works (and says so) where detslurm itself is not installed on the nodes:
it imports nothing but the standard library at module level. The login side reads the report
as untrusted input (``detslurm.doctor.report``).

Shared dirs are checked both ways: the login node wrote ``login-token`` into each probe dir;
this probe reads it back and writes ``node-<key>.token`` for the login node to read. The
report goes into every probe dir (one that the login node cannot see simply never returns it),
and the exit code carries the same verdict in bits, for when no report comes back at all.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import stat
import subprocess
import sys
from typing import Any

LOGIN_TOKEN = "login-token"
# Exit codes: 0 when everything shared is fine, EXIT_BASE + bits otherwise (never 1, 126 or 127,
# which mean the interpreter itself failed or is missing).
EXIT_BASE = 32
# Bits, per probe dir in config order: bit 2*i = login token not seen, 2*i+1 = not writable.
OUTPUT_LIMIT = 2000


def _short(text: str) -> str:
    return text.strip()[-OUTPUT_LIMIT:]


def _run(argv: list[str], timeout: float = 30.0) -> dict[str, Any]:
    """A command's exit code and output (its tail), or why it could not run."""
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        return {"rc": None, "out": "", "error": f"{argv[0]}: not found"}
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"rc": None, "out": "", "error": f"{argv[0]}: {e}"}
    return {"rc": p.returncode, "out": _short(p.stdout + p.stderr), "error": ""}


def _write_atomic(path: str, text: str) -> None:
    # Written under a temporary name and renamed: the login node never reads half a file. The
    # name is random and created exclusively without following links: a name someone could
    # predict (the pid) and pre-plant as a symlink would make this job write through it.
    tmp = f"{path}.tmp-{secrets.token_hex(8)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.rename(tmp, path)


def _own_private_dir(path: str) -> str:
    """Why ``path`` is not a dir only we can write ("" when it is). The login node made each probe
    dir 0700; one owned or writable by someone else is not it, and is never written into."""
    try:
        st = os.lstat(path)
    except OSError:
        return ""  # not there (a dir the node does not share): the reads and writes say so
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        return "the probe dir is not a private dir of this user (another user's?): not written to"
    return ""


def check_dir(entry: dict[str, Any], key: str, node_token: str) -> dict[str, Any]:
    """Read the login node's token from one probe dir, then leave ours for it to read."""
    path = str(entry["path"])
    out: dict[str, Any] = {"name": entry["name"], "path": path, "seen": False, "written": False, "error": ""}
    refused = _own_private_dir(path)
    if refused:
        out["error"] = refused
        return out
    # Never mkdir here: a missing dir must stay missing, not become a node-local copy.
    try:
        with open(os.path.join(path, LOGIN_TOKEN)) as fh:
            out["seen"] = fh.read().strip() == entry["token"]
        if not out["seen"]:
            out["error"] = "the login node's test file holds something else (another filesystem at this path?)"
    except OSError as e:
        out["error"] = f"cannot read the login node's test file: {e.strerror}"
    try:
        _write_atomic(os.path.join(path, f"node-{key}.token"), node_token)
        out["written"] = True
    except OSError as e:
        out["error"] = (out["error"] + "; " if out["error"] else "") + f"cannot write here: {e.strerror}"
    return out


def _dir_facts(path: str) -> dict[str, Any]:
    """A scratch candidate: is it a dir, private to us, writable, and how much room it has."""
    facts: dict[str, Any] = {"path": path, "exists": False, "private": False, "writable": False, "free_bytes": None}
    if not path:
        return facts
    try:
        st = os.stat(path)
    except OSError:
        return facts
    facts["exists"] = stat.S_ISDIR(st.st_mode)
    facts["private"] = facts["exists"] and st.st_uid == os.geteuid() and not st.st_mode & 0o022
    facts["writable"] = facts["exists"] and os.access(path, os.W_OK | os.X_OK)
    with contextlib.suppress(OSError):
        facts["free_bytes"] = shutil.disk_usage(path).free
    return facts


def scratch() -> dict[str, Any]:
    """Node-local scratch as the launcher sees it, and the base it would choose."""
    env = os.environ
    out: dict[str, Any] = {
        "slurm_tmpdir": _dir_facts(env.get("SLURM_TMPDIR", "")),
        "tmpdir": _dir_facts(env.get("TMPDIR", "")),
        "node_tmpdir": _dir_facts(env.get("DETSLURM_NODE_TMPDIR", "")),
        "chosen": None,
    }
    try:
        # The launcher's own choice, where detslurm is installed on the node.
        from detslurm.exec.workdir import choose_base

        out["chosen"] = _dir_facts(str(choose_base(env)))
    except Exception:  # detslurm missing or broken: the report says so elsewhere
        pass
    return out


def detslurm_info() -> dict[str, Any]:
    try:
        import detslurm

        return {"version": str(getattr(detslurm, "__version__", "?")), "error": "", "path": str(detslurm.__file__)}
    except Exception as e:  # any failure to import is what we report, whatever its type
        return {"version": None, "error": f"{type(e).__name__}: {e}"[:OUTPUT_LIMIT], "path": ""}


def gpus() -> dict[str, Any]:
    env = os.environ
    # CUDA_VISIBLE_DEVICES is what Slurm's gres plugin assigned; nvidia-smi is what the driver sees.
    smi = _run(["nvidia-smi", "-L"])
    lines = [ln for ln in smi["out"].splitlines() if ln.startswith("GPU ")] if smi["rc"] == 0 else []
    return {
        "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES"),
        "slurm_job_gpus": env.get("SLURM_JOB_GPUS") or env.get("SLURM_STEP_GPUS"),
        "nvidia_smi": lines,
        "nvidia_smi_error": smi["error"] or ("" if smi["rc"] == 0 else smi["out"]),
    }


def container(runtime: str, image: str) -> dict[str, Any]:
    """``<runtime> --version``, and a test image run when one is named."""
    # Same keys in every branch: the login side reads one fixed layout.
    if runtime == "none":
        return {"runtime": runtime, "version": None, "error": "", "image": image, "image_ok": None, "image_error": ""}
    if runtime == "pyxis":
        # Pyxis is a SPANK plugin of srun: present when srun knows --container-image.
        res = _run(["srun", "--help"])
        version = "pyxis" if "--container-image" in res["out"] else None
        error = "" if version else (res["error"] or "srun has no --container-image (pyxis not loaded)")
        test = ["srun", "--ntasks=1", f"--container-image={image}", "true"]
    else:
        res = _run([runtime, "--version"])
        version = res["out"].splitlines()[0] if res["rc"] == 0 and res["out"] else None
        error = "" if version else (res["error"] or res["out"] or f"{runtime} --version failed")
        test = [runtime, "exec", image, "true"]
    out = {"runtime": runtime, "version": version, "error": error, "image": image, "image_ok": None, "image_error": ""}
    if image and version:
        # Pulling an image can take minutes on a cold node.
        img = _run(test, timeout=300)
        out["image_ok"] = img["rc"] == 0
        out["image_error"] = "" if img["rc"] == 0 else (img["error"] or img["out"])
    return out


def probe(config: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The report and the exit code for one probe config (see the module docstring)."""
    pool, key = str(config["pool"]), str(config["key"])
    # Fresh per run: a file left by an earlier probe can never pass for this one's.
    node_token = secrets.token_hex(16)
    dirs = [check_dir(entry, key, node_token) for entry in config["dirs"]]
    bits = 0
    for i, d in enumerate(dirs):
        bits |= (0 if d["seen"] else 1 << (2 * i)) | (0 if d["written"] else 1 << (2 * i + 1))
    report = {
        "version": 1,
        "pool": pool,
        "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
        "job_id": os.environ.get("SLURM_JOB_ID", ""),
        "node_token": node_token,
        "dirs": dirs,
        "python": {"version": sys.version.split()[0], "executable": sys.executable},
        "detslurm": detslurm_info(),
        "scratch": scratch(),
        "gpus": gpus(),
        "container": container(str(config.get("runtime", "none")), str(config.get("image") or "")),
    }
    return report, (EXIT_BASE + bits if bits else 0)


def main(argv: list[str]) -> int:
    # The config is the one argument the batch script passes (login-side JSON, quoted there).
    config = json.loads(argv[0])
    report, code = probe(config)
    text = json.dumps(report)
    for d in config["dirs"]:
        # A dir not writable here (or not ours) is skipped: the bits in the exit code say so.
        if _own_private_dir(str(d["path"])):
            continue
        with contextlib.suppress(OSError):
            _write_atomic(os.path.join(str(d["path"]), f"report-{config['key']}.json"), text)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
