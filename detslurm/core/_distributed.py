"""DistributedContext: ranks plus small JSON collectives between the trial's processes.

Determined's class, with its constructor and classmethods; the wire under it (authenticated
JSON frames, docs/design/security.md) is :mod:`detslurm.core._wire`.

Ports. Built by hand, a context listens where Determined's does: ``pub_port`` (12360, or
``$INTER_TRAIN_PROCESS_COMM_PORT_1`` as Determined reads it) on the chief. On Slurm several
trials may share a node, and two of them on one fixed port would collide; so the launchers choose
a port no other job on the node holds (``launchers/_common.rendezvous_ports``), publish it as
``DETSLURM_DIST_PORT``, and the framework constructors (``from_torch_distributed``,
``from_deepspeed``, ``from_horovod``, ``from_tf_config``) pass it explicitly.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypedDict

from detslurm import settings
from detslurm.core._wire import _Group, _local_address
from detslurm.protocol.secret import new_secret, secret_from_env

# Determined's defaults, read as its constants.py reads them (once, at import), so firewall
# rules and overrides written for Determined apply to a context built by hand.
PUB_PORT = int(os.environ.get("INTER_TRAIN_PROCESS_COMM_PORT_1") or 12360)
PULL_PORT = int(os.environ.get("INTER_TRAIN_PROCESS_COMM_PORT_2") or PUB_PORT + 16)

# The secret a framework constructor shared over the framework's own group (see _shared_secret),
# handed to __init__ beside its parameters, which stay Determined's.
_GIVEN_SECRET: ContextVar[bytes | None] = ContextVar("detslurm_given_secret", default=None)


class DistributedContext:
    """Ranks and collectives. Construction is itself a collective: every rank must construct.

    ``pub_port`` is the chief's TCP port (one socket carries both directions here, where
    Determined's ZMQ uses two); under ``force_tcp`` each node's group listens on loopback at
    ``pull_port + cross_rank`` instead of a unix socket. ``port_offset`` is added to both, as
    Determined's constants.py says of its ports."""

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
        pub_port: int = PUB_PORT,
        pull_port: int = PULL_PORT,
        port_offset: int = 0,
        force_tcp: bool = False,
    ) -> None:
        self.rank, self.size = rank, size
        self.local_rank, self.local_size = local_rank, local_size
        self.cross_rank, self.cross_size = cross_rank, cross_size
        if chief_ip is None and local_size != size:
            raise ValueError("chief_ip is required when the group spans more than one node")
        self.chief_ip = chief_ip or "127.0.0.1"
        self.pub_port, self.pull_port = pub_port + port_offset, pull_port + port_offset
        # No secret, no group: there is deliberately no fallback key (see detslurm.protocol.secret).
        given = _GIVEN_SECRET.get()
        secret = given if given is not None else (secret_from_env(os.environ) if size > 1 else b"")
        global_addr = (self.chief_ip if size != local_size else "127.0.0.1", self.pub_port)  # one node: loopback
        self._global = _Group(rank, size, global_addr, "AF_INET", secret, "global")
        if force_tcp:
            local_addr: Any = ("127.0.0.1", self.pull_port + cross_rank)
            family = "AF_INET"
        else:
            local_addr = _local_address(secret, self.pub_port, cross_rank)
            family = "AF_UNIX"
        local_size_used = local_size if size > 1 else 1
        self._local = _Group(local_rank, local_size_used, local_addr, family, secret, f"local{cross_rank}")

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

    def broadcast(self, stuff: Any) -> Any:
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
        with _given(_shared_secret(int(e["WORLD_SIZE"]), _torch_share)):
            return cls(
                rank=int(e["RANK"]),
                size=int(e["WORLD_SIZE"]),
                local_rank=int(e["LOCAL_RANK"]),
                local_size=int(e["LOCAL_WORLD_SIZE"]),
                cross_rank=int(e["GROUP_RANK"]),
                cross_size=int(e["GROUP_WORLD_SIZE"]),
                chief_ip=chief_ip or e.get("DET_CHIEF_IP") or e.get("MASTER_ADDR"),
                **_launcher_ports(),
            )

    @classmethod
    def from_deepspeed(cls, chief_ip: str | None = None) -> DistributedContext:
        e = os.environ
        with _given(_shared_secret(int(e["WORLD_SIZE"]), _torch_share)):
            return cls(
                rank=int(e["RANK"]),
                size=int(e["WORLD_SIZE"]),
                local_rank=int(e["LOCAL_RANK"]),
                local_size=int(e["LOCAL_SIZE"]),
                cross_rank=int(e["CROSS_RANK"]),
                cross_size=int(e["CROSS_SIZE"]),
                chief_ip=chief_ip or e.get("DET_CHIEF_IP") or e.get("MASTER_ADDR"),
                **_launcher_ports(),
            )

    @classmethod
    def from_horovod(cls, hvd: Any, chief_ip: str | None = None) -> DistributedContext:
        e = os.environ

        def cross(name: str, env: str) -> int:  # old Horovod lacks cross_rank(); its launcher exports them
            fn = getattr(hvd, name, None)
            return int(fn()) if callable(fn) else int(e[env])

        with _given(_shared_secret(hvd.size(), lambda: _horovod_share(hvd))):
            return cls(
                rank=hvd.rank(),
                size=hvd.size(),
                local_rank=hvd.local_rank(),
                local_size=hvd.local_size(),
                cross_rank=cross("cross_rank", "HOROVOD_CROSS_RANK"),
                cross_size=cross("cross_size", "HOROVOD_CROSS_SIZE"),
                chief_ip=chief_ip or e.get("DET_CHIEF_IP"),
                **_launcher_ports(),
            )

    @classmethod
    def from_tf_config(cls) -> tuple[DistributedContext, Any]:
        """A context and a ``tf.distribute.Strategy`` from ``$TF_CONFIG`` (which
        ``determined.launch.tensorflow`` sets on several nodes), as Determined makes them: one
        worker per node, MultiWorkerMirroredStrategy across nodes; on one node (no TF_CONFIG, or
        one worker) MirroredStrategy over several GPUs, else TensorFlow's default strategy."""
        try:
            tf: Any = importlib.import_module("tensorflow")  # the user's, never a dependency of detslurm
        except ModuleNotFoundError as e:
            if e.name != "tensorflow":
                raise
            raise ModuleNotFoundError(
                "DistributedContext.from_tf_config() needs TensorFlow in the trial's environment "
                "(pip install tensorflow)",
                name="tensorflow",
            ) from None
        ranks = _tf_config_ranks(os.environ)
        if ranks is not None:
            return cls(**ranks, **_launcher_ports()), tf.distribute.MultiWorkerMirroredStrategy()
        dist = cls(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1)
        gpus = len(tf.config.list_physical_devices("GPU"))
        return dist, tf.distribute.MirroredStrategy() if gpus > 1 else tf.distribute.get_strategy()


