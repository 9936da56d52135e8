"""Ingest's orjson path reads and writes what the standard library's json would
(controller/fastjson.py): every line decodes to the same event, or is refused for the same reason,
and every stored report encodes to the same JSON value."""

from __future__ import annotations

import json
import math
import random
from typing import Any

import google_crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detslurm.controller import fastjson
from detslurm.protocol import BadEvent, Metrics, decode, encode, events


def outcome(decoder: Any, data: bytes) -> tuple[str, Any]:
    try:
        ev = decoder(data)
    except BadEvent as e:
        return ("refused", e.reason)
    # repr: bit for bit (NaN == NaN, -0.0 apart from 0.0, an int apart from its float).
    return ("event", repr(ev))


def line(metrics: str, steps: str = "5", time: str = "1764265432.123456", extra: str = "") -> bytes:
    return (
        f'{{"type": "metrics", "v": 1, "group": "training", "steps_completed": {steps}, '
        f'"metrics": {metrics}, "time": {time}{extra}}}'
    ).encode()


EDGES = [
    line('{"loss": 0.25, "acc": 1}'),
    line('{"loss": NaN, "x": Infinity, "y": -Infinity}'),  # what a Python writer emits
    line('{"big": 1e400, "tiny": 2.5e-324, "neg": -0.0, "e": 1.0000000000000002}'),
    line('{"n": 123456789012345678901234567890}'),  # beyond 64 bits: orjson would read a float
    line('{"n": 18446744073709551615, "m": -9223372036854775808, "k": 9223372036854775807}'),
    line('{"s": "1234567890123456789012"}'),  # a long digit string that is no number
    line('{"loss": 0.5}', steps="99999999999999999999"),
    line('{"loss": 0.5}', steps="-1"),
    line('{"loss": 0.5}', steps="5.0"),
    line('{"a": 1, "a": 2}'),  # duplicate keys: the last one wins in both
    line('{"s": "\\ud800"}'),  # a lone surrogate, escaped
    line('{"s": "caf\\u00e9 \\u2028"}'),
    line('{"nested": {"a": [1, 2, {"b": null}]}}'),
    line('{"loss": 0.5}', extra=', "batch_metrics": [{"loss": 1.0}]'),
    line('{"loss": 0.5}', time="-3"),
    b'{"type": "metrics", "v": 1, "group": "training", "steps_completed": 5, "metrics": {"s": "\xed\xa0\x80"}, "time": 1.0}',
    b'{"type": "metrics", "v": 1, "group": "training", "steps_completed": 5, "metrics": {"s": "\xff"}, "time": 1.0}',
    b'{"type": "metrics", "v": 1, "group": "training", "steps_completed": 5, "metrics": {"s": "\x01"}, "time": 1.0}',
    b"\xef\xbb\xbf" + line('{"loss": 0.5}'),  # a byte order mark
    line('{"loss": 0.5}').decode().encode("utf-16"),
    b"[" * 5000 + b"]" * 5000,
    # Inside the window where orjson (up to 1023 levels) and the standard library (from about 800,
    # by the stack) disagree, and at the reader's bound for a line.
    line('{"x": ' + "[" * 1000 + "]" * 1000 + "}"),
    line('{"loss": 0.5}', extra=', "x": ' + "[" * 300_000 + "]" * 300_000),
    line('{"loss": 0.5}', extra=', "x": ' + '{"a": ' * 300 + "1" + "}" * 300),
    b'["not", "an", "object"]',
    b'{"type": "metrics", "v": 2}',
    b'{"type": "no-such-type", "v": 1}',
    b'{"type": "progress", "v": 1, "progress": 0.5, "time": 3.5}',
    b'{"type": "metrics"',
    b"",
    b"   ",
    b"NaN",
    b'{"type": "metrics", "v": 1, "group": "", "steps_completed": 5, "metrics": {}, "time": 1.0}',
]


def test_every_edge_decodes_as_the_standard_library_decodes_it() -> None:
    for data in EDGES:
        assert outcome(fastjson.decode_line, data) == outcome(decode, data), data[:80]


