"""The wire under DistributedContext: authenticated JSON collectives between a trial's processes.

Transport: plain sockets carrying length-prefixed JSON frames. The chief (rank 0) serves the
global group over TCP on ``chief_ip:port``; each node's local chief serves its node over a unix
socket. Every collective is "send to the server, get the result back", so the calls of all ranks
must be made in the same order, as with any collective.

Security (docs/design/security.md): any user on the cluster can reach these sockets, so

- frames are JSON, never pickles: what comes from the network is data, not code;
- a member proves it holds this run's random secret (``detslurm.protocol.secret``: never derived from
  ids, which are public in squeue) by an HMAC challenge-response, and the server proves it back;
  then every frame carries an HMAC over its direction and sequence number; only the expected ranks
  may join, each once;
- the server's accept loop outlives bad clients (a failed handshake, garbage, an oversized frame, a
  stall: closed and logged) until every member joined or the deadline passed (naming the missing);
- on Linux the node-local socket is in the abstract namespace, named from the secret: no file in a
  shared /tmp can be planted to block it, and nobody can guess the name before the server binds it.

Traffic is authenticated, not encrypted: keep secrets out of collectives.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import selectors
import socket
import struct
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from detslurm import settings

HANDSHAKE_TIMEOUT_S = 5.0  # an unauthenticated connection gets this long to prove itself
HANDSHAKE_MAX_BYTES = 1024  # a real handshake is about 200 bytes of JSON
FRAME_MAX_BYTES = 256 * 2**20  # bounds what one member can make the server buffer
MAX_PENDING = 128  # unauthenticated connections held at once; more are closed on arrival
PROTOCOL = "detslurm-dist-1"  # in the challenge: another version fails at once
_MAC_BYTES = 32
_LEN = struct.Struct(">I")

log = logging.getLogger("detslurm.distributed")


class DistributedError(RuntimeError):
    """The group could not form, or a member broke the protocol."""


class _BadPeer(Exception):
    """A peer broke the wire protocol (garbage, oversized frame, failed authentication)."""


def _join_timeout_s() -> float:
    """How long a server waits for all of its members, and a member for its server."""
    return settings.DIST_JOIN_TIMEOUT_S.get()


def _mac(key: bytes, *parts: object) -> bytes:
    """HMAC-SHA256 over labelled parts (none contains a newline: labels, hex, ints)."""
    return hmac.new(key, "\n".join(str(p) for p in parts).encode(), hashlib.sha256).digest()


# -- framing ---------------------------------------------------------------------------------
def _send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_LEN.pack(len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        buf += chunk
    return bytes(buf)


def _recv_frame(sock: socket.socket, limit: int) -> bytes:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > limit:  # before reading the body: the length is the peer's choice
        raise _BadPeer(f"a frame of {n} bytes (the limit is {limit})")
    return _recv_exact(sock, n)


def _jsonable(obj: Any) -> Any:
    # numpy and torch values (metrics, mostly) know how to become plain lists and numbers.
    if callable(getattr(obj, "tolist", None)):
        return obj.tolist()
    raise TypeError(f"DistributedContext collectives carry JSON values only (never pickles); got {type(obj).__name__}")


def _encode(value: Any) -> bytes:
    return json.dumps(value, default=_jsonable, separators=(",", ":")).encode()


def _decode_json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):  # deeply nested JSON
        raise _BadPeer("a frame that is not JSON") from None


class _Channel:
    """An authenticated connection: every frame carries an HMAC over its direction and sequence
    number under a per-connection session key, so nothing can be injected, replayed or reordered."""

    def __init__(self, sock: socket.socket, session_key: bytes, is_server: bool) -> None:
        self.sock = sock
        self._key = session_key
        self._out, self._in = ("s2c", "c2s") if is_server else ("c2s", "s2c")  # in each MAC: no reflection
        self._sent = self._received = 0
        sock.settimeout(None)  # a collective waits as long as the slowest rank needs

    def send(self, value: Any) -> None:
        payload = _encode(value)
        if len(payload) > FRAME_MAX_BYTES:
            raise ValueError(f"a collective value of {len(payload)} bytes is over the {FRAME_MAX_BYTES} byte limit")
        mac = _frame_mac(self._key, self._out, self._sent, payload)
        self._sent += 1
        _send_frame(self.sock, mac + payload)

    def recv(self) -> Any:
        try:
            frame = _recv_frame(self.sock, FRAME_MAX_BYTES + _MAC_BYTES)
        except _BadPeer as e:
            raise DistributedError(f"a group member sent {e}") from None
        mac, payload = frame[:_MAC_BYTES], frame[_MAC_BYTES:]
        want = _frame_mac(self._key, self._in, self._received, payload)
        if not hmac.compare_digest(mac, want):
            raise DistributedError("a collective frame failed authentication (tampered or out of order)")
        self._received += 1
        try:
            return _decode_json(payload)
        except _BadPeer as e:
            raise DistributedError(f"a group member sent {e}") from None

    def close(self) -> None:
        self.sock.close()


def _is_hex(text: str, length: int) -> bool:
    return len(text) == length and all(c in "0123456789abcdef" for c in text)


def _frame_mac(key: bytes, direction: str, seq: int, payload: bytes) -> bytes:
    return hmac.new(key, f"{direction}\n{seq}\n".encode() + payload, hashlib.sha256).digest()


# -- the server side: admitting members --------------------------------------------------------
@dataclass
class _Pending:
    """A connection that has been sent a challenge and has not yet answered it."""

    sock: socket.socket
    peer: str
    nonce: str
    deadline: float
    buf: bytearray = field(default_factory=bytearray)


class _Gate:
    """Admits the expected members of one group; survives any number of bad connections."""

    def __init__(self, listener: socket.socket, secret: bytes, tag: str, expected: set[int]) -> None:
        self.listener, self.secret, self.tag, self.expected = listener, secret, tag, expected
        self.joined: dict[int, _Channel] = {}
        self.pending: dict[socket.socket, _Pending] = {}
        self.sel = selectors.DefaultSelector()

    def run(self, timeout_s: float) -> dict[int, _Channel]:
        """Members by rank once all joined; DistributedError naming the missing ranks at the deadline."""
        deadline = time.monotonic() + timeout_s
        self.listener.setblocking(False)  # _accept() drains the backlog until EAGAIN: never blocks
        self.sel.register(self.listener, selectors.EVENT_READ)
        try:
            while len(self.joined) < len(self.expected):
                now = time.monotonic()
                if now > deadline:
                    missing = sorted(self.expected - self.joined.keys())
                    raise DistributedError(
                        f"the {self.tag} group did not form within {timeout_s:.0f} s: ranks {missing} never joined"
                    )
                # One thread, non-blocking: a client that connects and stays silent holds up nobody's handshake.
                for key, _ in self.sel.select(timeout=max(0.0, min(0.5, deadline - now))):
                    if key.fileobj is self.listener:
                        self._accept()
                    elif (p := self.pending.get(key.fileobj)) is not None:  # type: ignore[call-overload]
                        self._on_data(p)
                self._expire(time.monotonic())
            return self.joined
        except BaseException:
            for ch in self.joined.values():
                ch.close()
            raise
        finally:
            for p in list(self.pending.values()):
                self._drop(p)
            self.sel.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # e.g. out of file descriptors: keep serving the ones we have
                log.warning("%s group: accept failed: %s", self.tag, e)
                return
            peer = str(addr) if addr else "a local process"
            if len(self.pending) >= MAX_PENDING:
                log.warning("%s group: closed a connection from %s: too many unauthenticated", self.tag, peer)
                sock.close()
                continue
            p = _Pending(sock, peer, secrets.token_hex(32), time.monotonic() + HANDSHAKE_TIMEOUT_S)
            try:
                sock.settimeout(HANDSHAKE_TIMEOUT_S)
                _send_frame(sock, _encode({"proto": PROTOCOL, "group": self.tag, "nonce": p.nonce}))
                sock.setblocking(False)
            except OSError as e:
                log.warning("%s group: closed a connection from %s: %s", self.tag, peer, e)
                sock.close()
                continue
            self.pending[sock] = p
            self.sel.register(sock, selectors.EVENT_READ)

    def _on_data(self, p: _Pending) -> None:
        try:
            chunk = p.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except ConnectionResetError:
            # A peer that closes without reading our challenge makes its kernel answer with a
            # reset instead of an orderly close: the same departure, said the same way.
            return self._reject(p, "it closed the connection before authenticating (reset)")
        except OSError as e:
            return self._reject(p, str(e))
        if not chunk:
            return self._reject(p, "it closed the connection before authenticating")
        p.buf += chunk
        if len(p.buf) >= _LEN.size and _LEN.unpack(p.buf[: _LEN.size])[0] > HANDSHAKE_MAX_BYTES:
            return self._reject(p, "an oversized handshake frame")
        if len(p.buf) >= _LEN.size and len(p.buf) >= _LEN.size + _LEN.unpack(p.buf[: _LEN.size])[0]:
            try:
                self._admit(p, bytes(p.buf[_LEN.size :]))
            except _BadPeer as e:
                self._reject(p, str(e))

    def _admit(self, p: _Pending, frame: bytes) -> None:
        hello = _decode_json(frame)
        if not isinstance(hello, dict):
            raise _BadPeer("a handshake that is not a JSON object")
        rank, nonce, mac = hello.get("rank"), hello.get("nonce"), hello.get("mac")
        # type() is int, not isinstance: JSON true would otherwise pass as rank 1.
        if not (type(rank) is int and isinstance(nonce, str) and isinstance(mac, str) and _is_hex(nonce, 64)):
            raise _BadPeer("a malformed handshake")
        try:
            mac_bytes = bytes.fromhex(mac)
        except ValueError:
            raise _BadPeer("a malformed handshake") from None
        if not hmac.compare_digest(mac_bytes, _mac(self.secret, "hello", self.tag, p.nonce, nonce, rank)):
            # Say so: a rank started with another secret then fails at once instead of retrying.
            self._reply(p, {"ok": False, "error": "authentication failed (not this run's secret)"})
            raise _BadPeer("failed authentication (it does not hold this run's secret)")
        # Authenticated from here on: a rank problem is a bug in the launch, so say it plainly.
        if rank not in self.expected or rank in self.joined:
            why = "joined twice" if rank in self.joined else f"is not a member (expected {sorted(self.expected)})"
            self._reply(p, {"ok": False, "error": f"rank {rank} {why}"})
            raise _BadPeer(f"rank {rank} {why}")
        self.sel.unregister(p.sock)
        del self.pending[p.sock]
        p.sock.settimeout(HANDSHAKE_TIMEOUT_S)
        self._reply(p, {"ok": True, "mac": _mac(self.secret, "welcome", self.tag, p.nonce, nonce, rank).hex()})
        key = _mac(self.secret, "session", self.tag, p.nonce, nonce, rank)  # both nonces: one key per connection
        self.joined[rank] = _Channel(p.sock, key, is_server=True)

    def _reply(self, p: _Pending, message: dict[str, Any]) -> None:
        try:
            p.sock.setblocking(True)  # a short reply, sent whole; the timeout bounds it
            p.sock.settimeout(HANDSHAKE_TIMEOUT_S)
            _send_frame(p.sock, _encode(message))
        except OSError as e:
            raise _BadPeer(f"could not answer it: {e}") from None

    def _expire(self, now: float) -> None:
        for p in [p for p in self.pending.values() if p.deadline < now]:
            self._reject(p, f"it did not authenticate within {HANDSHAKE_TIMEOUT_S:.0f} s")

    def _reject(self, p: _Pending, why: str) -> None:
        log.warning("%s group: closed a connection from %s: %s", self.tag, p.peer, why)
        self._drop(p)

    def _drop(self, p: _Pending) -> None:
        if self.pending.pop(p.sock, None) is not None:
            self.sel.unregister(p.sock)
        p.sock.close()


# -- the member side ---------------------------------------------------------------------------
def _join(address: Any, family: int, secret: bytes, tag: str, rank: int, timeout_s: float) -> _Channel:
    """Connect to the group's server (retrying until it listens) and authenticate both ways."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(HANDSHAKE_TIMEOUT_S, min(30.0, deadline - time.monotonic())))
            sock.connect(address)
            return _handshake(sock, secret, tag, rank)
        except (OSError, _BadPeer, ConnectionError) as e:
            sock.close()
            last = str(e)
            time.sleep(0.05)  # the server may not listen yet: retry until the deadline
        except BaseException:
            sock.close()
            raise
    raise DistributedError(f"rank {rank} could not join its {tag} group at {_show(address)} ({last})")


