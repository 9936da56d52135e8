"""``core_v2``: Determined's singleton-style Core API, managed or detached.

``from determined.experimental import core_v2`` (or ``from detslurm.experimental import
core_v2``), then ``core_v2.init(config=core_v2.Config(name=...))``, ``core_v2.train.report_*``,
``core_v2.checkpoint.store_path(...)``, ``core_v2.info.latest_checkpoint``, ``core_v2.close()``.

* Inside a managed trial (``det e create``: the trial's DET_* environment is present) it is
  ``core.init()``: the experiment's yaml wins and the Config is ignored, as in Determined.
* Anywhere else (the user's own sbatch script, srun, torchrun, a plain process) the run is
  *detached*: registered on the shared filesystem and ingested by the daemon or the next read
  command (``detslurm.core._detached``). External ids default from Slurm.
"""

from __future__ import annotations

import atexit
import dataclasses
import sys
import warnings
from types import TracebackType
from typing import Any

from detslurm.core._checkpoint import CheckpointContext
from detslurm.core._context import Context, TensorboardMode
from detslurm.core._context import init as managed_init
from detslurm.core._detached import DetachedSpec, Outcome, default_identity, make_context
from detslurm.core._distributed import DistributedContext
from detslurm.core._info import get_cluster_info
from detslurm.core._preempt import PreemptContext, PreemptMode
from detslurm.core._searcher import SearcherContext
from detslurm.core._train import TrainContext
from detslurm.protocol import ClusterInfo

__all__ = [
    "Config",
    "DefaultConfig",
    "DistributedContext",
    "PreemptMode",
    "TensorboardMode",
    "UnmanagedConfig",
    "checkpoint",
    "close",
    "distributed",
    "info",
    "init",
    "init_context",
    "preempt",
    "searcher",
    "train",
    "url_reverse_webui_exp_view",
]


@dataclasses.dataclass
class Config:
    """Determined's ``core_v2.Config``: used by detached runs, ignored inside a managed trial."""

    name: str | None = None
    hparams: dict[str, Any] | None = None
    data: dict[str, Any] | None = None
    description: str | None = None
    labels: list[str] | None = None
    workspace: str | None = None
    project: str | None = None
    checkpoint_storage: str | dict[str, Any] | None = None
    searcher: dict[str, Any] | None = None
    external_experiment_id: str | None = None
    external_trial_id: str | None = None


class DefaultConfig(Config):
    """Deprecated in Determined in favour of :class:`Config`; kept so old scripts run."""

    def __init__(self, **kwargs: Any) -> None:
        warnings.warn("'DefaultConfig' is deprecated: use core_v2.Config", FutureWarning, stacklevel=2)
        super().__init__(**kwargs)


class UnmanagedConfig(Config):
    """Deprecated in Determined in favour of :class:`Config`; kept so old scripts run."""

    def __init__(self, **kwargs: Any) -> None:
        warnings.warn("'UnmanagedConfig' is deprecated: use core_v2.Config", FutureWarning, stacklevel=2)
        super().__init__(**kwargs)


# The singleton's parts, set by init() and cleared by close(), as Determined's module globals.
train: TrainContext | None = None
checkpoint: CheckpointContext | None = None
distributed: DistributedContext | None = None
preempt: PreemptContext | None = None
searcher: SearcherContext | None = None
info: ClusterInfo | None = None

_context: Context | None = None
# Shared with the context so the excepthook can mark the run failed before atexit closes it.
_outcome = Outcome()
_hooks_installed = False


def _merge(config: Config | None, defaults: Config | None, unmanaged: Config | None) -> Config:
    # Determined's deprecated defaults/unmanaged pair folds into one Config; config wins outright.
    if config is not None:
        return config
    merged = dataclasses.replace(defaults) if defaults is not None else Config()
    if unmanaged is not None:
        for f in ("workspace", "project", "external_experiment_id", "external_trial_id"):
            if getattr(merged, f) is None:
                setattr(merged, f, getattr(unmanaged, f))
    return merged