def test_an_ordinary_report_takes_orjson_and_a_64_bit_overflow_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    fallbacks: list[bytes] = []

    def standard_library(data: bytes) -> Any:
        fallbacks.append(data)
        return decode(data)

    monkeypatch.setattr(fastjson, "decode", standard_library)  # this module's name only
    ev = fastjson.decode_line(line('{"loss": 0.25, "acc": 1}'))
    assert isinstance(ev, Metrics) and ev.metrics == {"loss": 0.25, "acc": 1}
    assert fallbacks == [], "an ordinary report is parsed by orjson"
    ev = fastjson.decode_line(line('{"n": 123456789012345678901234567890}'))
    assert isinstance(ev, Metrics) and ev.metrics["n"] == 123456789012345678901234567890
    assert type(ev.metrics["n"]) is int
    assert len(fallbacks) == 1, "an integer beyond 64 bits is parsed by the standard library"


def test_lone_surrogates_are_refused_by_both_parsers_and_pairs_are_text() -> None:
    cesu = line('{"X": 1.0}').replace(b"X", b"\xed\xa0\x80")  # a surrogate as UTF-8-like bytes
    for bad in (line('{"\\ud800": 1.0}'), line('{"a\\uDC00b": 1.0}'), cesu):
        assert outcome(fastjson.decode_line, bad) == outcome(decode, bad)
        assert outcome(decode, bad)[0] == "refused" and "lone surrogate" in outcome(decode, bad)[1]
    ev = fastjson.decode_line(line('{"\\ud83d\\ude00": 1.0}'))  # an emoji as two escapes
    assert isinstance(ev, Metrics) and list(ev.metrics) == ["\U0001f600"]


def json_values(finite: bool) -> st.SearchStrategy[Any]:
    """JSON values with integers beyond 64 bits; with NaN and infinities unless ``finite``."""
    scalars = (
        st.none()
        | st.booleans()
        | st.integers(min_value=-(2**80), max_value=2**80)
        | st.floats(allow_nan=not finite, allow_infinity=not finite)
        | st.text(max_size=12)
    )
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=12,
    )


@settings(max_examples=400, deadline=None)
@given(
    metrics=st.dictionaries(st.text(max_size=10), json_values(finite=False), max_size=6), steps=st.integers(-5, 2**66)
)
def test_any_report_a_writer_emits_decodes_the_same(metrics: dict[str, Any], steps: int) -> None:
    text = json.dumps(metrics, allow_nan=True)
    data = line(text, steps=str(steps))
    assert outcome(fastjson.decode_line, data) == outcome(decode, data)
    if steps >= 0:
        written = encode(Metrics(group="validation", steps_completed=steps, metrics=metrics, time=12.5)).encode()
        assert outcome(fastjson.decode_line, written) == outcome(decode, written)


@settings(max_examples=400, deadline=None)
@given(value=json_values(finite=True))
def test_a_stored_report_encodes_to_the_same_json_value(value: Any) -> None:
    text = fastjson.encode(value)
    assert json.loads(text) == json.loads(json.dumps(value))
    assert repr(json.loads(text)) == repr(value)  # floats bit for bit, big ints exact


def test_hostile_bytes_decode_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    # A line whose time was mutated away gets "now": the same now for both decoders.
    monkeypatch.setattr(events, "_now", lambda: 1.5)
    base = line('{"loss": 0.5, "n": 12, "s": "x"}', extra=', "batch_metrics": [{"a": [1, 2.5e-3]}]')
    rng = random.Random(7)
    for _ in range(20_000):
        data = bytearray(base)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        assert outcome(fastjson.decode_line, bytes(data)) == outcome(decode, bytes(data)), bytes(data)


def test_the_crc_is_google_crc32c_s_c_code() -> None:
    # Its pure-Python fallback (taken with only a warning when the extension cannot load) costs
    # 10 us a record instead of 0.2: the daemon's ingest would be three times slower than before.
    assert google_crc32c.implementation == "c"


def test_encode_keeps_what_orjson_refuses() -> None:
    assert fastjson.encode({"n": 2**70}) == '{"n": 1180591620717411303424}'
    assert json.loads(fastjson.encode({"s": "\ud800"})) == {"s": "\ud800"}
    assert json.loads(fastjson.encode({"x": 1e16, "y": 1e-05})) == {"x": 1e16, "y": 1e-05}
    assert not math.isnan(json.loads(fastjson.encode({"x": 0.1}))["x"])
