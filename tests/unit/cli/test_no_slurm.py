"""The queue commands on a machine with the Slurm client but no cluster configured (a laptop):
one line that says so and names local mode, not Slurm's DNS SRV errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

# What Slurm 22.05's squeue and sinfo print, and their exit code, on a machine with no
# slurm.conf and no configless DNS record (captured on this project's test machine).
NO_CONF = """#!/bin/sh
echo "$(basename "$0"): error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host" >&2
echo "$(basename "$0"): error: _establish_config_source: failed to fetch config" >&2
echo "$(basename "$0"): fatal: Could not establish a configuration source" >&2
exit 1
"""


@pytest.mark.parametrize(("argv", "command"), [(["job", "list"], "squeue"), (["rp", "list"], "sinfo")])
def test_queue_commands_say_no_slurm_is_configured(
    det: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str], command: str
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("squeue", "sinfo", "scontrol"):
        (bin_dir / name).write_text(NO_CONF)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.delenv("SLURM_CONF", raising=False)
    code, out, err = det(*argv)
    assert code == 1 and out == ""
    assert err == (
        f"Error: no Slurm cluster is configured on this machine ({command}: Could not establish a "
        "configuration source); run this on a Slurm login node, or use local mode: det e create "
        "--local CONFIG DIR\n"
    )
