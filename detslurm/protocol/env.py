"""The trial environment contract (docs/design/architecture.md, rule 1): one encoder, one decoder.

The controller builds a trial's environment with :func:`trial_env`; in-job code reads it back
with :func:`from_env` (``detslurm.core.get_cluster_info`` caches it per process).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hostlist

from detslurm import settings
from detslurm.expconf.view import ConfigView
from detslurm.protocol.paths import ExpPaths, RunPaths


class TrialInfo:
    """Determined's ``det.TrialInfo``: the same constructor and attributes, so user code that reads
    or builds one keeps working. The underscored attributes are private in Determined too, but
    scripts read them (``_config`` for the full experiment config)."""

    def __init__(
        self,
        trial_id: int,
        experiment_id: int,
        trial_seed: int,
        hparams: dict[str, Any],
        config: dict[str, Any],
        steps_completed: int,
        trial_run_id: int,
        debug: bool,
        inter_node_network_interface: str | None,
    ) -> None:
        self.trial_id = trial_id
        self.experiment_id = experiment_id
        self.trial_seed = trial_seed
        self.hparams = hparams
        self._config = config
        self._steps_completed = steps_completed
        self._trial_run_id = trial_run_id
        self._debug = debug
        self._inter_node_network_interface = inter_node_network_interface

    def __repr__(self) -> str:
        return f"TrialInfo(trial_id={self.trial_id}, experiment_id={self.experiment_id}, hparams={self.hparams!r})"


class RendezvousInfo:
    """Determined's ``det.RendezvousInfo``: the job's nodes, this node's index, slots per node."""

    def __init__(self, container_addrs: list[str], container_rank: int, container_slot_counts: list[int]) -> None:
        self.container_addrs = container_addrs
        self.container_rank = container_rank
        self.container_slot_counts = container_slot_counts


class ResourcesInfo:
    """Determined's ``det.ResourcesInfo``: the GPUs given to this node, by UUID."""

    def __init__(self, gpu_uuids: list[str]) -> None:
        self._gpu_uuids = gpu_uuids

    @property
    def gpu_uuids(self) -> list[str]:
        return self._gpu_uuids


class ClusterInfo:
    """Determined's ``det.ClusterInfo``: the same constructor and properties. There is no master:
    ``master_url`` and ``session_token`` are empty, kept so code that logs them runs."""

    def __init__(
        self,
        master_url: str,
        cluster_id: str,
        agent_id: str,
        slot_ids: list[int],
        task_id: str,
        allocation_id: str,
        session_token: str,
        task_type: str,
        master_cert_name: str | None = None,
        master_cert_file: str | None = None,
        latest_checkpoint: str | None = None,
        trial_info: TrialInfo | None = None,
        rendezvous_info: RendezvousInfo | None = None,
        resources_info: ResourcesInfo | None = None,
    ) -> None:
        self.master_url = master_url
        self.cluster_id = cluster_id
        self.agent_id = agent_id
        self.slot_ids = slot_ids
        self.task_id = task_id
        self.allocation_id = allocation_id
        self.session_token = session_token
        self.task_type = task_type
        self.master_cert_name = master_cert_name
        self.master_cert_file = master_cert_file
        self._latest_checkpoint = latest_checkpoint
        self._trial_info = trial_info
        self._rendezvous_info = rendezvous_info
        self._resources_info = resources_info

    def _is_trial(self) -> bool:
        return self.task_type == "TRIAL"

    def _rendezvous(self) -> RendezvousInfo:
        if self._rendezvous_info is None:
            raise RuntimeError("this ClusterInfo was built without a rendezvous_info (RendezvousInfo)")
        return self._rendezvous_info

    @property
    def latest_checkpoint(self) -> str | None:
        """The checkpoint to resume from; only trials have one (as in Determined)."""
        return self._latest_checkpoint if self._is_trial() else None

    @property
    def trial(self) -> TrialInfo:
        if not self._is_trial():
            raise RuntimeError(f'you cannot use the .trial property when .task_type ("{self.task_type}") != "TRIAL"')
        if self._trial_info is None:
            raise RuntimeError("this ClusterInfo was built without a trial_info (TrialInfo)")
        return self._trial_info

    @property
    def user_data(self) -> dict[str, Any]:
        """The experiment config's ``data`` section ({} outside trials)."""
        return ConfigView(self.trial._config).data if self._is_trial() else {}

    @property
    def container_addrs(self) -> list[str]:
        return self._rendezvous().container_addrs if self._is_trial() else ["127.0.0.1"]

    @property
    def container_rank(self) -> int:
        return self._rendezvous().container_rank if self._is_trial() else 0

    @property
    def container_slot_counts(self) -> list[int]:
        return self._rendezvous().container_slot_counts if self._is_trial() else [len(self.slot_ids)]

    @property
    def gpu_uuids(self) -> list[str]:
        return self._resources_info.gpu_uuids if self._resources_info is not None else []


