"""The trailer rpc_observe appends to a pickled RPC message, and its one general parser.

torch's unpickler stops at the pickle STOP opcode and ignores what follows, so the
context is appended after the pickle:

    <payload: fields, UTF-8, separated by 0x1f> <length of payload: 2 bytes, little endian> <MAGIC>

A peer without rpc_observe (or with it switched off) unpickles the message exactly as
before; a peer with it finds MAGIC at the very end. A request's fields are
`q, src, mode, call id, carrier entries...`; a response's are `r, call id` (the echo that
lets the caller end the call where it unpickles the response), optionally followed by the
callee's own time for the call in microseconds, from unpickling the request to pickling the
response (`r, call id, callee µs`): the caller splits its call's time with it. The pickler's inline fast
path reads the same layout through these names; `split` is the reference parser, and
tests/unit feed both the same bytes.
"""

from __future__ import annotations

from ..telemetry import health
from ..telemetry.propagation import SEP
from . import native

MAGIC = b"\x00rpcobs1"
MAGIC_SIZE = len(MAGIC)
LENGTH_SIZE = 2
OVERHEAD = MAGIC_SIZE + LENGTH_SIZE  # bytes after the payload
MAX_PAYLOAD = 2048  # a peer's trailer is never trusted beyond this many bytes
REQUEST = "q"
RESPONSE = "r"
REQUEST_PREFIX = (REQUEST + SEP).encode()
RESPONSE_PREFIX = (RESPONSE + SEP).encode()
_PREFIX_SIZE = len(REQUEST_PREFIX)
_SEP_BYTES = SEP.encode()
# Field indices of a request (a response has KIND and RESPONSE_CALL_ID).
KIND, SRC, MODE, CALL_ID, CONTEXT = 0, 1, 2, 3, 4
RESPONSE_CALL_ID = 1
RESPONSE_CALLEE_US = 2  # optional
MAX_CALL_ID_DIGITS = 20
MAX_CALLEE_US_DIGITS = 18  # 31,000 years; what a C long long holds in full


def request_head(src: str, mode: str) -> str:
    """The fixed part of a call site's request trailers, up to the call id."""
    return SEP.join((REQUEST, src, mode, ""))


def request_trailer(head: str, call_id: int = 0, context: str = "") -> bytes:
    """The trailer of a request: `head` (who calls, how), the call id (0: no echo wanted), the context."""
    text = head + str(call_id) if call_id else head
    if context:
        text += SEP + context
    payload = text.encode("utf-8", "replace")[:MAX_PAYLOAD]  # `_pack`, inline: one call fewer per request
    return payload + len(payload).to_bytes(LENGTH_SIZE, "little") + MAGIC


def response_trailer(call_id: str, callee_us: int = -1) -> bytes:
    """The trailer of a response: the caller's call id, echoed, and the callee's time in µs (if >= 0)."""
    return _pack(RESPONSE + SEP + call_id + (SEP + str(callee_us) if callee_us >= 0 else ""))


def _pack(text: str) -> bytes:
    payload = text.encode("utf-8", "replace")[:MAX_PAYLOAD]
    return payload + len(payload).to_bytes(LENGTH_SIZE, "little") + MAGIC


def valid_call_id(text: str) -> bool:
    """Empty (no echo wanted) or a decimal number of at most MAX_CALL_ID_DIGITS ASCII digits."""
    return not text or (len(text) <= MAX_CALL_ID_DIGITS and text.isascii() and text.isdigit())


Parsed = tuple[int, int, int] | tuple[int, list[str]]  # see `parse`


def parse(data: bytes) -> Parsed | None:
    """What the pickler's fast paths take from a message: (pickle size, call id, callee µs or -1) of a
    response that echoes a call id, (pickle size, fields) of a request; None for anything else (no
    trailer, a malformed one, a response without a call id), which `split` then reads and counts.

    The reference of `_core.parse`, its C twin (tests/unit/test_trailer.py feeds both the same bytes)."""
    if len(data) < OVERHEAD or data[-MAGIC_SIZE:] != MAGIC:
        return None
    size = data[-OVERHEAD] | data[-OVERHEAD + 1] << 8
    if size > MAX_PAYLOAD or size + OVERHEAD > len(data):
        return None
    payload = data[-OVERHEAD - size:-OVERHEAD]
    prefix = payload[:_PREFIX_SIZE]
    if prefix == RESPONSE_PREFIX:  # `r, call id[, callee µs]`, all ASCII digits
        echo, _, callee_us = payload[_PREFIX_SIZE:].partition(_SEP_BYTES)
        if echo.isdigit() and len(echo) <= MAX_CALL_ID_DIGITS and (
                not callee_us or (callee_us.isdigit() and len(callee_us) <= MAX_CALL_ID_DIGITS)):
            # The callee's time: -1 if not given, or past MAX_CALLEE_US_DIGITS (no real call: a broken peer).
            known = callee_us and len(callee_us) <= MAX_CALLEE_US_DIGITS
            return len(data) - size - OVERHEAD, int(echo), int(callee_us) if known else -1
    elif prefix == REQUEST_PREFIX:
        try:
            fields = bytes(payload).decode("utf-8").split(SEP)
        except UnicodeDecodeError:
            return None
        if len(fields) > CALL_ID and valid_call_id(fields[CALL_ID]):
            return len(data) - size - OVERHEAD, fields
    return None


def split(data: bytes) -> tuple[int, list[str] | None]:
    """Returns (length of the pickle without the trailer, the trailer's fields or None).

    A malformed trailer from a peer is counted and ignored; it never raises.
    """
    if data[-MAGIC_SIZE:] != MAGIC:
        return len(data), None
    try:
        size = int.from_bytes(data[-OVERHEAD:-MAGIC_SIZE], "little")
        if size > MAX_PAYLOAD or size + OVERHEAD > len(data):
            raise ValueError("trailer length out of range")
        fields = bytes(data[-OVERHEAD - size : -OVERHEAD]).decode("utf-8").split(SEP)
        kind = fields[KIND]
        if kind == REQUEST and len(fields) > CALL_ID:
            call_id = fields[CALL_ID]
        elif kind == RESPONSE and len(fields) in (RESPONSE_CALL_ID + 1, RESPONSE_CALLEE_US + 1):
            call_id = fields[RESPONSE_CALL_ID]
            if len(fields) > RESPONSE_CALLEE_US and not valid_call_id(fields[RESPONSE_CALLEE_US]):
                raise ValueError("the callee's time is not a number")
        else:
            raise ValueError("not a request (kind, src, mode, call id, ...) or response (kind, call id[, callee µs]) "
                             "trailer")
        if not valid_call_id(call_id):
            raise ValueError("the call id is not a number")
        return len(data) - size - OVERHEAD, fields
    except Exception:
        health.invalid_context()
        return len(data), None


# The per-call core in C (hooks/_core.c) where built: the wrappers of client, pickler and server use it,
# and the functions above are its trailer codec's reference (None with RPC_OBSERVE_NO_EXTENSIONS=1).
core = native.load("_core")
