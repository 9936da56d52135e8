"""Typed models for expconf v0. Field names and defaults follow Determined's schema.

Every model forbids unknown keys and names the valid ones, and is strict about types (a string
is not an int), because a typo in a config should fail on the login node, not after hours in
the queue.
"""

from __future__ import annotations

import os
import time
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Strict(BaseModel):
    """Base for every expconf model: unknown keys and wrong types are errors, never dropped or coerced."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class Length(Strict):
    """A training length: exactly one of batches, records or epochs."""

    batches: int | None = Field(default=None, ge=0)
    records: int | None = Field(default=None, ge=0)
    epochs: int | None = Field(default=None, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _from_any(cls, data: Any) -> Any:
        # Determined accepts a bare integer as a number of batches (the pre-0.38 ``max_length: 100``);
        # bool is an int subclass, and ``true`` must not read as one batch.
        if isinstance(data, int) and not isinstance(data, bool):
            return {"batches": data}
        # Determined's own wording, so users searching the message find its docs.
        if isinstance(data, dict) and len(data) != 1:
            raise ValueError('a length object must have one attribute named "batches", "records", or "epochs"')
        return data

    @property
    def unit(self) -> str:
        for u in ("batches", "records", "epochs"):
            if getattr(self, u) is not None:
                return u
        return "batches"

    @property
    def value(self) -> int:
        v = getattr(self, self.unit)
        return int(v) if v is not None else 0

    def to_json(self) -> dict[str, int]:
        """The one-key form a user writes (``{"epochs": 2}``), as stored and shown back."""
        return {self.unit: self.value}


class SearcherCommon(Strict):
    metric: str | None = None
    smaller_is_better: bool = True
    source_trial_id: int | None = None
    source_checkpoint_uuid: str | None = None
    max_length: Length | None = None


# The Literal ``name`` on each searcher lets load.py pick the model from SEARCHERS by name,
# so errors point into that searcher's own fields instead of a union's mixed message.
class SingleSearcher(SearcherCommon):
    name: Literal["single"] = "single"


class RandomSearcher(SearcherCommon):
    name: Literal["random"] = "random"
    max_trials: int | None = Field(default=None, ge=1)
    max_concurrent_trials: int = Field(default=16, ge=0)


class GridSearcher(SearcherCommon):
    name: Literal["grid"] = "grid"
    max_concurrent_trials: int = Field(default=16, ge=0)


class AdaptiveASHASearcher(SearcherCommon):
    name: Literal["adaptive_asha"] = "adaptive_asha"
    max_trials: int | None = Field(default=None, ge=1)
    mode: Literal["aggressive", "standard", "conservative"] = "standard"
    divisor: float = Field(default=4.0, gt=1)
    max_rungs: int = Field(default=5, ge=1)
    max_concurrent_trials: int = Field(default=16, ge=0)
    bracket_rungs: list[int] = Field(default_factory=list)
    time_metric: str | None = None
    max_time: int | None = Field(default=None, ge=1)
    # Deprecated in Determined 0.38; still accepted so older configs validate.
    stop_once: bool = False


SearcherConfig = Union[SingleSearcher, RandomSearcher, GridSearcher, AdaptiveASHASearcher]
SEARCHERS: dict[str, type[Strict]] = {
    "single": SingleSearcher,
    "random": RandomSearcher,
    "grid": GridSearcher,
    "adaptive_asha": AdaptiveASHASearcher,
}
# End-of-life in Determined (its AssertCurrent rejects them); async_halving is rejected here too,
# as this port implements only the four searchers above.
REMOVED_SEARCHERS = ("custom", "adaptive", "adaptive_simple", "sync_halving", "async_halving")


class Resources(Strict):
    # 0 slots is a CPU-only trial as in Determined: slurm/render.py then asks for no gres and no CPUs.
    slots_per_trial: int = Field(default=1, ge=0)
    resource_pool: str = ""
    # Determined's 1..99 range (smaller = higher in its agent RM).
    priority: int | None = Field(default=None, ge=1, le=99)
    weight: float = Field(default=1.0, ge=0)
    max_slots: int | None = Field(default=None, ge=0)
    is_single_node: bool | None = None
    # shm_size, devices, native_parallel and agent_label are container or agent settings with no
    # Slurm counterpart: accepted so Determined configs load unchanged, and not acted on.
    shm_size: int | str | None = None
    devices: list[Any] = Field(default_factory=list)
    native_parallel: bool = False
    agent_label: str | None = None


# Determined's checkpoint GC defaults: keep each trial's best and latest, nothing extra per
# experiment.
class GCPolicy(Strict):
    save_experiment_best: int = Field(default=0, ge=0)
    save_trial_best: int = Field(default=1, ge=0)
    save_trial_latest: int = Field(default=1, ge=0)


class SharedFSStorage(GCPolicy):
    type: Literal["shared_fs"] = "shared_fs"
    host_path: str | None = None
    storage_path: str | None = None
    propagation: str = "rprivate"
    container_path: str | None = None
    checkpoint_path: str | None = None

    @model_validator(mode="after")
    def _paths(self) -> SharedFSStorage:
        # A relative host_path would resolve against whichever directory each node's job starts in.
        if self.host_path is not None and not os.path.isabs(self.host_path):
            raise ValueError("host_path must be an absolute path")
        sp, hp = self.storage_path, self.host_path
        # Determined's rule: checkpoints stay below host_path, so storage_path is relative (without
        # "..") or an absolute path inside host_path.
        if sp and hp and os.path.isabs(sp) and os.path.commonpath([sp, hp]) != os.path.normpath(hp):
            raise ValueError("storage_path must either be a relative directory or a subdirectory of host_path")
        if self.storage_path and not os.path.isabs(self.storage_path) and ".." in self.storage_path.split("/"):
            raise ValueError("storage_path must either be a relative directory or a subdirectory of host_path")
        return self

    def base_path(self) -> str:
        # load.py reports a missing host_path before a config is ever built, so this cannot fire on
        # user input.
        assert self.host_path is not None
        if not self.storage_path:
            return self.host_path
        return os.path.join(self.host_path, self.storage_path)


class DirectoryStorage(GCPolicy):
    type: Literal["directory"] = "directory"
    container_path: str

    @model_validator(mode="after")
    def _abs(self) -> DirectoryStorage:
        if not os.path.isabs(self.container_path):
            raise ValueError("container_path must be an absolute path")
        return self

    def base_path(self) -> str:
        return self.container_path


StorageConfig = Union[SharedFSStorage, DirectoryStorage]
STORAGES: dict[str, type[Strict]] = {"shared_fs": SharedFSStorage, "directory": DirectoryStorage}


# environment_variables are exported in the sbatch script; image, force_pull_image and
# registry_auth are applied by the site's container runtime (slurm/containers.py); ports,
# capabilities and pod_spec are kept so Determined configs validate (warned about at create).
class Environment(Strict):
    image: str | dict[str, str] | None = None
    environment_variables: list[str] | dict[str, list[str]] = Field(default_factory=list)
    force_pull_image: bool = False
    registry_auth: dict[str, Any] | None = None
    ports: dict[str, int] = Field(default_factory=dict)
    proxy_ports: list[Any] = Field(default_factory=list)
    add_capabilities: list[str] = Field(default_factory=list)
    drop_capabilities: list[str] = Field(default_factory=list)
    pod_spec: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_image(self) -> Environment:
        images = self.image.values() if isinstance(self.image, dict) else [self.image] if self.image else []
        for image in images:
            # The runtimes take the image as a positional argument: "-..." would be read as an option.
            if image.startswith("-") or not image.strip() or not image.isprintable():
                raise ValueError(f"image {image!r} is not an image name")
        return self

    def variables(self, kind: str = "cpu") -> dict[str, str]:
        """The user's variables for one device kind (a plain list applies to every kind)."""
        ev = self.environment_variables
        items = ev.get(kind, []) if isinstance(ev, dict) else ev
        # Split at the first "=", so a value may itself contain "=".
        return dict(item.partition("=")[::2] for item in items)


