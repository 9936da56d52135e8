"""SSH connections: a chain of hops (bastions, then the login node), strict host keys,
authentication by agent, identity files and keyboard-interactive. What runs over a connection
is streamed by channel.py."""

from __future__ import annotations

import contextlib
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click
import paramiko

from detslurm.cli.remote import sshconf
from detslurm.cli.remote.target import RemoteError, Target

CONNECT_TIMEOUT_S = 20.0
# Once the TCP connection is up, how long the server gets for its banner and the key exchange.
# paramiko's default is 15 s each; a busy login node or bastion (sshd forking under load, slow
# PAM) can take longer, and OpenSSH's client waits as long as the connection lives.
HANDSHAKE_TIMEOUT_S = 60.0
Prompt = Callable[[str, bool], str]


def tty_prompt(text: str, echo: bool) -> str:
    """Ask the user (a second factor, a passphrase): on the terminal when there is one, else one
    line of stdin, so scripted logins and tests can answer too."""
    # A terminal gets a hidden prompt; a pipe (a script, a test, the holder's inherited stdin
    # when the user pipes a code in) is read as one plain line, without getpass's /dev/tty dance.
    if sys.stdin is not None and sys.stdin.isatty():
        return str(click.prompt(text.rstrip(": "), hide_input=not echo, default="", show_default=False, err=True))
    click.echo(text, err=True, nl=False)
    line = sys.stdin.readline() if sys.stdin is not None else ""
    return line.rstrip("\n")


def _first_sock(hop: sshconf.Hop) -> Any:
    # Only the first hop has its own socket; later hops ride a channel of the previous one.
    if hop.proxy_command:
        return paramiko.ProxyCommand(hop.proxy_command)
    try:
        return socket.create_connection((hop.hostname, hop.port), timeout=CONNECT_TIMEOUT_S)
    except OSError as e:
        raise RemoteError(f"cannot reach {hop.alias} ({hop.hostname}:{hop.port}): {e.strerror or e}") from None


def _through(prev: paramiko.Transport, prev_hop: sshconf.Hop, hop: sshconf.Hop) -> paramiko.Channel:
    try:
        return prev.open_channel("direct-tcpip", (hop.hostname, hop.port), ("127.0.0.1", 0))
    except (paramiko.SSHException, OSError) as e:
        raise RemoteError(
            f"bastion {prev_hop.alias} could not open a connection to {hop.hostname}:{hop.port} (ProxyJump): {e}"
        ) from None


def _keys(hop: sshconf.Hop, prompt: Prompt) -> list[paramiko.PKey]:
    keys: list[paramiko.PKey] = []
    if not hop.identities_only:
        # No agent, or it refused: the identity files may still do.
        with contextlib.suppress(paramiko.SSHException):
            keys += list(paramiko.Agent().get_keys())
    # Agent keys first, as ssh does: they need no passphrase, and a key on disk that the agent
    # already holds would only cost a prompt.
    for path in hop.identity_files:
        if path.is_file():
            keys.append(_load_key(path, prompt))
    return keys


def _load_key(path: Path, prompt: Prompt) -> paramiko.PKey:
    try:
        return paramiko.PKey.from_path(str(path))
    except paramiko.PasswordRequiredException:
        try:
            return paramiko.PKey.from_path(str(path), passphrase=prompt(f"Passphrase for {path}: ", False))
        except paramiko.SSHException as e:
            raise RemoteError(f"{path}: cannot unlock the key: {e}") from None
    except (OSError, paramiko.SSHException, ValueError) as e:
        raise RemoteError(f"{path}: cannot read the SSH key: {e}") from None


def _kbd_handler(prompt: Prompt) -> Callable[[str, str, Sequence[tuple[str, bool]]], list[str]]:
    def handler(title: str, instructions: str, prompts: Sequence[tuple[str, bool]]) -> list[str]:
        if (title or instructions) and prompts:
            click.echo("\n".join(s for s in (title, instructions) if s), err=True)
        return [prompt(text, echo) for text, echo in prompts]

    return handler


