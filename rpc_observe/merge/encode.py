"""The RPC events of the merged trace, JSON-encoded as they are made: each
span's slice, and, for a span of an RPC pair, its send/receive markers and
its ends of the pair's two flow arrows.

Everything is made in one pass over each lane group, span by span, so that a
span is read once and in the order it lies in memory: the pair's other span is
not looked up, only the pair's number (``Span.pair``), which gives both flow ids.
What a call site's slices share (name, process, attributes) is encoded once.
Times are integer ns until written, and printed by table as microseconds
exactly as ``json.dumps(ns / 1000)`` would print them: the float formatting
would otherwise be most of the merge's time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from . import speedups
from .model import KIND_CLIENT, Span, Timebase
from .rpc import FLOW_CAT, MARKER_US, SPAN_CAT, SpanIndex, assign_lanes, lane_meta, lanes

_CHUNK = 4096  # items a chunk
_MARKER_NS = round(MARKER_US * 1000)
_LONG_NS = 8 * _MARKER_NS  # a slice this long has full 1 us markers
# ns % 1000 -> the decimals of the us value as repr() prints them: 0 -> ".0", 780 -> ".78".
_FRAC = tuple("." + (f"{r:03d}".rstrip("0") or "0") for r in range(1000))
# For x = q * 1000 + r:  x + 1500 -> (q + 1 + _UP[r], _FRAC_UP[r]);  x - 1500 -> (q - 2 + _UP[r], _FRAC_UP[r]).
_UP = tuple((r + 500) // 1000 for r in range(1000))
_FRAC_UP = tuple(_FRAC[(r + 500) % 1000] for r in range(1000))

# A lane is filled in as its '"pid":P,"tid":T' text.
# A marker carries no args: its enclosing span slice has them (it is a third of the output's events).
_MARK = '{"ph":"X","cat":"%s","name":"%%s",%%s,"ts":%%s%%s,"dur":%%s%%s}' % SPAN_CAT
_FLOW_START = '{"ph":"s","cat":"%s","name":"%%s","id":%%d,%%s,"ts":%%s%%s}' % FLOW_CAT
_FLOW_END = '{"ph":"f","bp":"e","cat":"%s","name":"%%s","id":%%d,%%s,"ts":%%s%%s}' % FLOW_CAT
_REQUEST, _REPLY = "rpc request", "rpc reply"
# What each side of a pair draws: (first marker, last marker), and the flow ends
# bound to them: the request flow's (id) at the first, the reply flow's (id + 1) at the last.
_CLIENT_ENDS = (("rpc send", "rpc reply received"), (_FLOW_START, _REQUEST), (_FLOW_END, _REPLY))
_SERVER_ENDS = (("rpc receive", "rpc reply sent"), (_FLOW_END, _REQUEST), (_FLOW_START, _REPLY))


def _named(template: str, name: str) -> str:
    return template.replace('"name":"%s"', f'"name":"{name}"')


def _long_ends(ends: tuple) -> str:
    """The four events of one side of a pair whose slice is long enough for
    1 us markers, as one template of (lane, first marker's us, lane, last
    marker's us, id, lane, first flow end's us, id + 1, lane, last flow end's us)."""
    (first, last), (first_flow, first_name), (last_flow, last_name) = ends
    return ",".join([_named(_MARK, first).replace('"dur":%s%s', '"dur":1.0'),
                     _named(_MARK, last).replace('"dur":%s%s', '"dur":1.0'),
                     _named(first_flow, first_name), _named(last_flow, last_name)])


_LONG_ENDS = {KIND_CLIENT: _long_ends(_CLIENT_ENDS)}  # anything else drawn is a server span
_SERVER_LONG_ENDS = _long_ends(_SERVER_ENDS)


def _us(ns: int) -> tuple[int | str, str]:
    """``ns`` as the two %s%s parts of its microseconds."""
    if ns >= 0:
        q, r = divmod(ns, 1000)
        return q, _FRAC[r]
    return "", repr(ns / 1000)


def rpc_events(index: SpanIndex, workers: list[str], main_pid: dict[str, int], timebase: Timebase,
               first_flow_id: int) -> Iterator[tuple[str, int]]:
    """Lay each worker's client and server spans out on lanes and encode
    their slices, their markers and flow ends, and the lanes' metadata:
    (comma-joined encoded events, how many) chunks.  Pair k's flows have the
    ids ``first_flow_id + 2k`` (request) and ``+ 1`` (reply)."""
    zero = {w: timebase.pivot_ns - round((timebase.offsets_us.get(w, 0.0) - timebase.origin_us) * 1000)
            for w in main_pid}  # a worker's local ns of the merged timeline's 0
    for w, kind, label, base_tid in lanes(workers):
        group = index.groups.get((w, kind), [])
        n_lanes = assign_lanes(group, base_tid)
        meta = lane_meta(main_pid[w], label, base_tid, n_lanes)
        if meta:
            yield json.dumps(meta, separators=(",", ":"))[1:-1], len(meta)
        texts = ['"pid":%d,"tid":%d' % (main_pid[w], base_tid + k) for k in range(n_lanes)]
        slices = _slices if speedups.C is None else _fast_slices
        yield from slices(group, zero[w], main_pid[w], texts, base_tid, first_flow_id)


_SLICE = '%s%s,"ts":%s%s,"dur":%s%s,"args":{"trace_id":"%s","span_id":"%s","kind":"%s"%s'
_SLICE_CHILD = '%s%s,"ts":%s%s,"dur":%s%s,"args":{"trace_id":"%s","span_id":"%s","kind":"%s","parent_span_id":"%s"%s'


def _fast_slices(group: list[Span], zero_ns: int, pid: int, texts: list[str], base_tid: int,
                 first_flow_id: int) -> Iterator[tuple[str, int]]:
    """:func:`_slices` by the C loop, which leaves a span it does not encode
    (an error, a time before the timeline's zero) to :func:`_slices`."""
    parts: dict[int, tuple[str, str, str]] = {}
    i, n_group, encode = 0, len(group), speedups.C.encode_spans  # type: ignore[union-attr]
    while i < n_group:
        text, n, i, left = encode(group, i, _CHUNK, zero_ns, texts, base_tid, first_flow_id, parts, _slice_parts)
        if n:
            yield text, n
        if left:
            yield from _slices(group[i:i + 1], zero_ns, pid, texts, base_tid, first_flow_id, parts)
            i += 1


def _slices(group: list[Span], zero_ns: int, pid: int, texts: list[str], base_tid: int,
            first_flow_id: int, parts: dict[int, tuple[str, str, str]] | None = None) -> Iterator[tuple[str, int]]:
    """The events of one lane group: each span's slice, then its pair's markers and flow ends.
    ``parts``: each call site's, by id(attrs) (spans sharing attrs share their site)."""
    buf: list[str] = []
    append, frac, up, frac_up, long_ends = buf.append, _FRAC, _UP, _FRAC_UP, _LONG_ENDS
    n = 0
    parts = {} if parts is None else parts
    for s in group:
        ts, dur = s.start_ns - zero_ns, s.end_ns - s.start_ns
        lane = texts[s.tid - base_tid]
        if s.status_code == 2:
            append(json.dumps(_error_slice(s, pid, ts / 1000, dur / 1000), separators=(",", ":")))
        else:
            site = parts.get(id(s.attrs))
            if site is None:
                site = parts[id(s.attrs)] = _slice_parts(s)
            head, kind, tail = site
            t_q, t_r = (ts // 1000, frac[ts % 1000]) if ts >= 0 else _us(ts)
            if s.parent_id:
                append(_SLICE_CHILD % (head, lane, t_q, t_r, dur // 1000, frac[dur % 1000], s.trace_id, s.span_id,
                                       kind, s.parent_id, tail))
            else:
                append(_SLICE % (head, lane, t_q, t_r, dur // 1000, frac[dur % 1000], s.trace_id, s.span_id,
                                 kind, tail))
        n += 1
        if s.pair >= 0:
            fid = first_flow_id + 2 * s.pair
            if ts >= 0 and dur >= _LONG_NS:  # the usual case, in one go
                q0, r0 = divmod(ts, 1000)
                qe, re_ = divmod(ts + dur, 1000)
                append(long_ends.get(s.kind, _SERVER_LONG_ENDS) % (
                    lane, q0 + 1, frac[r0], lane, qe - 2, frac[re_],
                    fid, lane, q0 + 1 + up[r0], frac_up[r0], fid + 1, lane, qe - 2 + up[re_], frac_up[re_]))
                n += 4
            else:
                n += _short_ends(s.kind, fid, lane, ts, dur, append)
        if len(buf) >= _CHUNK:
            yield ",".join(buf), n
            buf.clear()
            n = 0
    if buf:
        yield ",".join(buf), n


def _short_ends(kind: int, fid: int, lane: str, ts: int, dur: int, append: Any) -> int:
    """Add one side's markers, short ones just inside both ends of its slice
    (Perfetto draws an arrow from the end of its source slice to the start of
    its target, so binding to markers makes arrows point the right way), and
    its flow ends; a slice too short for markers binds both flows itself.
    Returns how many events were added."""
    (first, last), (first_flow, first_name), (last_flow, last_name) = (
        _CLIENT_ENDS if kind == KIND_CLIENT else _SERVER_ENDS)
    if dur < _MARKER_NS:
        a = b = _us(ts + dur // 2)
        added = 2
    else:
        m = min(_MARKER_NS, dur // 8)
        a0, b0 = ts + m, ts + dur - 2 * m
        append(_MARK % (first, lane, *_us(a0), *_us(m)))
        append(_MARK % (last, lane, *_us(b0), *_us(m)))
        a, b = _us(a0 + m // 2), _us(b0 + m // 2)
        added = 4
    append(_named(first_flow, first_name) % (fid, lane, *a))
    append(_named(last_flow, last_name) % (fid + 1, lane, *b))
    return added


# Attributes every span of the run has alike, left out of the slices' args (a slice's name
# is its profiling key, unless the spans are named by method: then the key stays).
_SAME_ON_EVERY_SPAN = ("rpc.system", "rpc.system.name")


def _common_args(s: Span) -> dict[str, Any]:
    """A slice's args past its ids: a set status, and the span's attributes under their own names.
    Each worker's clock offset is in the summary (``rpc_observe_merge.offsets_us``), not on every slice."""
    args: dict[str, Any] = {}
    if s.status_code:  # UNSET (0), the status of every successful call, is left out
        args["status"] = {1: "OK", 2: "ERROR"}.get(s.status_code, str(s.status_code))
    for key, value in s.attrs.items():
        if key not in _SAME_ON_EVERY_SPAN and not (key == "torch.rpc.profiling_key" and value == s.name):
            args.setdefault(key, value)
    return args


def _slice_parts(s: Span) -> tuple[str, str, str]:
    """What a call site's slices share, encoded: the event's head (up to its
    lane), its kind, and the rest of its args with the closing braces."""
    head = '{"ph":"X","cat":"%s","name":%s,' % (SPAN_CAT, json.dumps(s.name))
    args = _common_args(s)
    rest = "," + json.dumps(args, separators=(",", ":"))[1:-1] if args else ""  # inside the braces
    return head, "client" if s.kind == KIND_CLIENT else "server", rest + "}}"


def _error_slice(s: Span, pid: int, ts: float, dur: float) -> dict[str, Any]:
    kind = "client" if s.kind == KIND_CLIENT else "server"
    args: dict[str, Any] = {"trace_id": s.trace_id, "span_id": s.span_id, "kind": kind}
    if s.parent_id:
        args["parent_span_id"] = s.parent_id
    args.update(_common_args(s))
    exc = [e for e in s.events if e.get("name") == "exception"]
    args["error"] = s.status_message or (exc[0].get("exception.message", "") if exc else "") or "error"
    if exc:
        args["exception"] = exc[0]
    return {"ph": "X", "cat": SPAN_CAT, "name": s.name, "pid": pid, "tid": s.tid, "ts": ts, "dur": dur,
            "args": args, "cname": "terrible"}  # Perfetto/Chrome's red


if speedups.C is not None:
    try:
        speedups.C.configure_events(
            _FRAC, KIND_CLIENT, _MARKER_NS, _LONG_NS, _SLICE, _SLICE_CHILD, _MARK, _LONG_ENDS[KIND_CLIENT],
            _SERVER_LONG_ENDS,
            tuple(_named(template, name) for ends in (_CLIENT_ENDS, _SERVER_ENDS) for template, name in ends[1:]),
            _CLIENT_ENDS[0] + _SERVER_ENDS[0])
    except (TypeError, ValueError):  # built from another version of these templates: pure Python
        speedups.C = None
