"""A dashboard running in a background thread, for tests and benchmarks (as click.testing is
for commands): the real server on a free loopback port, stopped on exit."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from detslurm.dashboard.serve import bind, url_of
from detslurm.dashboard.server import Dashboard, Sources, build_app, new_token
from detslurm.identity import Scope
from detslurm.store import Store


def no_slurm() -> Sources:
    """Sources for a store without a cluster: an empty queue and no pools."""
    return Sources(jobs=list, pools=list)


@contextlib.contextmanager
def running_dashboard(
    store: Store, sources: Sources | None = None, scope: Scope | None = None
) -> Iterator[tuple[str, str]]:
    """Yields (base URL, Cookie header value that carries the token)."""
    import uvicorn

    token = new_token()
    d = Dashboard(store, scope or Scope.mine(), token, sources or no_slurm())
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(build_app(d), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    # uvicorn binds nothing itself (the socket is ours); "started" means it serves requests.
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield url_of(sock, ""), f"{d.cookie}={token}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
