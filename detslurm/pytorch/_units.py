"""Training lengths and periods: ``Batch(n)``, ``Batch([n1, n2])`` (exact points), ``Epoch(n)``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Union


class TrainUnit:
    """A training length or period in batches or epochs (Determined's ``pytorch.TrainUnit``)."""

    def __init__(self, value: Union[int, Sequence[int]]) -> None:
        if isinstance(value, int):
            if value < 0:
                raise ValueError(f"{type(self).__name__}({value}): must not be negative")
            self.value: Union[int, list[int]] = value
        else:
            # A list names exact batch counts (Batch([10, 50])) rather than a repeating period;
            # sorted so that the largest is the training length.
            self.value = sorted(int(v) for v in value)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.value})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.value == getattr(other, "value", None)

    def __hash__(self) -> int:
        # str(): a list value is not hashable; Batch(5) and Epoch(5) must differ.
        return hash((type(self).__name__, str(self.value)))

    def to_batches(self, batches_per_epoch: int) -> Union[int, list[int]]:
        raise NotImplementedError

    def hits(self, batches_done: int, batches_per_epoch: int) -> bool:
        """Whether a period of this unit ends after ``batches_done`` batches."""
        b = self.to_batches(batches_per_epoch)
        if isinstance(b, list):
            # Exact points fire once each (Batch([10, 50]) validates at 10 and 50 only), never periodically.
            return batches_done in b
        # Never at batch 0: a period ends after training, and Batch(0) means "never".
        return b > 0 and batches_done > 0 and batches_done % b == 0

    def should_stop(self, step_num: int) -> bool:
        """Determined's test of a period in this unit's own steps: whether ``step_num`` ends
        one (a value below 1 means every step; a list names the exact steps)."""
        if isinstance(self.value, list):
            return step_num in self.value
        if self.value < 1:
            return True
        return step_num > 0 and step_num % self.value == 0

    def next_hit(self, batches_done: int, batches_per_epoch: int) -> Optional[int]:
        """The first batch count after ``batches_done`` at which :meth:`hits` is true, or None."""
        b = self.to_batches(batches_per_epoch)
        if isinstance(b, list):
            return next((v for v in b if v > batches_done), None)
        return (batches_done // b + 1) * b if b > 0 else None

    @staticmethod
    def from_values(
        batches: Optional[int] = None,
        records: Optional[int] = None,
        epochs: Optional[int] = None,
        global_batch_size: Optional[int] = None,
    ) -> Optional[TrainUnit]:
        """An expconf length (``{batches|records|epochs: N}``); a value < 1 means never."""
        if batches is not None:
            return Batch(batches) if batches >= 1 else None
        if epochs is not None:
            return Epoch(epochs) if epochs >= 1 else None
        if records is not None:
            if records < 1:
                return None
            if not global_batch_size:
                raise ValueError("a length in records needs hyperparameters.global_batch_size")
            # Records become whole batches, rounded down as Determined does, but at least one.
            return Batch(max(1, records // global_batch_size))
        return None


class Batch(TrainUnit):
    def to_batches(self, batches_per_epoch: int) -> Union[int, list[int]]:
        return self.value


class Epoch(TrainUnit):
    def to_batches(self, batches_per_epoch: int) -> Union[int, list[int]]:
        if isinstance(self.value, list):
            return [v * batches_per_epoch for v in self.value]
        return self.value * batches_per_epoch


def total_batches(unit: TrainUnit, batches_per_epoch: int) -> int:
    """The batches a length means; for a list of points, the last one."""
    b = unit.to_batches(batches_per_epoch)
    return max(b) if isinstance(b, list) else b
