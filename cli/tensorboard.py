"""`det tensorboard start EXP_ID... | --trial ID...`: TensorBoard (from PyPI) on the trials'
event files, bound to 127.0.0.1 behind the dashboard's token and Host check, its URL printed
(remote mode forwards the port)."""

from __future__ import annotations

import importlib.util
import secrets
import socket
import threading
from pathlib import Path
from typing import Any

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
    """Start TensorBoard on experiments' (or trials') metrics; prints its URL (with its access
    token); Ctrl-C stops it."""
    from detslurm.dashboard import serve

    if not exp_ids and not trial_ids:
        raise click.UsageError("name an experiment (det tensorboard start EXP_ID) or a trial (--trial ID)")
    serve.check_host(host)
    if importlib.util.find_spec("tensorboard") is None:
        raise DetSlurmError("TensorBoard is not installed here: pip install 'detslurm[tensorboard]'")
    dirs = trial_dirs(app, exp_ids, trial_ids)
    if not dirs:
        raise DetSlurmError("no trials yet: nothing for TensorBoard to show")
    spec = logdir_spec(dirs)
    # The port is ours before its URL is printed (no one can take it in between), and TensorBoard
    # runs in this process behind the dashboard's guard: token and loopback Host.
    sock = serve.bind(host, port)
    server = GuardedServer(sock, secrets.token_urlsafe(32))
    click.echo(f"{serve.URL_PREFIX}{serve.url_of(sock, '/?token=' + server.token)}")
    click.echo(f"TensorBoard on {len(dirs)} trial(s); Ctrl-C stops it.")
    if exit_on_eof:
        # Remote mode: the laptop going away closes our stdin; TensorBoard must stop with it.
        serve.exit_on_stdin_eof(server.stop)
    server.run(spec)


class GuardedServer:
    """TensorBoard's WSGI app (built by TensorBoard's own program, with a server of ours through
    its ``server_class`` hook) on a socket we bound, behind :class:`WsgiGuard`."""

    def __init__(self, sock: socket.socket, token: str) -> None:
        self.sock, self.token = sock, token
        self.cookie = f"detslurm_tb_{sock.getsockname()[1]}"
        self.httpd: Any = None
        self.stopped = threading.Event()

    def run(self, spec: str) -> None:
        from tensorboard import program

        tb = program.TensorBoard(server_class=self._server)
        tb.configure(argv=[None, "--logdir_spec", spec, "--reload_interval", "5"])
        code = tb.main()
        if code:
            raise DetSlurmError(f"TensorBoard exited with code {code}")

    def stop(self) -> None:
        self.stopped.set()
        if self.httpd is not None:
            self.httpd.shutdown()

    def _server(self, wsgi_app: Any, flags: Any) -> Any:
        from tensorboard import program
        from werkzeug.serving import WSGIRequestHandler, make_server

        from detslurm.dashboard.guard import WsgiGuard
        from detslurm.dashboard.serve import url_of

        outer = self

        class Quiet(WSGIRequestHandler):
            def log_request(self, *args: Any, **kwargs: Any) -> None:
                pass  # one line per request would bury the URL line

        class Server(program.TensorBoardServer):  # type: ignore[misc]
            def __init__(self) -> None:
                host, port = outer.sock.getsockname()[:2]
                guarded = WsgiGuard(wsgi_app, outer.token, outer.cookie, "det tensorboard start")
                fd = outer.sock.fileno()
                outer.httpd = make_server(host, port, guarded, threaded=True, request_handler=Quiet, fd=fd)

            def serve_forever(self) -> None:
                if not outer.stopped.is_set():
                    outer.httpd.serve_forever()

            def get_url(self) -> str:
                return url_of(outer.sock, "/")

            def print_serving_message(self) -> None:
                pass  # det printed the URL, with its token

        return Server()