class RunInfo(ClusterInfo):
    """The ClusterInfo of a detslurm run (what ``det.get_cluster_info()`` returns on a trial):
    Determined's, plus where this run's files live on the shared filesystem."""

    def __init__(
        self,
        *,
        run_dir: Path,
        trial_dir: Path,
        exp_dir: Path,
        checkpoint_base: Path,
        resources_type: str,
        **determined: Any,
    ) -> None:
        super().__init__(**determined)
        self.run_dir = run_dir
        self.trial_dir = trial_dir
        self.exp_dir = exp_dir
        self.checkpoint_base = checkpoint_base
        # "local-process", "slurm" or "detached": how this run was started.
        self.resources_type = resources_type

    @property
    def run_paths(self) -> RunPaths:
        """This run's files (events, control file, exit record...)."""
        return RunPaths(self.exp_dir, self.trial.trial_id, self.trial._trial_run_id)


# registry_auth fields a trial may see: who, and where. The rest (password, auth, identitytoken,
# registrytoken) is for the container runtime's pull only.
_AUTH_PUBLIC = frozenset({"username", "serveraddress", "email"})
REDACTED = "********"


def redact_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` as a trial sees it: registry credentials masked. The trial never needs them, and
    its environment reaches places the password must not (the image's code, ``env`` dumps in
    logs, Slurm's stored job environment where a site keeps it for sacct)."""
    env = config.get("environment")
    auth = env.get("registry_auth") if isinstance(env, dict) else None
    if not isinstance(env, dict) or not isinstance(auth, dict):
        return config
    masked = {k: (v if k in _AUTH_PUBLIC else REDACTED) for k, v in auth.items()}
    return {**config, "environment": {**env, "registry_auth": masked}}


def trial_env(
    *,
    experiment_id: int,
    trial_id: int,
    run_id: int,
    seed: int,
    hparams: dict[str, Any],
    config: dict[str, Any],
    latest_checkpoint: str | None,
    steps_completed: int,
    run_dir: Path,
    trial_dir: Path,
    exp_dir: Path,
    checkpoint_base: str,
    resources_type: str,
    slot_ids: list[int],
    container_addrs: list[str],
    user: str,
) -> dict[str, str]:
    """The DET_* variables a trial process sees (pure: no I/O)."""
    # Determined's names for the same ids, so scripts that log or key on them keep working.
    task = f"exp-{experiment_id}-trial-{trial_id}"
    return {
        "DET_MASTER": "",
        "DET_CLUSTER_ID": "detslurm",
        "DET_TASK_ID": task,
        "DET_ALLOCATION_ID": f"{task}-run-{run_id}",
        "DET_SESSION_TOKEN": "",
        "DET_TASK_TYPE": "TRIAL",
        "DET_EXPERIMENT_ID": str(experiment_id),
        "DET_TRIAL_ID": str(trial_id),
        "DET_TRIAL_RUN_ID": str(run_id),
        "DET_TRIAL_SEED": str(seed),
        "DET_HPARAMS": json.dumps(hparams),
        "DET_EXPERIMENT_CONFIG": json.dumps(redact_config(config)),
        "DET_LATEST_CHECKPOINT": latest_checkpoint or "",
        "DET_STEPS_COMPLETED": str(steps_completed),
        "DET_RESOURCES_TYPE": resources_type,
        "DET_SLOT_IDS": json.dumps(slot_ids),
        # On Slurm, exec/launch.py replaces this with the job's node list at start-up: the nodes are
        # only known once the job runs.
        "DET_CONTAINER_ADDRS": json.dumps(container_addrs),
        "DET_USER": user,
        # Where this run's files are: RunPaths.from_env() rebuilds them from these.
        "DET_RUN_DIR": str(run_dir),
        settings.TRIAL_DIR.name: str(trial_dir),
        settings.EXP_DIR.name: str(exp_dir),
        settings.CHECKPOINT_BASE.name: checkpoint_base,
    }


def _slot_ids(env: Mapping[str, str]) -> list[int]:
    # Without DET_SLOT_IDS (a script started by hand), count the GPUs we can see.
    raw = env.get("DET_SLOT_IDS")
    if raw:
        return [int(x) for x in json.loads(raw)]
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd:
        # CUDA renumbers the visible devices from 0, so slot ids are 0..n-1 whatever the physical ids.
        return list(range(len(cvd.split(","))))
    return [0]


def _gpu_uuids(env: Mapping[str, str]) -> list[str]:
    # Determined asks nvidia-smi; a job's CUDA_VISIBLE_DEVICES names the GPUs by UUID where the
    # site's gres config does so, else by index (then there is nothing to report without a query).
    return [d for d in (env.get("CUDA_VISIBLE_DEVICES") or "").split(",") if d.startswith(("GPU-", "MIG-"))]


def from_env(env: Mapping[str, str]) -> RunInfo | None:
    """The decoder of :func:`trial_env`; None off-cluster (no ``DET_TRIAL_ID``)."""
    # No trial id means off-cluster: det.get_cluster_info() then returns None, as in Determined
    # (contract 1).
    if not env.get("DET_TRIAL_ID"):
        return None
    config = json.loads(env.get("DET_EXPERIMENT_CONFIG") or "{}")
    trial = TrialInfo(
        trial_id=int(env["DET_TRIAL_ID"]),
        experiment_id=int(env.get("DET_EXPERIMENT_ID", "0")),
        trial_seed=int(env.get("DET_TRIAL_SEED", "0")),
        hparams=json.loads(env.get("DET_HPARAMS") or "{}"),
        config=config,
        steps_completed=int(env.get("DET_STEPS_COMPLETED") or 0),
        trial_run_id=int(env.get("DET_TRIAL_RUN_ID") or 1),
        debug=ConfigView(config).debug,
        inter_node_network_interface=env.get("DET_INTER_NODE_NETWORK_INTERFACE"),
    )
    exp_dir = settings.EXP_DIR.get(env) or Path(".")
    addrs = list(json.loads(env.get("DET_CONTAINER_ADDRS") or '["127.0.0.1"]'))
    slot_ids = _slot_ids(env)
    rendezvous = RendezvousInfo(
        container_addrs=addrs,
        # One launcher per node, so the node's index in the job is its container rank.
        container_rank=int(env.get("DET_CONTAINER_RANK") or env.get("SLURM_NODEID") or 0),
        # Every node of a trial gets the same slots (render.resource_plan fills whole nodes), so
        # one node's count stands for all.
        container_slot_counts=[len(slot_ids)] * len(addrs),
    )
    return RunInfo(
        master_url=env.get("DET_MASTER", ""),
        cluster_id=env.get("DET_CLUSTER_ID", "detslurm"),
        # Slurm's name for the node first, as squeue and sacct show it.
        agent_id=env.get("SLURMD_NODENAME") or env.get("DET_AGENT_ID") or os.uname().nodename,
        slot_ids=slot_ids,
        task_id=env.get("DET_TASK_ID", ""),
        allocation_id=env.get("DET_ALLOCATION_ID", ""),
        session_token=env.get("DET_SESSION_TOKEN", ""),
        task_type=env.get("DET_TASK_TYPE", "TRIAL"),
        latest_checkpoint=env.get("DET_LATEST_CHECKPOINT") or None,
        trial_info=trial,
        rendezvous_info=rendezvous,
        resources_info=ResourcesInfo(gpu_uuids=_gpu_uuids(env)),
        run_dir=Path(env.get("DET_RUN_DIR") or "."),
        trial_dir=settings.TRIAL_DIR.get(env) or ExpPaths(exp_dir).trial_dir(trial.trial_id),
        exp_dir=exp_dir,
        checkpoint_base=settings.CHECKPOINT_BASE.get(env) or Path("."),
        resources_type=env.get("DET_RESOURCES_TYPE", "local-process"),
    )


def entrypoint_from_env(env: Mapping[str, str]) -> str | list[str]:
    """The experiment's entrypoint, decoded from ``DET_EXPERIMENT_CONFIG`` (the config the
    controller validated; a job's environment can still be edited, so its shape is checked)."""
    entrypoint = ConfigView.from_json(env.get("DET_EXPERIMENT_CONFIG")).entrypoint
    if entrypoint is not None:
        return entrypoint
    raise ValueError("DET_EXPERIMENT_CONFIG has no entrypoint (a string or a list of strings)")


def expand_nodelist(nodelist: str) -> list[str]:
    """A Slurm node list (``c[1-2],g1``) -> host names, in Slurm's order. In-job code uses this
    instead of the login side's squeue parser; ValueError on a malformed list."""
    if not nodelist or nodelist in ("(null)", "None"):
        return []
    try:
        # python-hostlist: the same expansion Slurm does, numeric ranges with zero padding kept.
        hosts: list[str] = hostlist.expand_hostlist(nodelist)
    except hostlist.BadHostlist as e:
        raise ValueError(f"malformed Slurm node list {nodelist!r}: {e}") from None
    return hosts
