"""``core_context.experimental``: Determined's links from a task to the checkpoint or model
version it uses (for inference runs).

Determined records the link in its master so that the web UI can list, under a checkpoint, the
metrics of the tasks that used it. detslurm's store has no such link (and no model registry),
so the calls are accepted, named in the trial's log once, and otherwise change nothing: the
metrics a script reports are still kept under its own trial.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("detslurm.core")


class ExperimentalCoreContext:
    """Built by ``core.init()`` for a trial (Determined's takes the master's session)."""

    def __init__(self, trial_id: int) -> None:
        self._trial_id = trial_id
        self._warned = False

    def _not_linked(self, what: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("core_context.experimental.%s(): detslurm does not link a task to what it uses", what)

    def report_task_using_checkpoint(self, checkpoint: Any) -> None:
        if not getattr(checkpoint, "uuid", None):
            raise TypeError(
                f"report_task_using_checkpoint() takes a Checkpoint (with a uuid), not {type(checkpoint).__name__}"
            )
        self._not_linked("report_task_using_checkpoint")

    def report_task_using_model_version(self, model_version: Any) -> None:
        self._not_linked("report_task_using_model_version")


class DummyExperimentalCoreContext(ExperimentalCoreContext):
    """Off-cluster twin: the calls do nothing."""

    def __init__(self) -> None:
        super().__init__(0)

    def report_task_using_checkpoint(self, checkpoint: Any) -> None:
        pass

    def report_task_using_model_version(self, model_version: Any) -> None:
        pass
