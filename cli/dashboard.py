"""`det dashboard`: the web dashboard, on 127.0.0.1 with a token (see detslurm.dashboard)."""

from __future__ import annotations

from typing import Any

import click

from detslurm.cli.app import App, pass_app
from detslurm.errors import DetSlurmError


def _missing_extra(e: ImportError) -> DetSlurmError:
    return DetSlurmError(f"the dashboard needs its extra: pip install 'detslurm[dashboard]' ({e})")


def _sources(app: App, allow_actions: bool) -> Any:
    from detslurm.cli import job as job_mod
    from detslurm.cli import resource_pool as rp_mod
    from detslurm.dashboard.server import Sources

    # The queue and pools pages show exactly what `det job list` / `det rp list` show.
    def jobs() -> list[dict[str, Any]]:
        return job_mod.queue_rows(app, None)

    def pools() -> list[dict[str, Any]]:
        return rp_mod.pool_rows(app)

    def act(action: str, exp_id: int) -> None:
        # The same state changes as `det e pause/activate/kill` (a kill cancels the live jobs at
        # once); an activate is `--detach`'s: the daemon runs a Slurm experiment, nothing here waits.
        from detslurm.cli.state_change import Verb, change_state, log_echo

        change_state(app, Verb(action), exp_id, detach=True, echo=log_echo("detslurm.dashboard"))

    def settle() -> None:
        from detslurm.cli import undriven

        undriven.settle_undriven(app)

    return Sources(jobs=jobs, pools=pools, act=act if allow_actions else None, settle=settle)


@click.command(name="dashboard")
@click.option("--host", default="127.0.0.1", show_default=True, help="Loopback only: 127.0.0.1 or ::1.")
@click.option("-p", "--port", default=0, type=click.IntRange(0, 65535), help="Port (default: any free one).")
@click.option("--allow-actions", is_flag=True, help="Show pause/activate/kill buttons (read-only without).")
@click.option("--exit-on-eof", is_flag=True, hidden=True, help="Stop when stdin closes (remote mode).")
@pass_app
def dashboard(app: App, host: str, port: int, allow_actions: bool, exit_on_eof: bool) -> None:
    """Serve the web dashboard on localhost; prints its URL (with its access token) once."""
    from detslurm.dashboard import serve

    sock = serve.bind(host, port)
    try:
        import uvicorn

        from detslurm.dashboard.server import Dashboard, build_app, new_token
    except ImportError as e:
        sock.close()
        raise _missing_extra(e) from None
    token = new_token()
    # The cookie name carries the port: two dashboards on one machine (two stores, two users'
    # forwards) do not overwrite each other's token.
    d = Dashboard(app.store, app.scope, token, _sources(app, allow_actions), cookie=f"detslurm_{sock.getsockname()[1]}")
    server = uvicorn.Server(uvicorn.Config(build_app(d), log_level="warning", lifespan="off"))
    click.echo(f"{serve.URL_PREFIX}{serve.url_of(sock, '/?token=' + token)}", err=False)
    click.echo("(read-only; --allow-actions adds pause/activate/kill)" if not allow_actions else "(actions enabled)")
    click.echo("Ctrl-C stops it.", err=True)
    if exit_on_eof:
        serve.exit_on_stdin_eof(lambda: setattr(server, "should_exit", True))
    server.run(sockets=[sock])