# Mounted into the trial's container (slurm/containers.py); without one there is nothing to mount.
# Checked with Determined's messages so a config that works there is not silently different here.
class BindMount(Strict):
    host_path: str
    container_path: str
    read_only: bool = False
    propagation: str = "rprivate"

    @model_validator(mode="after")
    def _check(self) -> BindMount:
        if not self.host_path.startswith("/"):
            raise ValueError("host_path must be an absolute path")
        if self.container_path == ".":
            raise ValueError('container_path must not be "."')
        for name, path in (("host_path", self.host_path), ("container_path", self.container_path)):
            # Every runtime's mount option (--bind SRC:DST:ro, -v, --container-mounts a,b) splits
            # at these: such a path would silently become other mounts or mount options.
            bad = sorted({c for c in path if c in ":," or not c.isprintable()})
            if bad:
                raise ValueError(
                    f"{name} {path!r} must not contain {', '.join(map(repr, bad))} (mount options split there)"
                )
        return self


# detslurm's: pilot workers (docs/user/allocation.md): worker jobs that hold their nodes and
# run the experiment's trial runs as job steps, so the queue wait is paid once per worker.
class PilotsSection(Strict):
    count: int = Field(ge=1)
    # Slots each worker holds (the trial's resources.slots_per_trial when unset): a worker of 4
    # slots runs four 1-slot trials at once.
    slots: int | None = Field(default=None, ge=0)
    time_limit: int = Field(default=60, ge=1)  # minutes: each worker job's --time
    # Seconds a worker no run needs is kept while the experiment has runs (the daemon cancels
    # it after); and a worker whose daemon has not renewed its lease for this long, with no
    # trial running in it, ends itself: no allocation is held idle when the daemon is gone.
    idle_timeout: int = Field(default=60, ge=10)


