"""The typed config of a stored experiment.

The store keeps each experiment's config as plain JSON (what trials see); everything the
controller decides or renders goes through :func:`stored_config`, which validates it again, so
a row edited by hand (or by another user of a shared database) cannot reach a script unchecked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from detslurm.errors import ConfigError

# pydantic (behind expconf) costs about 0.1 s to import; read commands import this module
# through controller.ops but never validate a config, so it is loaded on first use.
if TYPE_CHECKING:
    from detslurm.expconf import ExperimentConfig
    from detslurm.store.models import Experiment


def stored_config(exp: Experiment) -> ExperimentConfig:
    """The experiment's config, validated again from its stored JSON (cached by content)."""
    from detslurm.expconf import from_stored

    try:
        # The experiment id goes into the error paths: the daemon handles many experiments per tick,
        # and the message must say which row is broken.
        return from_stored(exp.config, f"<experiment {exp.id}>")
    except ConfigError as e:
        # from None: the re-raised ConfigError already lists every problem; the chained one would only
        # repeat them in a traceback.
        raise ConfigError(e.errors, source=f"stored config of experiment {exp.id}") from None
