"""A database URL's password never reaches a message: whatever is
wrong with the URL, `det` names it with the password masked, and no traceback."""

from __future__ import annotations

from typing import Any

import pytest

SECRET = "s3kr1t-pw"


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql+psycopg://alice:{SECRET}@127.0.0.1:1/detslurm",  # nothing listens there
        f"postgresql+nosuchdriver://alice:{SECRET}@127.0.0.1/detslurm",  # no such driver
        f"mysql://alice:{SECRET}@127.0.0.1:1/detslurm",  # driver not installed
        f"not a url {SECRET}",
    ],
)
def test_store_errors_mask_the_password(det: Any, monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.setenv("DETSLURM_DB_URL", url)
    code, out, err = det("e", "list")
    assert code == 1 and err.startswith("Error: cannot open the detslurm store at "), err
    assert SECRET not in out + err and "Traceback" not in err and "internal error" not in err
