"""The trace context as text: the propagator carrier and the W3C traceparent.

The hooks carry this text inside each request (see `rpc_observe.hooks.trailer`); this
module only knows how a carrier becomes fields of text and back.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

SEP = "\x1f"  # between carrier entries, as between the trailer's other fields
MAX_CARRIER_ENTRIES = 13  # a peer's carrier is never trusted beyond this many entries
# version (not ff), trace id, parent id, flags (the last digit holds the sampled bit)
_TRACEPARENT = r"(?!ff)[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]([0-9a-f])"
_parse = re.compile(_TRACEPARENT).fullmatch
# The carrier entry `traceparent=...` whole, for the tracer's inline parse (tested against parse_traceparent).
TRACEPARENT_ENTRY = re.compile("traceparent=" + _TRACEPARENT).fullmatch
SAMPLED_LAST_DIGITS = frozenset("13579bdf")
_FORMAT = "00-%032x-%016x-%s"
# "traceparent=" + format_traceparent(...), as one %-format: the client's hot path.
TRACEPARENT_ENTRY_FORMAT = "traceparent=" + _FORMAT
FLAGS = ("00", "01")  # by sampled


def carrier_text(carrier: Mapping[str, str]) -> str:
    """A propagator carrier as `key=value` fields."""
    return SEP.join(f"{k}={v}" for k, v in carrier.items())


def carrier_of(entries: list[str]) -> dict[str, str]:
    """The propagator carrier of `key=value` fields (the context fields of a request trailer)."""
    carrier = {}
    for item in entries[:MAX_CARRIER_ENTRIES]:
        key, sep, value = item.partition("=")
        if sep:
            carrier[key] = value
    return carrier


def format_traceparent(trace_id: int, span_id: int, sampled: bool) -> str:
    """A W3C traceparent, built by hand (~0.3 us against 2-3 us for `propagate.inject`)."""
    return _FORMAT % (trace_id, span_id, FLAGS[sampled])


def parse_traceparent(value: str) -> tuple[int, int, bool] | None:
    """(trace_id, span_id, sampled) of a W3C traceparent, or None if it is not valid."""
    match = _parse(value)
    if match is None:
        return None
    trace_id, span_id = int(match[1], 16), int(match[2], 16)
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, match[3] in SAMPLED_LAST_DIGITS
