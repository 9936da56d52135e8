"""JSON at ingest through orjson, where it reads and writes what the standard library would.

Ingest parses every event line a trial writes and encodes every metric report it stores (goal:
>= 100k rows/s); the standard library's json was a fifth of that work. orjson (a C library) is
used only where its result is the standard library's: anything else takes ``json``, which stays
the reference (``protocol.decode``) and names what is wrong with a line. orjson is a login-node
dependency: the in-job side never imports this module (a job's image may run another Python).
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from detslurm.protocol import Event, decode, decode_value

# orjson reads an integer beyond 64 bits as a float; the standard library keeps it exact. A line
# with 19 digits in a row (an integer that could be that large, or only a long string of digits)
# is parsed by the standard library. (Found by mapping every digit to 9 and looking for nineteen
# of them: a sixth of the cost of a regular expression's search.)
_DIGITS_AS_NINES = bytes.maketrans(b"0123456789", b"9" * 10)
_LONG_DIGITS = b"9" * 19
# Nesting: orjson reads up to 1023 levels, the standard library until the interpreter's stack
# runs out (from about 800 levels, depending on the caller's depth). A line that could nest that
# deep (more than this many brackets) is parsed by the standard library, as before orjson.
_MAX_BRACKETS = 256
_stdlib_encode = json.JSONEncoder(check_circular=False).encode


def decode_line(data: bytes) -> Event:
    """``protocol.decode(data)``, parsed by orjson where that is the same parse. orjson refuses
    what the standard library reads differently or names better (NaN and Infinity, which a
    Python writer emits; numbers beyond a double; a byte order mark; lone surrogates; any
    malformed line), and those lines take ``decode``."""
    if _LONG_DIGITS in data.translate(_DIGITS_AS_NINES) or data.count(b"[") + data.count(b"{") > _MAX_BRACKETS:
        return decode(data)
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return decode(data)
    return decode_value(obj)


def encode(value: Any) -> str:
    """``json.dumps(value)`` for a JSON-safe value (``store.sanitize.json_safe``: no NaN or
    infinity, which orjson would write as null), without the spaces. Integers beyond 64 bits
    and strings with lone surrogates, which orjson refuses, take the standard library."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        return _stdlib_encode(value)