def _spec(cfg: Config, checkpoint_storage: str | dict[str, Any] | None) -> DetachedSpec:
    if cfg.external_trial_id is not None and not cfg.external_trial_id:
        raise ValueError("core_v2.Config: external_trial_id must not be empty")
    if cfg.external_experiment_id is not None and not cfg.external_experiment_id:
        raise ValueError("core_v2.Config: external_experiment_id must not be empty")
    # Only the searcher's metric is kept (for det e describe); a detached run has no search.
    searcher_cfg = cfg.searcher or {}
    metric = searcher_cfg.get("metric")
    ident = default_identity(_environ(), cfg.external_experiment_id, cfg.external_trial_id)
    return DetachedSpec(
        identity=ident,
        name=cfg.name or f"detached-{ident.experiment}",
        description=cfg.description,
        labels=tuple(cfg.labels or ()),
        hparams=dict(cfg.hparams or {}),
        data=dict(cfg.data or {}),
        searcher_metric=metric if isinstance(metric, str) else None,
        smaller_is_better=bool(searcher_cfg.get("smaller_is_better", True)),
        checkpoint_storage=checkpoint_storage or cfg.checkpoint_storage,
    )


def _environ() -> dict[str, str]:
    import os

    return dict(os.environ)


def init_context(
    *,
    config: Config | None = None,
    defaults: Config | None = None,
    unmanaged: Config | None = None,
    client: Any = None,
    distributed: DistributedContext | None = None,
    checkpoint_storage: str | dict[str, Any] | None = None,
    preempt_mode: PreemptMode = PreemptMode.WorkersAskChief,
    tensorboard_mode: TensorboardMode = TensorboardMode.AUTO,
) -> Context:
    """A Core API context, for ``with core_v2.init_context(config=...) as ctx:``."""
    if client is not None:
        # Determined's client talks to a master; detslurm has none, and guessing would record
        # the run somewhere the user did not mean.
        raise NotImplementedError("core_v2.init(client=...) is not built: detslurm has no master to connect to")
    cluster = get_cluster_info()
    if cluster is not None and cluster.task_type == "TRIAL":
        # A managed trial: the experiment's yaml decides name, hparams and storage (Config ignored).
        return managed_init(
            distributed=distributed,
            checkpoint_storage=checkpoint_storage,
            preempt_mode=preempt_mode,
            tensorboard_mode=tensorboard_mode,
        )
    spec = _spec(_merge(config, defaults, unmanaged), checkpoint_storage)
    return make_context(spec, distributed, preempt_mode, _outcome)


def init(
    *,
    config: Config | None = None,
    defaults: Config | None = None,
    unmanaged: Config | None = None,
    client: Any = None,
    distributed: DistributedContext | None = None,
    checkpoint_storage: str | dict[str, Any] | None = None,
    preempt_mode: PreemptMode = PreemptMode.WorkersAskChief,
    tensorboard_mode: TensorboardMode = TensorboardMode.AUTO,
) -> None:
    """Start the singleton: ``core_v2.train``, ``.checkpoint``, ``.info``... are set until close()."""
    global _context
    # A second init starts a new run, as in Determined: the previous one is closed first.
    if _context is not None:
        close()
    _outcome.error, _outcome.stopped = None, False
    ctx = init_context(
        config=config,
        defaults=defaults,
        unmanaged=unmanaged,
        client=client,
        distributed=distributed,
        checkpoint_storage=checkpoint_storage,
        preempt_mode=preempt_mode,
        tensorboard_mode=tensorboard_mode,
    )
    ctx.start()
    _context = ctx
    _set_globals(ctx)
    _install_hooks()


def close() -> None:
    """End the run: flush reports and record how it ended (also run at interpreter exit)."""
    global _context
    # Cleared before closing: a close that fails must not leave a half-closed singleton behind.
    ctx, _context = _context, None
    _set_globals(None)
    if ctx is not None:
        ctx.close()


def url_reverse_webui_exp_view() -> str:
    """Determined's link to the experiment's web page; detslurm has no web UI yet."""
    raise NotImplementedError(
        "core_v2.url_reverse_webui_exp_view is not built: detslurm has no web UI (use det e describe)"
    )


def _set_globals(ctx: Context | None) -> None:
    module = sys.modules[__name__]
    for name in ("train", "checkpoint", "distributed", "preempt", "searcher", "info"):
        setattr(module, name, getattr(ctx, name) if ctx is not None else None)


def _install_hooks() -> None:
    """Once per process: close() at exit, and an uncaught exception recorded, so the run is
    closed as ERROR instead of COMPLETED (sys.excepthook runs before the atexit handlers)."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(close)
    previous = sys.excepthook

    # Chained, never replaced: the user's (or another library's) hook still prints the traceback.
    def hook(typ: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if not issubclass(typ, SystemExit):
            _outcome.error = _outcome.error or f"{typ.__name__}: {exc}"[:2000]
        previous(typ, exc, tb)

    sys.excepthook = hook
