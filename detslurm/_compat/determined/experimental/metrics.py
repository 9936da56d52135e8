"""``determined.experimental.metrics``: the SDK's metrics classes (also in ``client``)."""

from detslurm.client import TrainingMetrics, TrialMetrics, ValidationMetrics

__all__ = ["TrainingMetrics", "TrialMetrics", "ValidationMetrics"]
