"""`det e describe` / `det t describe`: a warning when a trial's stop took longer than the site
allows (docs/design/preemption.md). The budget itself is detslurm/slurm/budget.py; this only probes Slurm."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from detslurm.cli.app import App
from detslurm.errors import DetSlurmError
from detslurm.slurm.budget import Budget, preemption_budget, slow_stops


def budget_for(app: App, resource_pool: str) -> Optional[Budget]:
    """The budget of the pool's partition, or None when Slurm cannot be asked (no Slurm here,
    a local experiment, or slurmctld not answering: describe must still work then)."""
    try:
        _, pool = app.site().pool(resource_pool)
        parts = {p.name: p for p in app.client.partitions()}
        return preemption_budget(app.client.capabilities(), parts.get(pool.partition), app.site())
    except (DetSlurmError, OSError):
        return None


def warnings(app: App, resource_pool: str, stops: Sequence[tuple[int, int, Optional[float]]]) -> list[str]:
    """One line per run whose measured stop time is over the budget."""
    if not any(measured is not None for _, _, measured in stops):
        return []  # nothing measured: no Slurm call at all
    budget = budget_for(app, resource_pool)
    return [] if budget is None else [s.message() for s in slow_stops(stops, budget)]
