"""Which held job an experiment's trials run in (``slurm.in_allocation``, docs/user/allocation.md).

`det e create` (and `det e fork`) inside an allocation records that allocation's job as the
config's ``slurm.allocation_id``; the step executor starts the trials as job steps of it. When
it ends the controller pauses the experiment, and `det e activate` moves it: into the
allocation it runs in, or, outside any, back to ordinary jobs once the old one has gone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from detslurm.controller.config import stored_config
from detslurm.controller.edit import _edit_config
from detslurm.errors import ConfigError
from detslurm.expconf.view import ConfigView, merge_config
from detslurm.identity import Scope
from detslurm.store import Store
from detslurm.store.models import ExperimentState
from detslurm.views import get_experiment

OUTSIDE = (
    "slurm.in_allocation: det e create runs outside a Slurm allocation (SLURM_JOB_ID is not set); "
    "run it inside `salloc` or an sbatch script, or name the held job with slurm.allocation_id"
)


def bind(raw: dict[str, Any], allocation: Optional[str], fresh: bool = False) -> dict[str, Any]:
    """``raw`` (a config before validation) bound to ``allocation`` (the SLURM_JOB_ID of the
    allocation `det` runs in) when it asks for one (``slurm.in_allocation``, which
    `det e create --in-allocation` sets). A job id the config names itself is kept, unless
    ``fresh`` (a fork, whose parent's job may have ended) and `det` runs in an allocation."""
    section = raw.get("slurm")
    slurm: dict[str, Any] = section if isinstance(section, dict) else {}
    if slurm.get("in_allocation") is not True:
        return raw
    if slurm.get("allocation_id") is not None and not (fresh and allocation):
        return merge_config(raw, {"slurm": {"in_allocation": True}})
    if not allocation:
        raise ConfigError([OUTSIDE])
    return merge_config(raw, {"slurm": {"in_allocation": True, "allocation_id": allocation}})


def rebind(
    store: Store,
    exp_id: int,
    scope: Scope,
    allocation: Optional[str],
    still_running: Callable[[str], bool],
) -> Optional[str]:
    """Before `det e activate`: where an in-allocation experiment continues, and that in words
    (None for any other experiment). Into ``allocation`` (the one `det` runs in); else in its
    own while ``still_running`` says it runs; else as ordinary jobs."""
    with store.read() as s:
        exp = get_experiment(s, exp_id, scope)
        if exp.state != ExperimentState.PAUSED or not ConfigView(exp.config).in_allocation:
            return None  # an active one stays where its trials run; ops.activate judges the rest
        slurm = stored_config(exp).slurm
    held = slurm.allocation_id
    if allocation:
        patch: dict[str, Any] = {"in_allocation": True, "allocation_id": allocation}
        said = f"its trials run as job steps of allocation {allocation}"
    elif held is not None and still_running(held):
        return f"its trials run as job steps of allocation {held}"
    else:
        patch = {"in_allocation": False, "allocation_id": None}
        said = f"allocation {held} has ended: its trials continue as ordinary Slurm jobs"
    with store.tx() as s:
        _edit_config(get_experiment(s, exp_id, scope), {"slurm": patch})
    return said