def _handshake(sock: socket.socket, secret: bytes, tag: str, rank: int) -> _Channel:
    challenge = _decode_json(_recv_frame(sock, HANDSHAKE_MAX_BYTES))
    if not isinstance(challenge, dict) or challenge.get("proto") != PROTOCOL or challenge.get("group") != tag:
        raise DistributedError(f"the server for the {tag} group at {sock.getpeername()!r} is not this group's")
    server_nonce, nonce = str(challenge.get("nonce")), secrets.token_hex(32)
    mac = _mac(secret, "hello", tag, server_nonce, nonce, rank).hex()
    _send_frame(sock, _encode({"rank": rank, "nonce": nonce, "mac": mac}))
    reply = _decode_json(_recv_frame(sock, HANDSHAKE_MAX_BYTES))
    if not isinstance(reply, dict) or reply.get("ok") is not True:
        error = reply.get("error") if isinstance(reply, dict) else None
        raise DistributedError(f"the {tag} group refused rank {rank}: {error or 'no reason given'}")
    want = _mac(secret, "welcome", tag, server_nonce, nonce, rank)
    try:
        proof = bytes.fromhex(str(reply.get("mac")))
    except ValueError:
        proof = b""
    if not hmac.compare_digest(proof, want):
        raise DistributedError(
            f"the server of the {tag} group did not prove it holds this run's secret: another process holds "
            "its address, or the ranks were started with different secrets"
        )
    return _Channel(sock, _mac(secret, "session", tag, server_nonce, nonce, rank), is_server=False)


