"""``determined.experimental``: ``client`` and the SDK's classes load on first use (they need
the login node's store)."""

from typing import Any as _Any


def __getattr__(name: str) -> _Any:
    from detslurm import experimental

    return getattr(experimental, name)


def __dir__() -> list:  # type: ignore[type-arg]
    from detslurm import experimental

    return sorted({*globals(), *experimental.__all__})


from detslurm.experimental import __all__  # noqa: E402, F401
