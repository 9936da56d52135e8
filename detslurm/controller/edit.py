"""Everyday edits of an experiment's record (Determined's `det e archive`, `label`, `set ...`,
`continue`): store changes only. What Slurm must hear at once (a new nice for queued jobs) is
returned to the caller, which sends it through the one Slurm client.

Every edit stays inside the caller's :class:`Scope`, as the lifecycle operations in ops.py do.
Config edits go through the schema again (``from_stored``), so an edited row is as valid as a
created one: a label that is not a string or a priority outside 1..99 is refused here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from detslurm.controller.submit import ACTIVE_RUN
from detslurm.errors import ConfigError, StateError
from detslurm.expconf.view import ConfigView
from detslurm.identity import Scope, os_user
from detslurm.slurm.parse import experiment_tag
from detslurm.store import Store
from detslurm.store.models import Experiment, ExperimentState, Trial, TrialState
from detslurm.views import get_experiment

# Searchers whose trials can simply be resumed: Determined's ContinueExperiment refuses the rest.
CONTINUABLE = ("single", "random", "grid")


def _edit_config(exp: Experiment, patch: Mapping[str, Any]) -> None:
    """Lay ``patch`` over the stored config (mappings merge key by key), validate the result, and
    store it: a fresh dict, as the JSON column only notices a reassignment."""
    # expconf.load (pydantic) is imported where a config is validated, not at module import:
    # `det e list` and the other read commands import this module but never edit a config.
    from detslurm.expconf import from_stored, merge_config

    exp.config = from_stored(merge_config(exp.config, patch), f"<experiment {exp.id}>").as_dict()


def set_archived(store: Store, exp_id: int, archived: bool, scope: Scope | None = None) -> None:
    """Archive (hide from `det e list`) or unarchive an experiment that has ended."""
    with store.tx() as s:
        exp = get_experiment(s, exp_id, scope or Scope.mine())
        # As Determined: only an ended experiment can be archived, so nothing live ever hides.
        if archived and not exp.state.is_terminal:
            raise StateError(f"experiment {exp_id} is {exp.state}; only an ended experiment can be archived")
        exp.archived = archived


def set_labels(store: Store, exp_id: int, label: str, add: bool, scope: Scope | None = None) -> None:
    """Add or remove one label (kept in the config's ``labels``, as Determined keeps them)."""
    if not label.strip():
        raise ConfigError(["a label must not be empty"])

    with store.tx() as s:
        exp = get_experiment(s, exp_id, scope or Scope.mine())
        # Removed first, so adding a label twice keeps one copy (and moves it last, as added).
        labels = [x for x in ConfigView(exp.config).labels if x != label]
        _edit_config(exp, {"labels": [*labels, label] if add else labels})


def set_description(store: Store, exp_id: int, text: str, scope: Scope | None = None) -> None:
    """The description shown by `det e describe` (and in the config, as Determined stores it)."""
    with store.tx() as s:
        exp = get_experiment(s, exp_id, scope or Scope.mine())
        _edit_config(exp, {"description": text})
        exp.description = text


def set_name(store: Store, exp_id: int, name: str, scope: Scope | None = None) -> None:
    """Rename an experiment (the config's ``name`` follows, as in Determined)."""
    if not name.strip():
        raise ConfigError(["an experiment name must not be empty"])
    with store.tx() as s:
        exp = get_experiment(s, exp_id, scope or Scope.mine())
        _edit_config(exp, {"name": name})
        exp.name = name


@dataclass(frozen=True)
class LiveJobs:
    """Slurm jobs of an experiment that an edit should reach now (its runs that have not ended)."""

    job_ids: tuple[str, ...]
    mine: bool  # the caller owns the experiment: only then does this process touch its jobs
    slots_per_trial: int = 1
    # (experiment id, tag) of an experiment with pilot workers: its worker jobs, which the store
    # does not list, are found in the queue by their comment (slurm/pilot_job.py).
    workers_of: tuple[int, str] | None = None


def set_resource(store: Store, exp_id: int, key: str, value: int | float, scope: Scope | None = None) -> LiveJobs:
    """Set ``resources.<key>`` (max_slots, weight or priority). Later submissions use it; the
    caller applies a new priority to the jobs returned (their nice) at once."""
    if key not in ("max_slots", "weight", "priority"):
        raise ConfigError([f"resources.{key} cannot be set here (max_slots, weight or priority)"])
    with store.tx() as s:
        exp = get_experiment(s, exp_id, scope or Scope.mine())
        _edit_config(exp, {"resources": {key: value}})
        # Runs without a job id were never submitted (or their sbatch reply was lost): the
        # resubmission picks the new value up from the config anyway.
        jobs = tuple(r.job_id for t in exp.trials for r in t.runs if r.state in ACTIVE_RUN and r.job_id)
        view = ConfigView(exp.config)
        slots = view.resources.slots_per_trial or 1
        workers = (exp.id, experiment_tag(exp.exp_dir)) if view.has_pilots else None
        return LiveJobs(jobs, exp.owner == os_user(), slots, workers)


def save_priority(store: Store, exp_id: int, priority: int, *, tag: str, scope: Scope | None = None) -> bool:
    """Keep a priority given with `det job update` in the experiment's config, so the trial's
    next submission (a restart, a resume after pause or preemption) gets the same nice.

    ``tag`` comes from the job's comment, as for pool moves: the id alone may be another store's
    experiment. Returns whether an experiment of this store was changed."""
    with store.tx() as s:
        exp = s.get(Experiment, exp_id)
        if exp is None or not (scope or Scope.mine()).sees(exp.owner) or tag != experiment_tag(exp.exp_dir):
            return False
        _edit_config(exp, {"resources": {"priority": priority}})
        return True


def continue_experiment(
    store: Store,
    exp_id: int,
    overrides: Sequence[str] = (),
    scope: Scope | None = None,
    patch: Mapping[str, Any] | None = None,
) -> int:
    """Determined's `det e continue`: an ended experiment trains on, from each unfinished trial's
    latest checkpoint, with the same experiment and trial ids (``patch``: a --config-file laid
    over the config, then ``overrides``). Returns how many trials resume."""
    with store.tx() as s:
        exp = get_experiment(s, exp_id, scope or Scope.mine())
        name = ConfigView(exp.config).searcher.name
        if name not in CONTINUABLE:
            raise StateError(f"Unsupported searcher type provided: '{name}' (continue works for single, random, grid)")
        if not exp.state.is_terminal:
            raise StateError(f"experiment in non terminal state '{exp.state}', try again later")
        if (overrides or patch) and name != "single":
            raise StateError("config overrides are only allowed for single-searcher experiments")
        if overrides or patch:
            from detslurm.expconf import apply_overrides, from_stored, merge_config

            raw = apply_overrides(merge_config(exp.config, patch or {}), overrides)
            exp.config = from_stored(raw, "--config").as_dict()
        multi = len(exp.trials) > 1
        # A multi-trial experiment skips its completed trials; a single one trains its trial on.
        todo = [t for t in exp.trials if not (multi and t.state == TrialState.COMPLETED)]
        if not todo:
            raise StateError("experiment has been completed, cannot continue this experiment")
        _reopen(exp, [t.request_id for t in todo])
        for t in todo:
            _reopen_trial(exp, t)
        # ACTIVE straight away (Determined goes PAUSED then activates): the controller's next tick
        # submits a run for every reopened trial, from its latest checkpoint.
        exp.state = ExperimentState.ACTIVE
        exp.end_time = None
        exp.error_message = None
        return len(todo)


def _reopen(exp: Experiment, request_ids: list[str]) -> None:
    """Forget that the searcher saw these trials end, so their next exit ends the search again."""
    state: dict[str, Any] = json.loads(json.dumps(exp.searcher_state or {}))
    book = state.setdefault("book", {})
    for key in ("closed", "canceled", "errored", "invalid"):
        book[key] = [r for r in book.get(key, []) if r not in request_ids]
    book["shut_down"] = False
    # Reassigned as a new dict: the JSON column only notices a new value.
    exp.searcher_state = state


def _reopen_trial(exp: Experiment, t: Trial) -> None:
    t.state = TrialState.ACTIVE
    # ContinueExperiment resets restarts: the trial gets its full max_restarts again.
    t.restarts = 0
    t.end_time = None
    t.exit_reason = None
    # An early stop (ASHA, test mode) would end the new run at once; continue means train on.
    t.early_stopped = False
    length = ConfigView(exp.config).searcher.max_length
    if t.searcher_ops:
        # 0.37-style trials train to absolute lengths: the (new) max_length is the next target.
        target = length.value if length else 0
        if target <= int(t.searcher_ops[-1]):
            raise StateError(
                f"trial {t.id} already trained to {t.searcher_ops[-1]}: give a larger searcher.max_length "
                "with --config to continue it"
            )
        t.searcher_ops = [*t.searcher_ops, target]
        t.ops_idle = False
