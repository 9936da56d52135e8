"""The Trainer's metrics: each training window reported, and validation run, reported and used
to decide which checkpoints to keep (``checkpoint_policy``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional

import torch

from detslurm.expconf.view import ConfigView, SearcherView
from detslurm.pytorch._data import Shard, evaluation_loader
from detslurm.pytorch._reducer import Reducer, reduce_rows, reduce_values, scalar
from detslurm.pytorch._trainer_checkpoints import _Checkpoints
from detslurm.pytorch._trial import PyTorchTrial


class _Metrics(_Checkpoints):
    # -- training reports ----------------------------------------------------------------
    def _custom_reductions(self, training: bool) -> dict[str, Any]:
        """The wrapped reducers' metrics, then every reducer reset: as in Determined, each
        training window and each validation starts from reset reducers."""
        out = self.context.reduce_metrics(for_training=training)
        self.context.reset_reducers()
        return out

    def _report_training(self, pending: list[dict[str, Any]]) -> None:
        if not pending:
            return
        _to_numbers(pending)
        batch_metrics = _across_ranks(pending, self.context.distributed)
        pending.clear()
        keys = set().union(*(m.keys() for m in batch_metrics))
        avg = {k: reduce_values([m[k] for m in batch_metrics if k in m], Reducer.AVG) for k in keys}
        avg.update(self._custom_reductions(training=True))
        # Where training is, unless the trial reported keys of those names (as Determined does).
        avg.setdefault("batches", self.batches_trained)
        avg.setdefault("epochs", self.batches_trained // self._bpe)
        if self.core is not None and self.context.is_chief():
            # Every rank takes part in the reductions above (collectives), only the chief reports:
            # the store gets one row per window, not one per rank.
            self.core.train.report_training_metrics(self.batches_trained, avg, batch_metrics=batch_metrics)
            if self.step_timings:
                t = self.step_timings
                self.core.train.report_metrics(
                    "profiling",
                    self.batches_trained,
                    {
                        "train_batch_s_mean": sum(t) / len(t),
                        "train_batch_s_max": max(t),
                        "samples": len(t),
                        "records_per_s": self._records_timed / max(sum(t), 1e-9),
                    },
                )
        for cb in self.callbacks.values():
            cb.on_training_workload_end(avg, batch_metrics)

    # -- validation ----------------------------------------------------------------------
    def _evaluate(self, test_mode: bool) -> dict[str, Any]:
        ctx = self.context
        ctx.reset_reducers()
        for m in ctx.models:
            m.eval()
        with torch.no_grad():
            # An overridden evaluate_full_dataset wins, as in Determined: the user asked to see the
            # whole validation set at once.
            if self._full_dataset_defined():
                metrics = self._evaluate_full_dataset()
            else:
                metrics = self._evaluate_batches(test_mode)
        for m in ctx.models:
            m.train()
        metrics.update(self._custom_reductions(training=False))
        return metrics

    def _full_dataset_defined(self) -> bool:
        return type(self.trial).evaluate_full_dataset is not PyTorchTrial.evaluate_full_dataset

    def _evaluate_full_dataset(self) -> dict[str, Any]:
        """On the chief only, over the whole (unsharded) validation data; the others get the result."""
        dist = self.context.distributed
        metrics: Optional[dict[str, Any]] = None
        if dist.rank == 0:
            loader = evaluation_loader(self._val_source, Shard(), self.context.get_trial_seed())
            metrics = {k: scalar(v) for k, v in self.trial.evaluate_full_dataset(loader).items()}
        result: Optional[dict[str, Any]] = dist.broadcast(metrics) if dist.size > 1 else metrics
        assert result is not None
        return result

    def _evaluate_batches(self, test_mode: bool) -> dict[str, Any]:
        loader = evaluation_loader(self._val_source, self._shard(), self.context.get_trial_seed())
        # Any: the user's evaluate_batch may be the one-argument form (see __init__).
        evaluate: Any = self.trial.evaluate_batch

        def outputs() -> Iterator[Any]:
            for i, batch in enumerate(loader):
                if self.context.experimental._auto_to_device:
                    batch = self.context.to_device(batch)
                yield evaluate(batch, i) if self._eval_takes_idx else evaluate(batch)
                if test_mode:
                    break

        return self._evaluation_metrics(outputs())

    def _evaluation_metrics(self, outputs: Iterator[Any]) -> dict[str, Any]:
        """The validation callbacks around ``outputs`` (evaluate_batch's results, drawn lazily so
        that the batches run between the callbacks), each checked, then reduced across ranks."""
        rows: list[dict[str, Any]] = []
        for cb in self.callbacks.values():
            cb.on_validation_epoch_start()
        for out in outputs:
            if not isinstance(out, dict):
                raise TypeError(f"evaluate_batch() must return a dict of metrics, not {type(out).__name__}")
            rows.append({k: scalar(v) for k, v in out.items()})
        for cb in self.callbacks.values():
            cb.on_validation_epoch_end(rows)
        return reduce_rows(rows, self.trial.evaluation_reducer(), self.context.distributed)

    def _validate(self, test_mode: bool) -> None:
        # A step can be both a period boundary and the end of training: validate it once only.
        if self._last_val_at == self.batches_trained:
            return
        for cb in self.callbacks.values():
            cb.on_validation_start()
        metrics = self._evaluate(test_mode)
        # Callbacks see the trial's own metrics; the report adds where training is, unless the
        # trial reported keys of those names itself (Determined's order and rule).
        for cb in self.callbacks.values():
            cb.on_validation_end(metrics)
        metrics.setdefault("batches", self.batches_trained)
        metrics.setdefault("epochs", self.batches_trained // self._bpe)
        self._last_val_at = self.batches_trained
        sc = ConfigView(self.context.get_experiment_config()).searcher
        metric = sc.metric
        # On a cluster the searcher needs this metric to decide; failing here names the cause,
        # where a missing metric would otherwise stall or mislead the search.
        if self._on_cluster() and metric and metric not in metrics:
            raise RuntimeError(
                f"the searcher metric {metric!r} is not in the validation metrics "
                f"({', '.join(sorted(metrics))}); return it from evaluate_batch/evaluate_full_dataset"
            )
        if self.core is not None and self.context.is_chief():
            self.core.train.report_validation_metrics(self.batches_trained, metrics)
        if self._policy == "all" or (self._policy == "best" and self._is_best(metrics, sc)):
            self._checkpoint()

    def _is_best(self, metrics: dict[str, Any], sc: SearcherView) -> bool:
        v = metrics.get(sc.metric)
        if not isinstance(v, (int, float)):
            return False
        # True is Determined's default for searcher.smaller_is_better (losses).
        sign = 1.0 if sc.smaller_is_better else -1.0
        if self._best is None or sign * v < sign * self._best:
            self._best = float(v)
            return True
        return False


def _across_ranks(rows: list[dict[str, Any]], dist: Any) -> list[dict[str, Any]]:
    """A window's per-batch metrics as Determined reports them: with several ranks, each batch's
    metrics averaged over the ranks (a value of several numbers becomes the mean of all of
    them); with one, the rank's own rows. Ranks with no rows (those of a pipeline that do not
    report) are left out."""
    if dist.size == 1:
        return list(rows)
    everyone = [r for r in dist.allgather(rows) if r]
    batches = [[ranks[i] for ranks in everyone if i < len(ranks)] for i in range(max(map(len, everyone)))]
    return [{k: reduce_values([r[k] for r in batch if k in r], Reducer.AVG) for k in batch[0]} for batch in batches]


def _to_numbers(pending: list[dict[str, Any]]) -> None:
    """Every tensor metric of the window made a plain number, in one transfer per device and
    dtype (an integer count stays an int, as ``.item()`` would give it)."""
    where = [(row, k) for row in pending for k, v in row.items() if isinstance(v, torch.Tensor)]
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[dict[str, Any], str]]] = {}
    for row, k in where:
        groups.setdefault((row[k].device, row[k].dtype), []).append((row, k))
    for places in groups.values():
        # reshape() only where needed: it costs a dispatch (~5 us) per value even when a no-op.
        values = torch.stack([row[k] if row[k].dim() == 0 else row[k].reshape(()) for row, k in places]).tolist()
        for (row, k), value in zip(places, values, strict=True):
            row[k] = value