def authenticate(t: paramiko.Transport, hop: sshconf.Hop, prompt: Prompt) -> None:
    """Public keys (agent, then identity files); then keyboard-interactive, the two-factor step
    of most HPC logins, which may also come after a key as a partial success."""
    allowed: list[str] | None = None
    for key in _keys(hop, prompt):
        try:
            rest = t.auth_publickey(hop.user, key)
        except paramiko.BadAuthenticationType as e:
            allowed = list(e.allowed_types)
            break
        except paramiko.AuthenticationException:
            continue
        if t.is_authenticated():
            return
        allowed = list(rest)  # partial success: the server wants a second method
        break
    if allowed is None:
        # No key was even tried: "none" auth is how a client learns which methods the server takes.
        try:
            t.auth_none(hop.user)
            return
        except paramiko.BadAuthenticationType as e:
            allowed = list(e.allowed_types)
        except paramiko.AuthenticationException:
            allowed = []
    if "keyboard-interactive" in allowed:
        try:
            t.auth_interactive(hop.user, _kbd_handler(prompt))
        except paramiko.AuthenticationException as e:
            raise RemoteError(f"{hop.user}@{hop.alias}: keyboard-interactive login refused: {e}") from None
        if t.is_authenticated():
            return
    raise RemoteError(
        f"{hop.user}@{hop.alias}: authentication failed (tried the SSH agent and "
        f"{', '.join(str(p) for p in hop.identity_files if p.is_file()) or 'no identity file'}; "
        f"the server accepts: {', '.join(allowed) or 'nothing we have'}). Check `ssh {hop.alias}` works."
    )


def open_hop(sock: Any, hop: sshconf.Hop, prompt: Prompt) -> paramiko.Transport:
    t = paramiko.Transport(sock)
    # The host key is checked before any credential is offered: a refused host never sees a
    # key signature or a second-factor code.
    opts = t.get_security_options()
    opts.key_types = sshconf.preferred_key_types(hop, tuple(opts.key_types))
    t.banner_timeout = t.handshake_timeout = HANDSHAKE_TIMEOUT_S
    try:
        t.start_client(timeout=HANDSHAKE_TIMEOUT_S)
    except (paramiko.SSHException, OSError, EOFError) as e:
        t.close()
        raise RemoteError(f"SSH handshake with {hop.alias} ({hop.hostname}:{hop.port}) failed: {e}") from None
    try:
        sshconf.check_host_key(hop, t.get_remote_server_key())
        authenticate(t, hop, prompt)
    except BaseException:
        t.close()
        raise
    t.set_keepalive(30)
    return t


class Connection:
    """An authenticated chain of transports; the last one reaches the login node."""

    def __init__(self, transports: list[paramiko.Transport], login: str) -> None:
        self.transports = transports
        self.login = login

    @property
    def transport(self) -> paramiko.Transport:
        return self.transports[-1]

    def open_exec(self, command: str) -> paramiko.Channel:
        chan = self.transport.open_session()
        chan.exec_command(command)
        return chan

    def open_tcp(self, port: int, host: str = "127.0.0.1") -> paramiko.Channel:
        """A connection to the login node's loopback ``host``:``port`` (what `ssh -L` opens)."""
        if host not in ("127.0.0.1", "::1"):
            raise RemoteError(f"port forwards go to the login node's loopback only, not {host}")
        try:
            return self.transport.open_channel("direct-tcpip", (host, port), ("127.0.0.1", 0))
        except (paramiko.SSHException, OSError) as e:
            raise RemoteError(f"{self.login}: cannot open a connection to its port {port}: {e}") from None

    def open_sftp(self) -> paramiko.Channel:
        """A channel running the login node's SFTP subsystem, or a RemoteError that says how to
        do without one (an sshd configured without `Subsystem sftp` refuses the request)."""
        chan = self.transport.open_session()
        try:
            chan.invoke_subsystem("sftp")
        except (paramiko.SSHException, EOFError, OSError):
            chan.close()
            raise RemoteError(no_sftp(self.login)) from None
        return chan

    def sftp(self) -> paramiko.SFTPClient:
        return paramiko.SFTPClient(self.open_sftp())

    def close(self) -> None:
        for t in reversed(self.transports):
            t.close()


def no_sftp(login: str) -> str:
    return (
        f"{login}: its sshd offers no SFTP subsystem, which remote mode needs to upload contexts "
        "and download checkpoints. Ask the cluster's admins to enable it (`Subsystem sftp "
        "internal-sftp` in sshd_config), or work on the login node itself: copy the context there "
        "(rsync or git) and run det in an SSH session"
    )


def connect(target: Target, prompt: Prompt = tty_prompt) -> Connection:
    """Connect through every ProxyJump bastion to the login node and authenticate at each."""
    hops = sshconf.resolve_chain(target)
    transports: list[paramiko.Transport] = []
    try:
        for i, hop in enumerate(hops):
            sock = _first_sock(hop) if i == 0 else _through(transports[-1], hops[i - 1], hop)
            transports.append(open_hop(sock, hop, prompt))
    except BaseException:
        for t in reversed(transports):
            t.close()
        raise
    return Connection(transports, f"{hops[-1].user}@{hops[-1].alias}")
