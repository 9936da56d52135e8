"""The one place where what `det` prints meets a terminal.

Much of what `det` shows was written by trials and jobs (names, logs, notes) or by a remote
host (forwarded output, keyboard-interactive prompts): untrusted text. Printed raw, an escape
sequence in it can retitle the terminal, rewrite what is on screen or, on some terminals, answer
back as typed input. So while `det` runs, a stdout or stderr that is a terminal is replaced by a
stream that passes every write, text or bytes, through :func:`detslurm.util.printable` (C0 and
C1 controls become spaces; newline and tab stay). Pipes and files get the bytes unchanged:
scripts that parse the output see exactly what was written.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from detslurm.util import printable


class _Cleaning(io.RawIOBase):
    """A binary sink that decodes what it is given, cleans it and writes it on to ``out``."""

    def __init__(self, out: Any, encoding: str) -> None:
        super().__init__()
        self._out = out
        self._encoding = encoding
        # Incremental: a multi-byte character split between two writes is decoded whole.
        self._decoder = codecs.getincrementaldecoder(encoding)(errors="replace")

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = bytes(b)
        text = self._decoder.decode(data)
        if text:
            self._out.write(printable(text).encode(self._encoding, errors="replace"))
            self._out.flush()
        return len(data)

    def isatty(self) -> bool:
        return True

    def fileno(self) -> int:
        return int(self._out.fileno())

    def close(self) -> None:
        # The terminal's own stream stays open: it belongs to the process, not to this wrapper.
        with contextlib.suppress(ValueError, OSError):
            self._out.flush()
        super().close()


def _cleaning(stream: TextIO) -> TextIO:
    encoding = stream.encoding or "utf-8"
    raw = _Cleaning(stream.buffer, encoding)
    return io.TextIOWrapper(
        io.BufferedWriter(raw), encoding=encoding, errors=stream.errors or "strict", line_buffering=True
    )


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty()) and hasattr(stream, "buffer")
    except (AttributeError, ValueError, OSError):
        return False


@contextlib.contextmanager
def guarded() -> Iterator[None]:
    """While the block runs, stdout and stderr that are terminals print only cleaned text."""
    saved = sys.stdout, sys.stderr
    if _is_terminal(sys.stdout):
        sys.stdout.flush()
        sys.stdout = _cleaning(sys.stdout)
    if _is_terminal(sys.stderr):
        sys.stderr.flush()
        sys.stderr = _cleaning(sys.stderr)
    try:
        yield
    finally:
        for current, original in zip((sys.stdout, sys.stderr), saved, strict=True):
            if current is not original:
                with contextlib.suppress(ValueError, OSError):
                    current.flush()
        sys.stdout, sys.stderr = saved