def _show(address: Any) -> str:
    if isinstance(address, str) and address.startswith("\0"):
        return "@" + address[1:]  # how ss and /proc/net/unix print abstract names
    return repr(address)


def _listen(address: Any, family: int, backlog: int) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if family == socket.AF_INET:  # a rerun may rebind a port still in TIME_WAIT
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        raise DistributedError(f"cannot listen on {_show(address)}: {e.strerror}") from None
    return sock


def _local_address(secret: bytes, port: int, cross_rank: int) -> str:
    """The node group's unix socket: abstract on Linux (nothing on disk to plant or remove), else a
    path in /tmp; either way named from the secret, so nobody can occupy it in advance."""
    name = f"detslurm-{_mac(secret, 'local-socket', port, cross_rank).hex()[:32]}"
    if sys.platform.startswith("linux"):
        return "\0" + name
    return os.path.join(tempfile.gettempdir(), f"{name}.sock")


class _Group:
    """A server (rank 0 of the group) or a client of one, for ``size`` members."""

    def __init__(self, rank: int, size: int, address: Any, family: str, secret: bytes, tag: str) -> None:
        self.rank = rank
        self.size = size
        self.tag = f"{tag}/{size}"  # the size is in every MAC: mismatched world sizes cannot join
        self.peers: list[_Channel] = []
        self.conn: _Channel | None = None
        self._path: str | None = None
        if size <= 1:
            return
        fam = socket.AF_UNIX if family == "AF_UNIX" else socket.AF_INET
        if rank != 0:
            self.conn = _join(address, fam, secret, self.tag, rank, _join_timeout_s())
            return
        if fam == socket.AF_UNIX and not address.startswith("\0"):
            self._path = address  # a stale socket of ours from a crashed run may sit there
            if os.path.exists(address) and os.stat(address).st_uid == os.getuid():
                os.unlink(address)
        listener = _listen(address, fam, max(size, 16))  # backlog: every member may connect at once
        try:
            # The listener closes as soon as the group formed: nothing is left to connect to.
            joined = _Gate(listener, secret, self.tag, set(range(1, size))).run(_join_timeout_s())
        finally:
            listener.close()
            if self._path is not None and os.path.lexists(self._path):
                os.unlink(self._path)
        self.peers = [joined[r] for r in range(1, size)]

    def exchange(self, value: Any, op: str) -> Any:
        """Gather ``value`` on the server; reply per ``op`` (allgather|gather|broadcast).

        Values travel as JSON, and the server's own value goes through JSON too, so that every
        rank gets the same types back (tuples become lists, keys become strings)."""
        if self.size <= 1:
            return {"allgather": [value], "gather": [value], "broadcast": value}[op]
        if self.rank != 0:
            assert self.conn is not None
            self.conn.send(value)
            return self.conn.recv()
        values = [json.loads(_encode(value))] + [p.recv() for p in self.peers]  # in rank order
        reply = {"allgather": values, "gather": None, "broadcast": values[0]}[op]
        for p in self.peers:
            p.send(reply)
        return values if op == "gather" else reply

    def close(self) -> None:
        for c in self.peers:
            c.close()
        if self.conn is not None:
            self.conn.close()
