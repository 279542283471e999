"""The context rpc_observe carries inside a pickled RPC message.

torch's unpickler stops at the pickle STOP opcode and ignores what follows, so the
context is appended after the pickle as a trailer:

    <fields, UTF-8, separated by 0x1f> <length: 2 bytes, little endian> b"\\x00rpcobs1"

A peer without rpc_observe (or with it switched off) unpickles the message exactly as
before; a peer with it finds the magic at the very end. Requests carry the caller's
worker name, the exec mode, the caller's call id and the trace context (the propagator's
carrier); a response echoes the call id, so that the caller ends the call right where
it unpickles the response, on the thread that already holds the GIL.
"""

from __future__ import annotations

import re
from typing import Mapping

from . import _health

MAGIC = b"\x00rpcobs1"
_MAX_PAYLOAD = 2048  # a peer's trailer is never trusted beyond this many bytes
_SEP = "\x1f"
_REQUEST = "q"
_RESPONSE = "r"
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


def request_head(src: str, mode: str) -> str:
    """The fixed part of a call site's request trailers."""
    return _SEP.join((_REQUEST, src, mode, ""))


def carrier_text(carrier: Mapping[str, str]) -> str:
    """A propagator carrier as trailer fields."""
    return _SEP.join(f"{k}={v}" for k, v in carrier.items())


def request_trailer(head: str, call_id: int = 0, context: str = "") -> bytes:
    """The trailer of a request: `head` (who calls, how), the call id (0: no echo wanted), the context."""
    text = head + str(call_id) if call_id else head
    if context:
        text += _SEP + context
    payload = text.encode("utf-8", "replace")[:_MAX_PAYLOAD]
    return payload + len(payload).to_bytes(2, "little") + MAGIC


def response_trailer(call_id: str) -> bytes:
    """The trailer of a response: the caller's call id, echoed."""
    payload = (_RESPONSE + _SEP + call_id).encode("utf-8", "replace")[:_MAX_PAYLOAD]
    return payload + len(payload).to_bytes(2, "little") + MAGIC


def split(data: bytes) -> tuple[int, list[str] | None]:
    """Returns (length of the pickle without the trailer, the trailer's fields or None).

    A malformed trailer from a peer is counted and ignored; it never raises.
    """
    if data[-8:] != MAGIC:
        return len(data), None
    try:
        size = int.from_bytes(data[-10:-8], "little")
        if size > _MAX_PAYLOAD or size + 10 > len(data):
            raise ValueError("trailer length out of range")
        fields = bytes(data[-10 - size : -10]).decode("utf-8").split(_SEP)
        kind = fields[0]
        if not ((kind == _REQUEST and len(fields) >= 4) or (kind == _RESPONSE and len(fields) == 2)):
            raise ValueError("not a request (kind, src, mode, call id, ...) or response (kind, call id) trailer")
        call_id = fields[3] if kind == _REQUEST else fields[1]
        if call_id and not (len(call_id) <= 20 and call_id.isdigit()):
            raise ValueError("the call id is not a number")
        return len(data) - size - 10, fields
    except Exception:
        _health.invalid_context()
        return len(data), None


def carrier_of(fields: list[str]) -> dict[str, str]:
    """The propagator carrier of a request trailer's fields (from the fifth on)."""
    carrier = {}
    for item in fields[4:17]:
        key, sep, value = item.partition("=")
        if sep:
            carrier[key] = value
    return carrier


def format_traceparent(trace_id: int, span_id: int, sampled: bool) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"


def parse_traceparent(value: str) -> tuple[int, int, bool] | None:
    """(trace_id, span_id, sampled) of a W3C traceparent, or None if it is not valid."""
    match = _TRACEPARENT.fullmatch(value)
    if match is None or value[:2] == "ff":
        return None
    trace_id, span_id = int(match[1], 16), int(match[2], 16)
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, bool(int(match[3], 16) & 1)
