"""The dashboard's web server: a Starlette app serving the page, its assets (shipped in the
package: no CDN, works offline) and JSON read through :mod:`detslurm.dashboard.queries`.

Security: bound to a loopback address only; every request needs the token printed once at start
(the first visit's ``?token=`` becomes a cookie); a request whose Host header is not a loopback
name is refused (a web page elsewhere cannot reach the server by DNS rebinding); actions
(pause/activate/kill) exist only with ``allow_actions`` and need a POST carrying the token in a
header, which a cross-site form cannot send.
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from detslurm import views
from detslurm.dashboard import guard, queries
from detslurm.dashboard import logs as logs_mod
from detslurm.errors import DetSlurmError, NotFoundError
from detslurm.expconf.view import ConfigView
from detslurm.identity import Scope
from detslurm.slurm.client import SlurmCommandError, SlurmUnavailable
from detslurm.store import Store

STATIC = Path(__file__).parent / "static"
TOKEN_HEADER = "x-detslurm-token"
ACTIONS = ("pause", "activate", "kill")
# Defense in depth around the page: scripts only from the dashboard itself (text from trials is
# never HTML, and even so nothing injected could run), and no framing by another page (an
# invisible frame over the action buttons could be clicked by a user who never meant to).
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def new_token() -> str:
    return secrets.token_urlsafe(32)


@dataclass
class Sources:
    """What the server reads besides the store, injected so tests can pass fakes: the Slurm
    queue (rows as `det job list --json` has them), the pools (`det rp list --json`), and the
    experiment actions (None: read-only)."""

    jobs: Callable[[], list[dict[str, Any]]]
    pools: Callable[[], list[dict[str, Any]]]
    act: Callable[[str, int], None] | None = None
    # What every `det` read does first: pause the caller's local experiments whose driver has
    # ended (cli/undriven.py), so that the page never shows one ACTIVE with nothing behind it.
    settle: Callable[[], None] = lambda: None


@dataclass
class Dashboard:
    """One running dashboard: whose experiments it shows (``scope``), its token, and the cookie
    name the token travels in after the first visit."""

    store: Store
    scope: Scope
    token: str
    sources: Sources
    cookie: str = "detslurm_token"


def _plain(obj: Any) -> Any:
    # Slow path only: a non-finite float (a trial's hparam, an inf metric) is not JSON.
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def json_response(data: Any, status: int = 200) -> Response:
    # Compact separators: a 1000-trial curve set is ~100k numbers, and every byte is parsed twice.
    if is_dataclass(data) and not isinstance(data, type):
        data = asdict(data)
    elif isinstance(data, list):
        data = [asdict(d) if is_dataclass(d) and not isinstance(d, type) else d for d in data]
    try:
        body = json.dumps(data, allow_nan=False, default=str, separators=(",", ":"))
    except ValueError:
        body = json.dumps(_plain(data), allow_nan=False, default=str, separators=(",", ":"))
    return Response(body, status_code=status, media_type="application/json")


class Guard:
    """ASGI middleware in front of everything (page, assets, JSON): loopback Host and token."""

    def __init__(self, app: Any, d: Dashboard) -> None:
        self.app = app
        self.d = d

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            request = Request(scope)
            # The query form is what the printed URL carries; the cookie is what every later
            # request (assets, fetches) carries once the first one set it.
            given = (request.query_params.get("token", ""), request.cookies.get(self.d.cookie, ""))
            problem = guard.problem(request.headers.get("host", ""), self.d.token, *given, what="det dashboard")
            if problem:
                await PlainTextResponse(problem, status_code=403)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _errors(fn: Callable[[Request], Response]) -> Callable[[Request], Response]:
    def wrapped(request: Request) -> Response:
        try:
            return fn(request)
        except NotFoundError as e:
            return json_response({"error": str(e)}, 404)
        except (DetSlurmError, ValueError) as e:
            return json_response({"error": str(e)}, 400)

    return wrapped


def _int(request: Request, name: str) -> int:
    raw = request.path_params.get(name, request.query_params.get(name, ""))
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def build_app(d: Dashboard) -> Any:
    """The ASGI app. Handlers are sync functions, which Starlette runs in its thread pool (the
    store API is synchronous); each opens one short read transaction."""

    def route(path: str, fn: Callable[[Request], Response], methods: tuple[str, ...] = ("GET",)) -> Route:
        return Route(path, _errors(fn), methods=list(methods))

    app = Starlette(
        routes=[
            Route("/", _index_handler(d)),
            Mount("/static", app=StaticFiles(directory=str(STATIC)), name="static"),
            route("/api/experiments", lambda r: _experiments(d)),
            route("/api/experiments/{exp_id}", lambda r: _experiment(d, _int(r, "exp_id"))),
            route("/api/experiments/{exp_id}/curves", lambda r: _curves(d, r, _int(r, "exp_id"), None)),
            route("/api/trials/{trial_id}", lambda r: _trial(d, _int(r, "trial_id"))),
            route("/api/trials/{trial_id}/curves", lambda r: _trial_curves(d, r)),
            route("/api/trials/{trial_id}/logs", lambda r: _logs(d, r)),
            route("/api/queue", lambda r: _from_slurm(d.sources.jobs)),
            route("/api/pools", lambda r: _from_slurm(d.sources.pools)),
            route("/api/experiments/{exp_id}/{action}", lambda r: _act(d, r), methods=("POST",)),
        ]
    )
    return Guard(app, d)


def _index_handler(d: Dashboard) -> Callable[[Request], Awaitable[Response]]:
    async def index(request: Request) -> Response:
        if "token" in request.query_params:
            # The token moves from the URL into a cookie, and the address bar (history, screen
            # shares) no longer shows it.
            return RedirectResponse(
                "/", status_code=303, headers={"Set-Cookie": guard.cookie_header(d.cookie, d.token)}
            )
        html = (STATIC / "index.html").read_text()
        # The page's scripts send the token in a header for POSTs (actions): put it in the page,
        # which only a holder of the token can load.
        meta = json.dumps({"token": d.token, "actions": d.sources.act is not None})
        page = html.replace("__DETSLURM_CONFIG__", meta.replace("<", "\\u003c"))
        return HTMLResponse(page, headers=PAGE_HEADERS)

    return index


def _experiments(d: Dashboard) -> Response:
    d.sources.settle()
    with d.store.read() as s:
        return json_response(queries.experiments(s, d.scope))


def _experiment(d: Dashboard, exp_id: int) -> Response:
    d.sources.settle()
    with d.store.read() as s:
        exp = views.get_experiment(s, exp_id, d.scope)
        summary = next((e for e in queries.experiments(s, d.scope) if e.id == exp_id), None)
        trials = queries.trial_rows(s, exp_id, d.scope)
        body = {
            "experiment": asdict(summary) if summary else views.experiment_dict(exp),
            "description": exp.description,
            "error": exp.error_message,
            "trials": [asdict(t) for t in trials],
            "rungs": [asdict(r) for r in queries.rungs(s, exp_id, d.scope)],
            "metric_names": queries.metric_names(s, exp_id),
            "hparam_names": sorted({k for t in trials for k in t.hparams}),
            "actions": d.sources.act is not None,
        }
    return json_response(body)


def _curves(d: Dashboard, request: Request, exp_id: int, trial_id: int | None) -> Response:
    group = request.query_params.get("group", "validation")
    metric = request.query_params.get("metric", "")
    with d.store.read() as s:
        return json_response(queries.curves(s, exp_id, d.scope, group, metric, trial_id))


def _trial_curves(d: Dashboard, request: Request) -> Response:
    trial_id = _int(request, "trial_id")
    with d.store.read() as s:
        exp_id = views.get_trial(s, trial_id, d.scope).experiment_id
    return _curves(d, request, exp_id, trial_id)


def _trial(d: Dashboard, trial_id: int) -> Response:
    with d.store.read() as s:
        t = views.get_trial(s, trial_id, d.scope)
        runs = [views.run_dict(r) for r in views.runs(s, trial_id)]
        body: dict[str, Any] = {
            "trial": views.trial_dict(s, t),
            "experiment": {
                "id": t.experiment_id,
                "name": t.experiment.name,
                "metric": ConfigView(t.experiment.config).searcher.metric or None,
            },
            "runs": runs,
            "checkpoints": queries.checkpoints(s, trial_id, d.scope),
            "metric_names": queries.metric_names(s, t.experiment_id, trial_id),
        }
    # Pending reasons come from the queue, not the store: only a job still in Slurm has one.
    queued = _queued(d) if any(r["job_id"] and r["state"] in ("QUEUED", "RUNNING") for r in runs) else {}
    for r in runs:
        j = queued.get(r["job_id"] or "")
        r["slurm_state"] = j["state"] if j else None
        r["pending_reason"] = j["reason"] if j else None
    return json_response(body)


NO_SLURM = (
    "No Slurm cluster is configured on this machine ({why}), so there is no queue and there are no "
    "pools to show; experiments run with `det e create --local` are shown all the same."
)


def _no_slurm(e: DetSlurmError) -> str | None:
    """Why there is no Slurm to ask here (no commands, no configuration), or None when there is
    one (a slurmctld that is down is an error the page shows as such)."""
    if isinstance(e, SlurmUnavailable):
        return str(e).partition(":")[0]  # "squeue not found"
    if isinstance(e, SlurmCommandError) and e.not_configured:
        return f"{e.argv[0]}: {e.stderr.splitlines()[-1].split('fatal: ')[-1]}"
    return None


def _from_slurm(read: Callable[[], list[dict[str, Any]]]) -> Response:
    """The queue's or the pools' rows as ``{"rows": [...], "notice": ...}``. Without a Slurm
    cluster (local mode on a laptop) the rows are empty and the notice says why, with HTTP 200:
    the page shows the notice where the table would be and everything else keeps working."""
    try:
        return json_response({"rows": read(), "notice": None})
    except DetSlurmError as e:
        why = _no_slurm(e)
        if why is None:
            raise
        return json_response({"rows": [], "notice": NO_SLURM.format(why=why)})


def _queued(d: Dashboard) -> dict[str, dict[str, Any]]:
    # One squeue for the page (through the same code as `det job list`), not one per run.
    try:
        return {str(j["id"]): j for j in d.sources.jobs()}
    except DetSlurmError:
        # Slurm unreachable (slurmctld restarting): the trial page still shows the store's view.
        return {}


def _logs(d: Dashboard, request: Request) -> Response:
    trial_id = _int(request, "trial_id")
    rank = request.query_params.get("rank", "")
    with d.store.read() as s:
        views.get_trial(s, trial_id, d.scope)
        paths = [r.log_path for r in views.runs(s, trial_id)]
    # The cursor comes back from the page: a forged one can only make us read this trial's own
    # log files from another offset (the paths come from the store, never from the request).
    cursor = logs_mod.Cursor.parse(request.query_params.get("cursor", ""))
    chunk = logs_mod.read(paths, cursor, int(rank) if rank.strip() else None)
    return json_response(chunk)


def _act(d: Dashboard, request: Request) -> Response:
    action = request.path_params["action"]
    if d.sources.act is None:
        return json_response({"error": "actions are off: start `det dashboard --allow-actions`"}, 403)
    # The cookie alone is not enough for a change: a page elsewhere could make the browser POST
    # with it. The header can only be set by the dashboard's own script.
    if not guard.token_ok(d.token, request.headers.get(TOKEN_HEADER, "")):
        return json_response({"error": "actions need the token header"}, 403)
    if action not in ACTIONS:
        return json_response({"error": f"unknown action {action!r} (one of {', '.join(ACTIONS)})"}, 404)
    d.sources.act(action, _int(request, "exp_id"))
    return json_response({"ok": True, "action": action})
