"""DistributedContext: ranks plus small pickled collectives between the trial's processes.

Transport: ``multiprocessing.connection`` (stdlib, authenticated). The chief (rank 0) serves
the global group over TCP on ``chief_ip:port``; each node's local chief serves its node over a
unix socket. Every collective is "send to the server, get the result back", so the calls of all
ranks must be made in the same order, as with any collective.
"""

from __future__ import annotations

import hashlib
import os
import socket
import tempfile
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

DEFAULT_PORT = 12360
CONNECT_TIMEOUT_S = 120.0


def _authkey() -> bytes:
    seed = os.environ.get("DETSLURM_DIST_KEY") or os.environ.get("DET_ALLOCATION_ID") or "detslurm"
    return hashlib.sha256(seed.encode()).digest()


class _Group:
    """A server (rank 0 of the group) or a client of one, for ``size`` members."""

    def __init__(self, rank: int, size: int, address: Any, family: str) -> None:
        self.rank = rank
        self.size = size
        self.peers: list[Connection] = []
        self.conn: Connection | None = None
        self.listener: Listener | None = None
        if size <= 1:
            return
        key = _authkey()
        if rank == 0:
            if family == "AF_UNIX" and os.path.exists(address):
                os.unlink(address)
            self.listener = Listener(address, family=family, authkey=key, backlog=max(size, 16))
            by_rank: dict[int, Connection] = {}
            while len(by_rank) < size - 1:
                conn = self.listener.accept()
                by_rank[int(conn.recv())] = conn
            self.peers = [by_rank[r] for r in range(1, size)]
        else:
            deadline = time.monotonic() + CONNECT_TIMEOUT_S
            while True:
                try:
                    self.conn = Client(address, family=family, authkey=key)
                    break
                except (ConnectionRefusedError, FileNotFoundError, socket.gaierror, OSError):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"rank {rank} could not reach its group server at {address}") from None
                    time.sleep(0.05)
            self.conn.send(rank)

    def exchange(self, value: Any, op: str) -> Any:
        """Gather ``value`` on the server; reply per ``op`` (allgather|gather|broadcast)."""
        if self.size <= 1:
            return {"allgather": [value], "gather": [value], "broadcast": value}[op]
        if self.rank != 0:
            assert self.conn is not None
            self.conn.send(value)
            return self.conn.recv()
        values = [value] + [p.recv() for p in self.peers]
        reply = {"allgather": values, "gather": None, "broadcast": value}[op]
        for p in self.peers:
            p.send(reply)
        return values if op == "gather" else reply

    def close(self) -> None:
        for c in self.peers:
            c.close()
        if self.conn is not None:
            self.conn.close()
        if self.listener is not None:
            self.listener.close()


class DistributedContext:
    """Ranks and collectives. Construction is itself a collective: every rank must construct."""

    def __init__(
        self,
        *,
        rank: int,
        size: int,
        local_rank: int,
        local_size: int,
        cross_rank: int,
        cross_size: int,
        chief_ip: str | None = None,
        port: int | None = None,
        pub_port: int | None = None,
        pull_port: int | None = None,
        port_offset: int = 0,
        force_tcp: bool = False,
    ) -> None:
        self.rank, self.size = rank, size
        self.local_rank, self.local_size = local_rank, local_size
        self.cross_rank, self.cross_size = cross_rank, cross_size
        if chief_ip is None and local_size != size:
            raise ValueError("chief_ip is required when the group spans more than one node")
        self.chief_ip = chief_ip or "127.0.0.1"
        env_port = os.environ.get("DETSLURM_DIST_PORT")
        self.port = port or pub_port or (int(env_port) if env_port else DEFAULT_PORT + port_offset)
        self._global = _Group(rank, size, (self.chief_ip if size != local_size else "127.0.0.1", self.port), "AF_INET")
        if force_tcp:
            local_addr: Any = ("127.0.0.1", self.port + 1 + cross_rank)
            family = "AF_INET"
        else:
            local_addr = os.path.join(tempfile.gettempdir(), f"detslurm-{os.getuid()}-{self.port}-{cross_rank}.sock")
            family = "AF_UNIX"
        self._local = _Group(local_rank, local_size, local_addr, family) if size > 1 else _Group(0, 1, None, "")

    # -- Determined's getters ----------------------------------------------------------
    def get_rank(self) -> int:
        return self.rank

    def get_local_rank(self) -> int:
        return self.local_rank

    def get_size(self) -> int:
        return self.size

    def get_num_agents(self) -> int:
        return self.cross_size

    # -- collectives ---------------------------------------------------------------------
    def allgather(self, stuff: Any) -> list[Any]:
        result: list[Any] = self._global.exchange(stuff, "allgather")
        return result

    def gather(self, stuff: Any) -> list[Any] | None:
        result: list[Any] | None = self._global.exchange(stuff, "gather")
        return result

    def broadcast(self, stuff: Any = None) -> Any:
        return self._global.exchange(stuff, "broadcast")

    def allgather_local(self, stuff: Any) -> list[Any]:
        result: list[Any] = self._local.exchange(stuff, "allgather")
        return result

    def gather_local(self, stuff: Any) -> list[Any] | None:
        result: list[Any] | None = self._local.exchange(stuff, "gather")
        return result

    def broadcast_local(self, stuff: Any = None) -> Any:
        return self._local.exchange(stuff, "broadcast")

    def close(self) -> None:
        self._local.close()
        self._global.close()

    # -- constructors from the frameworks' environments -----------------------------------
    @classmethod
    def from_torch_distributed(cls, chief_ip: str | None = None) -> DistributedContext:
        e = os.environ
        return cls(
            rank=int(e["RANK"]),
            size=int(e["WORLD_SIZE"]),
            local_rank=int(e["LOCAL_RANK"]),
            local_size=int(e["LOCAL_WORLD_SIZE"]),
            cross_rank=int(e["GROUP_RANK"]),
            cross_size=int(e["GROUP_WORLD_SIZE"]),
            chief_ip=chief_ip or e.get("DET_CHIEF_IP") or e.get("MASTER_ADDR"),
        )

    @classmethod
    def from_deepspeed(cls, chief_ip: str | None = None) -> DistributedContext:
        e = os.environ
        return cls(
            rank=int(e["RANK"]),
            size=int(e["WORLD_SIZE"]),
            local_rank=int(e["LOCAL_RANK"]),
            local_size=int(e["LOCAL_SIZE"]),
            cross_rank=int(e["CROSS_RANK"]),
            cross_size=int(e["CROSS_SIZE"]),
            chief_ip=chief_ip or e.get("DET_CHIEF_IP") or e.get("MASTER_ADDR"),
        )

    @classmethod
    def from_horovod(cls, hvd: Any, chief_ip: str | None = None) -> DistributedContext:
        e = os.environ

        def cross(name: str, env: str) -> int:
            fn = getattr(hvd, name, None)
            return int(fn()) if callable(fn) else int(e[env])

        return cls(
            rank=hvd.rank(),
            size=hvd.size(),
            local_rank=hvd.local_rank(),
            local_size=hvd.local_size(),
            cross_rank=cross("cross_rank", "HOROVOD_CROSS_RANK"),
            cross_size=cross("cross_size", "HOROVOD_CROSS_SIZE"),
            chief_ip=chief_ip or e.get("DET_CHIEF_IP"),
        )


class DummyDistributedContext(DistributedContext):
    """Rank 0 of 1: the off-cluster and single-slot twin."""

    def __init__(self) -> None:
        super().__init__(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1)
