"""The RPC events of the merged trace, JSON-encoded as they are made: each
span's slice, and each pair's send/receive markers and flow arrows.

What a call site's slices share (name, process, attributes) is encoded once.
Times are integer ns until written, and printed by table as microseconds
exactly as ``json.dumps(ns / 1000)`` would print them: the float formatting
would otherwise be most of the merge's time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from .model import KIND_CLIENT, Span, Timebase
from .rpc import FLOW_CAT, MARKER_US, SPAN_CAT, SpanIndex, assign_lanes, lane_meta, lanes

_CHUNK = 4096  # items a chunk
_MARKER_NS = round(MARKER_US * 1000)
# ns % 1000 -> the decimals of the us value as repr() prints them: 0 -> ".0", 780 -> ".78".
_FRAC = tuple("." + (f"{r:03d}".rstrip("0") or "0") for r in range(1000))
# For x = q * 1000 + r:  x + 1500 -> (q + 1 + _UP[r], _FRAC_UP[r]);  x - 1500 -> (q - 2 + _UP[r], _FRAC_UP[r]).
_UP = tuple((r + 500) // 1000 for r in range(1000))
_FRAC_UP = tuple(_FRAC[(r + 500) % 1000] for r in range(1000))

# A lane is filled in as its '"pid":P,"tid":T' text (Span.lane).
# A marker carries no args: its enclosing span slice has them (it is a third of the output's events).
_MARK = '{"ph":"X","cat":"%s","name":"%%s",%%s,"ts":%%s%%s,"dur":%%s%%s}' % SPAN_CAT
_FLOW = ('{"ph":"s","cat":"%s","name":"%%s","id":%%d,%%s,"ts":%%s%%s},'
         '{"ph":"f","bp":"e","cat":"%s","name":"%%s","id":%%d,%%s,"ts":%%s%%s}') % (FLOW_CAT, FLOW_CAT)


def _named(template: str, name: str) -> str:
    return template.replace('"name":"%s"', f'"name":"{name}"')


# A pair whose slices are long enough for 1 us markers: four markers and two flows (eight events).
_PAIR = ",".join([_named(_MARK, n).replace('"dur":%s%s', '"dur":1.0')
                  for n in ("rpc send", "rpc reply received", "rpc receive", "rpc reply sent")]
                 + [_named(_FLOW, n) for n in ("rpc request", "rpc reply")])


def _us(ns: int) -> tuple[int | str, str]:
    """``ns`` as the two %s%s parts of its microseconds."""
    if ns >= 0:
        q, r = divmod(ns, 1000)
        return q, _FRAC[r]
    return "", repr(ns / 1000)


def rpc_events(index: SpanIndex, workers: list[str], main_pid: dict[str, int], timebase: Timebase,
               first_flow_id: int) -> Iterator[tuple[str, int]]:
    """Lay each worker's client and server spans out on lanes and encode
    their slices and the lanes' metadata, then the markers and flows of the
    pairs: (comma-joined encoded events, how many) chunks."""
    zero = {w: timebase.pivot_ns - round((timebase.offsets_us.get(w, 0.0) - timebase.origin_us) * 1000)
            for w in main_pid}  # a worker's local ns of the merged timeline's 0
    for w, kind, label, base_tid in lanes(workers):
        group = index.groups.get((w, kind), [])
        n_lanes = assign_lanes(group, base_tid)
        meta = lane_meta(main_pid[w], label, base_tid, n_lanes)
        if meta:
            yield json.dumps(meta, separators=(",", ":"))[1:-1], len(meta)
        texts = ['"pid":%d,"tid":%d' % (main_pid[w], base_tid + k) for k in range(n_lanes)]
        yield from _slices(group, zero[w], main_pid[w], texts, base_tid)
    yield from _pairs(index.pairs, first_flow_id)


_SLICE = '%s%s,"ts":%s%s,"dur":%s%s,"args":{"trace_id":"%s","span_id":"%s","kind":"%s"%s'
_SLICE_CHILD = '%s%s,"ts":%s%s,"dur":%s%s,"args":{"trace_id":"%s","span_id":"%s","kind":"%s","parent_span_id":"%s"%s'


def _slices(group: list[Span], zero_ns: int, pid: int, texts: list[str], base_tid: int) -> Iterator[tuple[str, int]]:
    """The slices of one lane group; sets each span's ``ts`` and ``lane``."""
    buf: list[str] = []
    append, frac = buf.append, _FRAC
    parts: dict[int, tuple[str, str, str]] = {}  # a call site's: spans sharing attrs share their site
    for s in group:
        ts, dur = s.start_ns - zero_ns, s.end_ns - s.start_ns
        s.ts = ts
        lane = s.lane = texts[s.tid - base_tid]
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
        if len(buf) >= _CHUNK:
            yield ",".join(buf), len(buf)
            buf.clear()
    if buf:
        yield ",".join(buf), len(buf)


