"""`det tensorboard start EXP_ID... | --trial ID...`: TensorBoard (from PyPI) on the trials'
event files, bound to 127.0.0.1, its URL printed (remote mode forwards the port)."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import click

from detslurm import views
from detslurm.cli.app import App, pass_app
from detslurm.errors import DetSlurmError
from detslurm.protocol import ExpPaths


@click.group(name="tensorboard")
def tensorboard() -> None:
    """Run TensorBoard on trials' metrics (localhost)."""


def trial_dirs(app: App, exp_ids: tuple[int, ...], trial_ids: tuple[int, ...]) -> dict[str, Path]:
    """Run name -> the trial's TensorBoard dir, for the experiments' trials and the trials named."""
    out: dict[str, Path] = {}
    with app.store.read() as s:
        trials = [t for e in exp_ids for t in views.get_experiment(s, e, app.scope).trials]
        trials += [views.get_trial(s, t, app.scope) for t in trial_ids]
        for t in trials:
            out[f"exp{t.experiment_id}_trial{t.id}"] = ExpPaths(Path(t.experiment.exp_dir)).trial_tensorboard(t.id)
    return out


def logdir_spec(dirs: dict[str, Path]) -> str:
    """TensorBoard's ``--logdir_spec NAME:PATH,...`` (each trial a named run)."""
    # TensorBoard splits the spec on commas and takes no escape: a comma in a path would name
    # another run, so it is refused rather than silently shown wrong.
    bad = [str(p) for p in dirs.values() if "," in str(p)]
    if bad:
        raise DetSlurmError(f"TensorBoard cannot take a path with a comma in --logdir_spec: {bad[0]}")
    return ",".join(f"{name}:{path}" for name, path in dirs.items())


def _free_port() -> int:
    from detslurm.dashboard.serve import bind

    with bind("127.0.0.1", 0) as s:
        return int(s.getsockname()[1])


@tensorboard.command("start")
@click.argument("exp_ids", nargs=-1, type=int)
@click.option("-t", "--trial", "trial_ids", multiple=True, type=int, help="A trial (repeat for more).")
@click.option("-p", "--port", default=0, type=click.IntRange(0, 65535), help="Port (default: any free one).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Loopback only: 127.0.0.1 or ::1.")
@click.option("--exit-on-eof", is_flag=True, hidden=True, help="Stop when stdin closes (remote mode).")
@pass_app
def start(
    app: App, exp_ids: tuple[int, ...], trial_ids: tuple[int, ...], port: int, host: str, exit_on_eof: bool
) -> None:
    """Start TensorBoard on experiments' (or trials') metrics; prints its URL; Ctrl-C stops it."""
    from detslurm.dashboard.serve import URL_PREFIX, check_host, exit_on_stdin_eof

    if not exp_ids and not trial_ids:
        raise click.UsageError("name an experiment (det tensorboard start EXP_ID) or a trial (--trial ID)")
    addr = check_host(host)
    if importlib.util.find_spec("tensorboard") is None:
        raise DetSlurmError("TensorBoard is not installed here: pip install 'detslurm[tensorboard]'")
    dirs = trial_dirs(app, exp_ids, trial_ids)
    if not dirs:
        raise DetSlurmError("no trials yet: nothing for TensorBoard to show")
    # TensorBoard cannot report which port it got for --port 0: pick a free one for it.
    port = port or _free_port()
    cmd = [sys.executable, "-m", "tensorboard.main", "--logdir_spec", logdir_spec(dirs), "--host", addr]
    cmd += ["--port", str(port), "--reload_interval", "5"]
    try:
        # stdin is ours (remote mode watches it); TensorBoard gets none.
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    except OSError as e:
        raise DetSlurmError(f"cannot start TensorBoard: {e}") from None
    shown = f"[{addr}]" if ":" in addr else addr
    click.echo(f"{URL_PREFIX}http://{shown}:{port}/")
    click.echo(f"TensorBoard on {len(dirs)} trial(s); Ctrl-C stops it.")
    if exit_on_eof:
        # Remote mode: the laptop going away closes our stdin; TensorBoard must stop with it.
        exit_on_stdin_eof(proc.terminate)
    code = _wait_stopping_on_signals(proc)
    if code not in (0, -15):
        raise DetSlurmError(f"TensorBoard exited with code {code}")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _wait_stopping_on_signals(proc: subprocess.Popen[bytes]) -> int:
    """TensorBoard's exit code; Ctrl-C, SIGTERM or SIGHUP to det stop TensorBoard first.

    Without the handlers a `kill` of det (or a closed terminal) left TensorBoard running on its
    port, orphaned (found in a CI run)."""
    old = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        try:
            return proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
