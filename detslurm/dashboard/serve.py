"""Running a local web server the safe way, shared by `det dashboard` and `det tensorboard`:
a socket bound to a loopback address only (never 0.0.0.0), the URL printed once, and, when
started by remote mode over SSH, an exit when the laptop's side goes away (stdin closes)."""

from __future__ import annotations

import os
import socket
import sys
import threading
from collections.abc import Callable

from detslurm.errors import DetSlurmError

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# Remote mode reads this line from the login node's output to learn which port to forward
# (detslurm.cli.remote.forward); keep it as is.
URL_PREFIX = "Open "


class BindError(DetSlurmError):
    pass


def check_host(host: str) -> str:
    """The address to bind: loopback only. Anything else (0.0.0.0, a hostname, an interface
    address) is refused: the server shows experiment data to whoever can reach it."""
    if host not in LOOPBACK_HOSTS:
        raise BindError(
            f"--host {host}: the server binds only to 127.0.0.1 or ::1 (it serves your experiments' data); "
            "to open it from another machine, forward the port over SSH (det -m ssh://login ...)"
        )
    return "::1" if host == "::1" else "127.0.0.1"


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host``:``port`` (0: any free port)."""
    addr = check_host(host)
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # A restarted dashboard may take its old --port again at once (TIME_WAIT sockets).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((addr, port))
    except OSError as e:
        sock.close()
        raise BindError(f"cannot listen on {addr}:{port}: {e.strerror or e}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket, path: str) -> str:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}{path}"


def exit_on_stdin_eof(stop: Callable[[], None]) -> None:
    """Call ``stop`` when stdin reaches EOF (the SSH channel of remote mode closed)."""

    def watch() -> None:
        # Whatever arrives on stdin is ignored; only its end matters.
        try:
            while os.read(sys.stdin.fileno(), 4096):
                pass
        except OSError:
            pass
        stop()

    threading.Thread(target=watch, daemon=True, name="stdin-eof").start()