class SlurmSection(Strict):
    sbatch_args: list[str] = Field(default_factory=list)
    gpu_type: str | None = None
    slots_per_node: int | None = Field(default=None, ge=1)
    # detslurm's: run the trials as job steps of a job the user holds (docs/user/allocation.md).
    # `det e create --in-allocation` sets it; the create records the job (SLURM_JOB_ID of the
    # allocation it runs in) as allocation_id, and `det e activate` may move it to another.
    in_allocation: bool = False
    allocation_id: str | None = Field(default=None, pattern=r"^[0-9]+$")
    pilots: PilotsSection | None = None

    @model_validator(mode="after")
    def _allocation_needs_the_switch(self) -> SlurmSection:
        if self.allocation_id is not None and not self.in_allocation:
            raise ValueError("allocation_id is set but in_allocation is not: set slurm.in_allocation: true")
        if self.pilots is not None and self.in_allocation:
            raise ValueError("pilots and in_allocation exclude each other: trials run in workers or in your allocation")
        return self


# Determined's PBS section; accepted so one config can serve both schedulers, and ignored here.
class PBSSection(Strict):
    pbsbatch_args: list[str] = Field(default_factory=list)
    slots_per_node: int | None = Field(default=None, ge=1)


class Reproducibility(Strict):
    # Determined defaults the seed to the current time; the modulus keeps it a non-negative int32.
    experiment_seed: int = Field(default_factory=lambda: int(time.time()) % (2**31), ge=0)


class TopLevel(Strict):
    """Everything but `searcher`, `hyperparameters` and `checkpoint_storage`, which are unions
    or recursive and get their own validation (so their errors carry precise paths)."""

    bind_mounts: list[BindMount] = Field(default_factory=list)
    checkpoint_policy: Literal["best", "all", "none"] = "best"
    # The Any fields are validated separately by load.py; typed here they would be checked twice,
    # with less precise error paths.
    checkpoint_storage: Any = None
    data: dict[str, Any] = Field(default_factory=dict)
    debug: bool = False
    description: str | None = None
    entrypoint: str | list[str] | None = None
    environment: Environment = Field(default_factory=Environment)
    hyperparameters: Any = Field(default_factory=dict)
    labels: list[str] = Field(default_factory=list)
    log_policies: list[Any] = Field(default_factory=list)
    # Counts per trial, not per experiment, as in Determined (see controller/decide.py).
    max_restarts: int = Field(default=5, ge=0)
    min_checkpoint_period: Length = Field(default_factory=lambda: Length(batches=0))
    min_validation_period: Length = Field(default_factory=lambda: Length(batches=0))
    name: str | None = None
    optimizations: dict[str, Any] = Field(default_factory=dict)
    pbs: PBSSection = Field(default_factory=PBSSection)
    perform_initial_validation: bool = False
    preemption_timeout: int | None = Field(default=None, ge=0)
    profiling: dict[str, Any] = Field(default_factory=dict)
    project: str = ""
    records_per_epoch: int = Field(default=0, ge=0)
    reproducibility: Reproducibility = Field(default_factory=Reproducibility)
    resources: Resources = Field(default_factory=Resources)
    scheduling_unit: int = Field(default=100, ge=1)
    searcher: Any = None
    slurm: SlurmSection = Field(default_factory=SlurmSection)
    workspace: str = ""