def _pairs(pairs: list[tuple[Span, Span]], first_flow_id: int) -> Iterator[tuple[str, int]]:
    """The markers and flows of the pairs (their spans' ``ts`` and ``lane`` set)."""
    buf: list[str] = []
    n = 0
    frac, up, frac_up, pair, long = _FRAC, _UP, _FRAC_UP, _PAIR, 8 * _MARKER_NS
    fid = first_flow_id - 2  # each pair's request flow, then its reply flow
    for c, s in pairs:
        fid += 2
        c0, s0, cl, sl = c.ts, s.ts, c.lane, s.lane
        ce, se = c0 + c.end_ns - c.start_ns, s0 + s.end_ns - s.start_ns
        if c0 >= 0 and s0 >= 0 and ce - c0 >= long and se - s0 >= long:  # the usual case, in one go
            qc0, rc0 = divmod(c0, 1000)
            qce, rce = divmod(ce, 1000)
            qs0, rs0 = divmod(s0, 1000)
            qse, rse = divmod(se, 1000)
            buf.append(pair % (
                cl, qc0 + 1, frac[rc0], cl, qce - 2, frac[rce], sl, qs0 + 1, frac[rs0], sl, qse - 2, frac[rse],
                fid, cl, qc0 + 1 + up[rc0], frac_up[rc0], fid, sl, qs0 + 1 + up[rs0], frac_up[rs0],
                fid + 1, sl, qse - 2 + up[rse], frac_up[rse], fid + 1, cl, qce - 2 + up[rce], frac_up[rce]))
            n += 8
        else:
            before = len(buf)
            c_send, c_recv = _markers(c, "rpc send", "rpc reply received", buf)
            s_recv, s_send = _markers(s, "rpc receive", "rpc reply sent", buf)
            buf.append(_named(_FLOW, "rpc request") % (fid, cl, *c_send, fid, sl, *s_recv))
            buf.append(_named(_FLOW, "rpc reply") % (fid + 1, sl, *s_send, fid + 1, cl, *c_recv))
            n += len(buf) - before + 2  # a flow item holds two events
        if len(buf) >= _CHUNK:
            yield ",".join(buf), n
            buf, n = [], 0
    if buf:
        yield ",".join(buf), n


def _markers(s: Span, first: str, last: str, out: list[str]) -> tuple[tuple, tuple]:
    """Add short marker slices just inside both ends of a span slice (Perfetto
    draws an arrow from the end of its source slice to the start of its target,
    so binding to markers makes arrows point the right way) and return the
    ts (as %s%s parts) a flow binds to at the start and at the end."""
    ts, dur = s.ts, s.end_ns - s.start_ns
    if dur < _MARKER_NS:  # too short for markers: bind to the slice itself
        mid = _us(ts + dur // 2)
        return mid, mid
    m = min(_MARKER_NS, dur // 8)
    a0, b0 = ts + m, ts + dur - 2 * m
    out.append(_MARK % (first, s.lane, *_us(a0), *_us(m)))
    out.append(_MARK % (last, s.lane, *_us(b0), *_us(m)))
    return _us(a0 + m // 2), _us(b0 + m // 2)


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
