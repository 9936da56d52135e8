"""~/.ssh/config resolution and strict host-key checking (paramiko imported here only).

What is honoured: Host aliases, HostName, User, Port, IdentityFile, IdentitiesOnly, ProxyJump
(a comma-separated chain of bastions), ProxyCommand, UserKnownHostsFile, GlobalKnownHostsFile,
HostKeyAlias. StrictHostKeyChecking is deliberately not: an unknown or changed host key is
always refused, with its fingerprint and the known_hosts line to add after checking it.
"""

from __future__ import annotations

import base64
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paramiko

from detslurm import settings
from detslurm.cli.remote.target import RemoteError, Target

_DEFAULT_IDENTITIES = ("id_ed25519", "id_ecdsa", "id_rsa")


@dataclass(frozen=True)
class Hop:
    """One SSH connection to make: a bastion or the login node itself, fully resolved."""

    alias: str  # the name the user wrote (for messages)
    hostname: str
    port: int
    user: str
    identity_files: tuple[Path, ...]
    identities_only: bool
    known_hosts: tuple[Path, ...]
    host_key_alias: str | None
    proxy_command: str | None

    @property
    def key_name(self) -> str:
        """The host's name in known_hosts: ``host`` on port 22, else ``[host]:port``."""
        name = self.host_key_alias or self.hostname
        return name if self.port == 22 or self.host_key_alias else f"[{name}]:{self.port}"


def ssh_dir() -> Path:
    return Path(os.path.expanduser("~")) / ".ssh"


def load_config() -> paramiko.SSHConfig:
    path = settings.SSH_CONFIG.get() or ssh_dir() / "config"
    if not path.is_file():
        return paramiko.SSHConfig()
    try:
        return paramiko.SSHConfig.from_path(str(path))
    except (OSError, paramiko.ConfigParseError) as e:
        raise RemoteError(f"{path}: cannot read the SSH config: {e}") from None


def _files(value: Any) -> list[Path]:
    items = value if isinstance(value, list) else str(value).split()
    return [Path(os.path.expanduser(str(v))) for v in items if str(v).lower() != "none"]


def resolve_hop(cfg: paramiko.SSHConfig, host: str, user: str | None, port: int | None) -> tuple[Hop, str | None]:
    """One host through the SSH config; returns the hop and its ProxyJump value (if any)."""
    opts = cfg.lookup(host)
    try:
        port_n = port or int(opts.get("port", 22))
    except ValueError:
        raise RemoteError(f"SSH config: Port for {host} is not a number: {opts.get('port')!r}") from None
    idents = _files(opts["identityfile"]) if "identityfile" in opts else []
    if not idents:
        idents = [ssh_dir() / n for n in _DEFAULT_IDENTITIES]
    known = _files(opts.get("userknownhostsfile", "")) or [ssh_dir() / "known_hosts"]
    # Sites often publish login-node keys system-wide; the user's file comes first, as with ssh.
    known += _files(opts.get("globalknownhostsfile", "/etc/ssh/ssh_known_hosts"))
    hop = Hop(
        alias=host,
        hostname=opts.get("hostname", host),
        port=port_n,
        user=user or opts.get("user") or _local_user(),
        identity_files=tuple(idents),
        identities_only=opts.get("identitiesonly", "no").lower() == "yes",
        known_hosts=tuple(known),
        host_key_alias=opts.get("hostkeyalias"),
        proxy_command=opts.get("proxycommand") if opts.get("proxycommand", "none") != "none" else None,
    )
    jump = opts.get("proxyjump")
    return hop, None if jump in (None, "none") else jump


def _local_user() -> str:
    import getpass

    return getpass.getuser()


def _split_jump(spec: str) -> tuple[str, str | None, int | None]:
    user, at, hostport = spec.rpartition("@")
    host, colon, port_s = hostport.partition(":")
    if colon and not port_s.isdigit():
        raise RemoteError(f"SSH config: ProxyJump {spec!r}: port {port_s!r} is not a number")
    return host, (user if at else None), (int(port_s) if colon else None)


def resolve_chain(target: Target) -> list[Hop]:
    """The hops to make, bastions first and the login node last (ProxyJump honoured)."""
    cfg = load_config()
    last, jump = resolve_hop(cfg, target.host, target.user, target.port)
    hops: list[Hop] = []
    if jump:
        # The chain is the login node's ProxyJump list; like OpenSSH, each bastion's own
        # settings (HostName, User, Port, IdentityFile) come from the config, not its ProxyJump.
        for spec in jump.split(","):
            host, user, port = _split_jump(spec.strip())
            hops.append(resolve_hop(cfg, host, user, port)[0])
    return [*hops, last]


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH's SHA256 fingerprint (what `ssh-keygen -lf` and ssh's prompt show)."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def known_keys(hop: Hop) -> dict[str, paramiko.PKey]:
    """Keys known for this hop, by type, from every known_hosts file that exists."""
    found: dict[str, paramiko.PKey] = {}
    for path in hop.known_hosts:
        if not path.is_file():
            continue
        hk = paramiko.HostKeys()
        try:
            hk.load(str(path))
        except (OSError, paramiko.SSHException) as e:
            raise RemoteError(f"{path}: cannot read known hosts: {e}") from None
        for ktype, key in (hk.lookup(hop.key_name) or {}).items():
            found.setdefault(ktype, key)
    return found


def check_host_key(hop: Hop, offered: paramiko.PKey) -> None:
    """Refuse unless known_hosts has exactly this key for the host (never accept silently)."""
    known = known_keys(hop)
    ktype = offered.get_name()
    line = f"{hop.key_name} {ktype} {offered.get_base64()}"
    where = ", ".join(str(p) for p in hop.known_hosts[:1])
    if ktype in known and known[ktype] == offered:
        return
    # Same type, other key: the dangerous case (OpenSSH's "REMOTE HOST IDENTIFICATION HAS
    # CHANGED"). Only other types known: still refused, a downgrade to an unchecked key type
    # is how an interceptor would get past us.
    if ktype in known:
        raise RemoteError(
            f"HOST KEY CHANGED for {hop.key_name} ({hop.alias}): known_hosts has {ktype} "
            f"{fingerprint(known[ktype])}, the server now offers {fingerprint(offered)}. Someone may be "
            "intercepting the connection, or the host was reinstalled; refusing to connect. If your site "
            f"confirms the new key, remove the old one with: ssh-keygen -R '{hop.key_name}' and add:\n{line}"
        )
    other = f" (known_hosts has only {', '.join(sorted(known))} for it)" if known else ""
    raise RemoteError(
        f"unknown host key for {hop.key_name} ({hop.alias}){other}: the server offers {ktype} "
        f"{fingerprint(offered)}. Refusing to connect to an unverified host. Check that fingerprint with "
        f"your site (ssh-keygen -lf on the host's key), then add this line to {where}:\n{line}"
    )


def preferred_key_types(hop: Hop, supported: tuple[str, ...]) -> tuple[str, ...]:
    """Ask first for the key types known_hosts has for the host, so that a server with several
    host keys offers the one we can check (as OpenSSH does)."""
    known = list(known_keys(hop))
    if "ssh-rsa" in known:
        known += ["rsa-sha2-512", "rsa-sha2-256"]
    first = [t for t in supported if t in known]
    return tuple(first + [t for t in supported if t not in first])
