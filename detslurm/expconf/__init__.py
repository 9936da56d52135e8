"""Experiment configuration (Determined expconf v0): parse, override, fill defaults, validate."""

from detslurm.expconf.load import (
    ExperimentConfig,
    apply_overrides,
    from_stored,
    load_config,
    merge_config,
    parse_yaml,
    validate,
)
from detslurm.expconf.schema import Length

__all__ = [
    "ExperimentConfig",
    "Length",
    "apply_overrides",
    "from_stored",
    "load_config",
    "merge_config",
    "parse_yaml",
    "validate",
]
