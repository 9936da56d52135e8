"""Text that trials wrote reaches a terminal only cleaned of control characters (detslurm/terminal.py);
a pipe gets it unchanged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import ROOT

# An OSC that retitles the terminal, a CSI (as ESC [ and as the C1 control 0x9b) and a bare BEL, a DEL and a
# carriage return that would hide what came before it.
HOSTILE = "\x1b]0;PWNED\x07 \x1b[2J \u009b31m red \x7f hidden\rshown\ttab"
TRIAL = f"""
import determined as det
with det.core.init() as ctx:
    print({HOSTILE!r}, flush=True)
"""


def _in_pty(*args: str) -> bytes:
    """What `det ARGS` shows on a terminal (the pty adds its own \\r before each \\n)."""
    return _in_pty_argv([sys.executable, "-m", "detslurm.cli.main", *args])


def _in_pty_argv(argv: list[str]) -> bytes:
    controller, terminal = os.openpty()
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=terminal,
            stderr=terminal,
            cwd=ROOT,
        )
    finally:
        os.close(terminal)
    out = bytearray()
    try:
        while chunk := os.read(controller, 65536):
            out += chunk
    except OSError:  # EIO: every writer of the terminal has exited
        pass
    finally:
        os.close(controller)
    assert proc.wait(timeout=60) == 0, bytes(out)
    return bytes(out)


def test_trial_output_reaches_a_terminal_without_control_characters(det: Any, det_env: Path) -> None:
    ctx = det_env / "ctx"
    ctx.mkdir()
    (ctx / "train.py").write_text(TRIAL)
    (ctx / "exp.yaml").write_text("name: esc\nentrypoint: python3 train.py\nsearcher: {name: single, metric: x}\n")
    code, out, err = det("e", "create", "--local", ctx / "exp.yaml", ctx)
    assert code == 0, out + err
    shown = _in_pty("t", "logs", "1")
    assert b"PWNED" in shown and b"red" in shown and b"tab" in shown
    for control in (b"\x1b", b"\x07", b"\xc2\x9b", b"\x7f", b"hidden\rshown"):
        assert control not in shown, (control, shown)
    assert b"shown\ttab" in shown  # tab and newline stay
    # A pipe (a script parsing the output) gets the bytes as the logs command gives them.
    code, out, _ = det("t", "logs", "1")
    assert code == 0 and "\x1b]0;PWNED\x07" in out and "\u009b31m" in out


FORWARDED = """
import click
from detslurm.cli.remote.channel import drain
from detslurm.cli.remote.connect import _kbd_handler, tty_prompt
from detslurm.terminal import guarded

class Chan:  # what a remote command wrote, as paramiko's channel hands it over
    out, err = [b"out \\x1b]0;PWNED\\x07 \\xc3"], [b"err \\x1b[6n"]
    def recv_ready(self): return bool(self.out)
    def recv(self, n): return self.out.pop()
    def recv_stderr_ready(self): return bool(self.err)
    def recv_stderr(self, n): return self.err.pop()

with guarded():
    drain(Chan())
    click.echo(b"\\xa9 end")  # the rest of a character split between two reads
    # A keyboard-interactive login: the title, instructions and prompt are the server's text.
    ask = _kbd_handler(tty_prompt)
    assert ask("2FA \\x1b]0;TITLE\\x07", "note \\x1b[1A", [("code \\x9b2J: ", True)]) == [""]
"""


def test_forwarded_remote_bytes_and_login_prompts_are_cleaned_on_a_terminal(tmp_path: Path) -> None:
    script = tmp_path / "forward.py"
    script.write_text(FORWARDED)
    shown = _in_pty_argv([sys.executable, str(script)])
    assert b"PWNED" in shown and b"err" in shown and "\u00e9 end".encode() in shown
    assert b"TITLE" in shown and b"note" in shown and b"code" in shown
    assert b"\x1b" not in shown and b"\x07" not in shown and b"\xc2\x9b" not in shown