def _tf_config_ranks(env: Mapping[str, str]) -> dict[str, Any] | None:
    """The context's parameters that ``$TF_CONFIG`` gives (one worker per node, the chief the
    first worker's host), or None where it names one worker or is unset: then the context is
    rank 0 of 1, as in Determined. Anything but a worker task is refused, as Determined does."""
    raw = env.get("TF_CONFIG")
    if not raw:
        return None
    try:
        config = json.loads(raw)
        task_type, workers = config["task"]["type"], list(config["cluster"]["worker"])
    except (ValueError, KeyError, TypeError):
        raise ValueError(
            f'TF_CONFIG is not {{"cluster": {{"worker": [...]}}, "task": {{"type": ..., "index": ...}}}}: {raw}'
        ) from None
    if task_type != "worker":
        raise RuntimeError(
            "DistributedContext.from_tf_config() only supports the default strategy, MirroredStrategy or "
            f'MultiWorkerMirroredStrategy, but found unexpected task_type="{task_type}" in TF_CONFIG ({raw})'
        )
    if len(workers) <= 1:
        return None
    index = int(config["task"]["index"])
    host = str(workers[0]).rpartition(":")[0].strip("[]")  # "host:port", "[v6::addr]:port"
    size = len(workers)
    return {
        "rank": index,
        "size": size,
        "local_rank": 0,
        "local_size": 1,
        "cross_rank": index,
        "cross_size": size,
        "chief_ip": host,
    }


class _Ports(TypedDict, total=False):
    pub_port: int
    pull_port: int


def _launcher_ports() -> _Ports:
    """The ports this job's launcher chose (DETSLURM_DIST_PORT, and the next one for node groups
    over TCP); none outside a launched job, where Determined's defaults apply."""
    port = settings.DIST_PORT.get()
    return _Ports(pub_port=port, pull_port=port + 1) if port else _Ports()


@contextmanager
def _given(secret: bytes | None) -> Iterator[None]:
    token = _GIVEN_SECRET.set(secret)
    try:
        yield
    finally:
        _GIVEN_SECRET.reset(token)


def _shared_secret(size: int, share: Callable[[], str | None]) -> bytes | None:
    """The secret for a framework's constructor: None (read the environment, as always) where a
    launcher or the login node gave one. Under a plain torchrun or horovodrun off-cluster nobody
    did; then rank 0 makes a fresh one and the framework's own group, already formed between the
    ranks, carries it to the others (never our sockets, never anything derived from ids)."""
    if size <= 1 or settings.RUN_SECRET_FILE.raw() or settings.DIST_SECRET.raw():
        return None
    shared = share()
    return bytes.fromhex(shared) if shared else None


def _torch_share() -> str | None:
    dist = sys.modules.get("torch.distributed")  # only if the script uses it: never import torch here
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    box = [new_secret().hex() if dist.get_rank() == 0 else None]  # pickled, but only over torch's own group
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


def _horovod_share(hvd: Any) -> str | None:
    broadcast = getattr(hvd, "broadcast_object", None)
    if not callable(broadcast):
        return None
    return str(broadcast(new_secret().hex() if hvd.rank() == 0 else None, root_rank=0))


class DummyDistributedContext(DistributedContext):
    """Rank 0 of 1: the off-cluster and single-slot twin."""

    def __init__(self) -> None:
        super().__init__(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1)
