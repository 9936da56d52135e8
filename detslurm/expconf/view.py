"""A cheap typed view of a stored experiment config: what every side reads it through.

The store keeps each experiment's config as plain JSON, validated and with defaults filled when
it was stored (:func:`detslurm.expconf.validate`); trials get the same JSON in
``DET_EXPERIMENT_CONFIG``. Reading a field needs no validation again, only the field's name,
type and default in one place: here. The login side, the dashboard and the in-job side read a
stored config through :class:`ConfigView`; what the controller decides or renders still goes
through :func:`detslurm.expconf.from_stored`, which validates the whole config again, so that a
row edited by hand cannot reach a script unchecked.

Reads are lenient: a missing, null or mistyped value reads as the schema's default (the JSON was
checked when stored; a job's environment is text anyone could edit, and a read must not crash a
trial over a field it does not use). Standard library only: trials and launchers import it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, NamedTuple, TypeVar

T = TypeVar("T")
# Paths into the stored JSON, for readers that cannot hold the config in Python: the dashboard's
# list asks the database for these fields of 10,000 experiments in one query.
SEARCHER_NAME = ("searcher", "name")
SEARCHER_METRIC = ("searcher", "metric")
SMALLER_IS_BETTER = ("searcher", "smaller_is_better")
_UNITS = ("batches", "records", "epochs")


def _typed(value: Any, kind: type[T], default: T) -> T:
    # bool is an int subclass: ``true`` must not read as 1 where a number is asked for.
    if isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool):
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)  # type: ignore[return-value]  # kind is float here
    return default


def _section(data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = data.get(key)
    return value if isinstance(value, Mapping) else {}


def merge_config(base: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``patch`` laid over it: mappings merge key by key, anything else replaces
    (the ``--config-file`` of `det e continue` and `det e fork`, and every edit of a stored
    config). Neither input is changed: the result is a fresh copy in plain JSON types."""
    out: dict[str, Any] = json.loads(json.dumps(base))
    for key, value in patch.items():
        old = out.get(key)
        out[key] = merge_config(old, value) if isinstance(old, dict) and isinstance(value, dict) else value
    return out


class LengthView(NamedTuple):
    """A training length: ``value`` batches, records or epochs (``unit``)."""

    unit: str
    value: int

    def as_dict(self) -> dict[str, int]:
        """The one-key form the config holds (``{"epochs": 2}``)."""
        return {self.unit: self.value}


def _length(value: Any) -> LengthView | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return LengthView("batches", value)  # Determined's pre-0.38 bare number of batches
    if isinstance(value, Mapping) and len(value) == 1:
        ((unit, n),) = value.items()
        if unit in _UNITS and isinstance(n, int) and not isinstance(n, bool):
            return LengthView(unit, n)
    return None


class SearcherView:
    """The ``searcher`` section."""

    __slots__ = ("_d",)

    def __init__(self, data: Mapping[str, Any]) -> None:
        self._d = data

    @property
    def name(self) -> str:
        return _typed(self._d.get("name"), str, "")

    @property
    def metric(self) -> str:
        """The searcher's metric; "" when the config names none."""
        return _typed(self._d.get("metric"), str, "")

    @property
    def smaller_is_better(self) -> bool:
        return _typed(self._d.get("smaller_is_better"), bool, True)

    @property
    def max_length(self) -> LengthView | None:
        return _length(self._d.get("max_length"))


class ResourcesView:
    """The ``resources`` section."""

    __slots__ = ("_d",)

    def __init__(self, data: Mapping[str, Any]) -> None:
        self._d = data

    @property
    def slots_per_trial(self) -> int:
        return _typed(self._d.get("slots_per_trial"), int, 1)

    @property
    def resource_pool(self) -> str:
        return _typed(self._d.get("resource_pool"), str, "")


