"""~/.ssh/config resolution and strict host-key checking (paramiko imported here only).

What is honoured: Host aliases, HostName, User, Port, IdentityFile, IdentitiesOnly, ProxyJump
(a comma-separated chain of bastions), ProxyCommand, UserKnownHostsFile, GlobalKnownHostsFile,
HostKeyAlias. StrictHostKeyChecking is deliberately not: an unknown or changed host key is
always refused, with its fingerprint and the known_hosts line to add after checking it.
"""

from __future__ import annotations

import base64
import binascii
import enum
import hashlib
import hmac
import os
import re
from dataclasses import dataclass, field
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


class Marker(enum.Enum):
    """What a known_hosts line says about its key (OpenSSH's sshd(8) "SSH_KNOWN_HOSTS FILE FORMAT")."""

    HOST = ""  # a plain line: this is the host's key
    CA = "@cert-authority"  # the key signs host certificates for these hosts
    REVOKED = "@revoked"  # this key must never be accepted


@dataclass
class KnownHosts:
    """Every known_hosts line that names one hop, grouped by what it says."""

    keys: list[paramiko.PKey] = field(default_factory=list)
    cas: list[paramiko.PKey] = field(default_factory=list)
    revoked: list[paramiko.PKey] = field(default_factory=list)

    def add(self, marker: Marker, key: paramiko.PKey) -> None:
        {Marker.HOST: self.keys, Marker.CA: self.cas, Marker.REVOKED: self.revoked}[marker].append(key)


def _glob(pattern: str) -> re.Pattern[str]:
    # Only * and ? are wildcards in OpenSSH patterns; "[" is literal (as in "[host]:port"),
    # which is why fnmatch (character classes) would not do.
    parts = (".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern.lower())
    return re.compile("".join(parts))


def _host_matches(patterns: str, name: str) -> bool:
    """OpenSSH's host field: comma-separated names, hashed names (|1|salt|hash), wildcards
    (* and ?) and negations (!pattern, which vetoes the line even when another one matches)."""
    hit = False
    for pat in patterns.split(","):
        if pat.startswith("|1|"):
            hit = hit or hmac.compare_digest(paramiko.HostKeys.hash_host(name, pat), pat)
            continue
        negated = pat.startswith("!")
        if _glob(pat[1:] if negated else pat).fullmatch(name.lower()):
            if negated:
                return False
            hit = True
    return hit


def _parse_line(line: str) -> tuple[Marker, str, paramiko.PKey] | None:
    """One known_hosts line, or None for comments, blank lines and lines we cannot use (an
    unknown marker or key type, bad base64): OpenSSH skips those too."""
    fields = line.split()
    if not fields or fields[0].startswith("#"):
        return None
    marker = Marker.HOST
    if fields[0].startswith("@"):
        known = {m.value: m for m in Marker if m.value}
        if fields[0] not in known:
            return None
        marker, fields = known[fields[0]], fields[1:]
    if len(fields) < 3:
        return None
    try:
        key = paramiko.PKey.from_type_string(fields[1], base64.b64decode(fields[2], validate=True))
    except (paramiko.SSHException, ValueError, TypeError, binascii.Error):
        return None
    return marker, fields[0], key


def known_hosts(hop: Hop) -> KnownHosts:
    """Every key known_hosts has for this hop (all lines of all files, not the first per type),
    with the CA and revoked ones apart."""
    found = KnownHosts()
    for path in hop.known_hosts:
        if not path.is_file():
            continue
        try:
            text = path.read_text(errors="replace")
        except OSError as e:
            raise RemoteError(f"{path}: cannot read known hosts: {e}") from None
        for line in text.splitlines():
            parsed = _parse_line(line)
            if parsed and _host_matches(parsed[1], hop.key_name):
                found.add(parsed[0], parsed[2])
    return found


def check_host_key(hop: Hop, offered: paramiko.PKey) -> None:
    """Refuse unless known_hosts has this key for the host among its (not revoked) keys; never
    accept silently. Several keys of one type (round-robin login nodes, a rotation) are all good."""
    known = known_hosts(hop)
    ktype = offered.get_name()
    line = f"{hop.key_name} {ktype} {offered.get_base64()}"
    where = ", ".join(str(p) for p in hop.known_hosts[:1])
    if offered in known.revoked:
        raise RemoteError(
            f"REVOKED host key for {hop.key_name} ({hop.alias}): the server offers {ktype} {fingerprint(offered)}, "
            "which known_hosts marks @revoked. Refusing to connect; ask your site which key the host uses now."
        )
    if offered in known.keys:
        return
    # Same type, other keys: the dangerous case (OpenSSH's "REMOTE HOST IDENTIFICATION HAS
    # CHANGED"). Only other types known: still refused, a downgrade to an unchecked key type
    # is how an interceptor would get past us.
    same = [k for k in known.keys if k.get_name() == ktype]
    if same:
        raise RemoteError(
            f"HOST KEY CHANGED for {hop.key_name} ({hop.alias}): known_hosts has {ktype} "
            f"{', '.join(fingerprint(k) for k in same)}, the server now offers {fingerprint(offered)}. Someone may "
            "be intercepting the connection, or the host was reinstalled; refusing to connect. If your site "
            f"confirms the new key, remove the old one with: ssh-keygen -R '{hop.key_name}' and add:\n{line}"
        )
    types = sorted({k.get_name() for k in known.keys})
    other = f" (known_hosts has only {', '.join(types)} for it)" if types else ""
    if known.cas and not types:
        # Host certificates are not checked here (paramiko's client does not ask for them), so
        # a CA's word is not enough: the user adds the host's own key, as for any unknown host.
        other = (
            " (known_hosts vouches for it only through a @cert-authority line, and detslurm does"
            " not check host certificates)"
        )
    raise RemoteError(
        f"unknown host key for {hop.key_name} ({hop.alias}){other}: the server offers {ktype} "
        f"{fingerprint(offered)}. Refusing to connect to an unverified host. Check that fingerprint with "
        f"your site (ssh-keygen -lf on the host's key), then add this line to {where}:\n{line}"
    )


def preferred_key_types(hop: Hop, supported: tuple[str, ...]) -> tuple[str, ...]:
    """Ask first for the key types known_hosts has for the host, so that a server with several
    host keys offers the one we can check (as OpenSSH does)."""
    known = list(dict.fromkeys(k.get_name() for k in known_hosts(hop).keys))
    if "ssh-rsa" in known:
        known += ["rsa-sha2-512", "rsa-sha2-256"]
    first = [t for t in supported if t in known]
    return tuple(first + [t for t in supported if t not in first])
