"""`det sdk-call` (hidden): the login node's side of the Python SDK over ssh://.

``Determined(master="ssh://login")`` on a laptop sends each read or change as one JSON request
on this command's stdin; it runs here with the caller's own session and prints the answer
(detslurm/client/_remote.py holds both sides of the exchange).
"""

from __future__ import annotations

import sys

import click

from detslurm.client._remote import COMMAND, serve
from detslurm.client._session import Session


@click.command(COMMAND, hidden=True)
def sdk_call() -> None:
    """Answer one SDK request (JSON on stdin) with JSON on stdout."""
    click.echo(serve(sys.stdin.read(), Session()))