class ConfigView:
    """A stored experiment config (plain JSON), read field by field with the schema's defaults."""

    __slots__ = ("raw",)

    def __init__(self, raw: Mapping[str, Any] | None) -> None:
        self.raw: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}

    @classmethod
    def from_json(cls, text: str | None) -> ConfigView:
        """From the JSON text of ``DET_EXPERIMENT_CONFIG``; text that is not a JSON object reads as
        an empty config (every field its default)."""
        try:
            data = json.loads(text or "{}")
        except ValueError:
            data = None
        return cls(data if isinstance(data, dict) else None)

    @property
    def searcher(self) -> SearcherView:
        return SearcherView(_section(self.raw, "searcher"))

    @property
    def resources(self) -> ResourcesView:
        return ResourcesView(_section(self.raw, "resources"))

    @property
    def name(self) -> str:
        return _typed(self.raw.get("name"), str, "") or "Experiment"

    @property
    def labels(self) -> list[str]:
        value = self.raw.get("labels")
        return [x for x in value if isinstance(x, str)] if isinstance(value, list) else []

    @property
    def entrypoint(self) -> str | list[str] | None:
        """A non-empty string or list of strings; None otherwise."""
        value = self.raw.get("entrypoint")
        if isinstance(value, str) and value:
            return value
        if isinstance(value, list) and value and all(isinstance(w, str) for w in value):
            return list(value)
        return None

    @property
    def debug(self) -> bool:
        return _typed(self.raw.get("debug"), bool, False)

    @property
    def data(self) -> dict[str, Any]:
        return _typed(self.raw.get("data"), dict, {})

    @property
    def hyperparameters(self) -> dict[str, Any]:
        """The ``hyperparameters`` section as written (a trial's own values, or the search space)."""
        return _typed(self.raw.get("hyperparameters"), dict, {})

    @property
    def optimizations(self) -> dict[str, Any]:
        return _typed(self.raw.get("optimizations"), dict, {})

    @property
    def records_per_epoch(self) -> int:
        return _typed(self.raw.get("records_per_epoch"), int, 0)

    @property
    def preemption_timeout(self) -> int | None:
        """Seconds; None when unset (or not a non-negative number of seconds)."""
        value = _typed(self.raw.get("preemption_timeout"), int, -1)
        return value if value >= 0 else None

    @property
    def scheduling_unit(self) -> int:
        """Batches per report of a legacy trial (Determined's default 100)."""
        return _typed(self.raw.get("scheduling_unit"), int, 100)

    @property
    def checkpoint_policy(self) -> str:
        return _typed(self.raw.get("checkpoint_policy"), str, "best")

    @property
    def perform_initial_validation(self) -> bool:
        return _typed(self.raw.get("perform_initial_validation"), bool, False)

    @property
    def aggregation_frequency(self) -> int:
        """``optimizations.aggregation_frequency``: batches per optimizer step (pytorch.init checks it)."""
        return _typed(self.optimizations.get("aggregation_frequency"), int, 1)

    @property
    def average_aggregated_gradients(self) -> bool:
        """``optimizations.average_aggregated_gradients`` (Determined's default: averaged)."""
        return _typed(self.optimizations.get("average_aggregated_gradients"), bool, True)

    @property
    def in_allocation(self) -> bool:
        """``slurm.in_allocation``: the trials run as job steps of an allocation the user holds."""
        return _typed(_section(self.raw, "slurm").get("in_allocation"), bool, False)

    @property
    def has_pilots(self) -> bool:
        """``slurm.pilots`` is set: the trials run in pilot worker jobs the daemon keeps."""
        return isinstance(_section(self.raw, "slurm").get("pilots"), Mapping)

    @property
    def experiment_seed(self) -> int:
        return _typed(_section(self.raw, "reproducibility").get("experiment_seed"), int, 0)

    def length(self, key: str) -> LengthView | None:
        """A top-level length (``min_validation_period``, ``min_checkpoint_period``)."""
        return _length(self.raw.get(key))

    def constant_hparam(self, name: str) -> Any:
        """The value of hyperparameter ``name`` when it is a constant (``{"type": "const",
        "val": 32}`` or a plain value); None when it is searched over or absent."""
        value = _section(self.raw, "hyperparameters").get(name)
        if isinstance(value, Mapping):
            return value.get("val") if value.get("type") == "const" else None
        return value
