"""RPC spans drawn on the merged timeline: client slices on the caller and
server slices on the callee, on "RPC client"/"RPC server" lanes of the
worker's process, joined by flow arrows client -> server (request) and
server -> client (reply)."""

from __future__ import annotations

from typing import Any, Callable

from ._merge_model import KIND_CLIENT, KIND_SERVER, Span, Timebase

SPAN_CAT = "rpc_observe.span"
FLOW_CAT = "rpc_observe.flow"
LANE_TID_BASE = 1_000_000_000  # above any Linux tid (pid_max <= 2**22)
MARKER_US = 1.0  # send/receive marker slices that flows bind to

_Placed = tuple[int, int, float, float]  # pid, tid, ts, dur of a span's slice
_Point = tuple[int, int, float]  # pid, tid, ts a flow binds to


def rpc_pairs(spans: dict[tuple[str, str], Span]) -> list[tuple[Span, Span]]:
    """(client, server) for every server span whose parent is a client span."""
    pairs: list[tuple[Span, Span]] = []
    for s in spans.values():
        if s.kind == KIND_SERVER and s.parent_id:
            c = spans.get((s.trace_id, s.parent_id))
            if c is not None and c.kind == KIND_CLIENT:
                pairs.append((c, s))
    return pairs


def draw_rpcs(spans: dict[tuple[str, str], Span], pairs: list[tuple[Span, Span]], workers: list[str],
              main_pid: dict[str, int], timebase: Timebase, flow_id: Callable[[tuple], int],
              out: list[dict[str, Any]]) -> int:
    """Append the lanes, slices and flows of the RPC spans to ``out``; returns
    the number of flows."""
    placed, lane_names = _place_on_lanes(spans, workers, main_pid, timebase)
    for (pid, tid), name in sorted(lane_names.items()):
        # Negative sort index: the RPC lanes come above the profiler's threads.
        for meta, args in (("thread_name", {"name": name}),
                           ("thread_sort_index", {"sort_index": -100_000 + tid % 10_000})):
            out.append({"ph": "M", "name": meta, "pid": pid, "tid": tid, "args": args})
    for s in spans.values():
        p = placed.get(id(s))
        if p is not None:  # neither client nor server (internal span): not drawn
            out.append(_span_slice(s, p, timebase.offsets_us))
    return _draw_flows(pairs, placed, flow_id, out)


def _place_on_lanes(spans: dict[tuple[str, str], Span], workers: list[str], main_pid: dict[str, int],
                    timebase: Timebase) -> tuple[dict[int, _Placed], dict[tuple[int, int], str]]:
    """id(span) -> where its slice goes, and (pid, tid) -> lane name.

    Concurrent (async) calls overlap, and slices on one thread must nest, so
    each worker's client and server spans are spread over as many lanes as
    needed."""
    placed: dict[int, _Placed] = {}
    lane_names: dict[tuple[int, int], str] = {}
    groups: dict[tuple[str, int], list[Span]] = {}
    for s in spans.values():
        groups.setdefault((s.worker, s.kind), []).append(s)
    for wi, w in enumerate(workers):
        for role, kind, label in ((0, KIND_CLIENT, "RPC client"), (1, KIND_SERVER, "RPC server")):
            mine = groups.get((w, kind), [])
            lanes = _lanes(mine)
            for s in mine:
                tid = LANE_TID_BASE + wi * 10_000 + role * 5_000 + lanes[id(s)]
                lane_names[(main_pid[w], tid)] = f"{label} #{lanes[id(s)]}"
                ts = timebase.place_us(w, s.start_ns)
                placed[id(s)] = (main_pid[w], tid, ts, (s.end_ns - s.start_ns) / 1000.0)
    return placed, lane_names


def _lanes(items: list[Span]) -> dict[int, int]:
    """Greedy interval partitioning: id(span) -> lane, no overlap in a lane."""
    ends: list[int] = []
    lanes: dict[int, int] = {}
    for s in sorted(items, key=lambda s: (s.start_ns, -s.end_ns)):
        for i, e in enumerate(ends):
            if e <= s.start_ns:
                ends[i] = s.end_ns
                lanes[id(s)] = i
                break
        else:
            lanes[id(s)] = len(ends)
            ends.append(s.end_ns)
    return lanes


def _span_slice(s: Span, p: _Placed, offsets_us: dict[str, float]) -> dict[str, Any]:
    pid, tid, ts, dur = p
    kind = "client" if s.kind == KIND_CLIENT else "server"
    args: dict[str, Any] = {"trace_id": s.trace_id, "span_id": s.span_id, "kind": kind}
    if s.parent_id:
        args["parent_span_id"] = s.parent_id
    for key, name in (("rpc.method", "method"), ("torch.rpc.src", "src"),
                      ("torch.rpc.dst", "dst"), ("torch.rpc.exec_mode", "exec_mode")):
        if key in s.attrs:
            args[name] = s.attrs[key]
    args["status"] = {0: "UNSET", 1: "OK", 2: "ERROR"}.get(s.status_code, str(s.status_code))
    args["clock_offset_us"] = round(offsets_us.get(s.worker, 0.0), 3)
    args["attributes"] = s.attrs
    ev = {"ph": "X", "cat": SPAN_CAT, "name": s.name, "pid": pid, "tid": tid,
          "ts": round(ts, 3), "dur": round(dur, 3), "args": args}
    if s.status_code == 2:
        ev["cname"] = "terrible"  # Perfetto/Chrome's red
        exc = [e for e in s.events if e.get("name") == "exception"]
        args["error"] = s.status_message or (exc[0].get("exception.message", "") if exc else "") or "error"
        if exc:
            args["exception"] = exc[0]
    return ev


def _draw_flows(pairs: list[tuple[Span, Span]], placed: dict[int, _Placed],
                flow_id: Callable[[tuple], int], out: list[dict[str, Any]]) -> int:
    n_flows = 0
    for c, s in pairs:
        pc, ps = placed.get(id(c)), placed.get(id(s))
        if pc is None or ps is None:
            continue
        c_send, c_recv = _markers(pc, "rpc send", "rpc reply received", c, out)
        s_recv, s_send = _markers(ps, "rpc receive", "rpc reply sent", s, out)
        for name, (fp, ft, fts), (tp, tt, tts) in (
            ("rpc request", c_send, s_recv), ("rpc reply", s_send, c_recv)
        ):
            fid = flow_id(("rpc", c.trace_id, c.span_id, name))
            out.append({"ph": "s", "cat": FLOW_CAT, "name": name, "id": fid, "pid": fp, "tid": ft, "ts": fts})
            out.append({"ph": "f", "bp": "e", "cat": FLOW_CAT, "name": name, "id": fid,
                        "pid": tp, "tid": tt, "ts": tts})
            n_flows += 1
    return n_flows


def _markers(p: _Placed, first: str, last: str, s: Span, out: list[dict[str, Any]]) -> tuple[_Point, _Point]:
    """Add short marker slices just inside both ends of a span slice (Perfetto
    draws an arrow from the end of its source slice to the start of its target,
    so binding to markers makes arrows point the right way) and return the
    (pid, tid, ts) binding points for a flow at the start and at the end."""
    pid, tid, ts, dur = p
    if dur < MARKER_US:  # too short for markers: bind to the slice itself
        mid = round(ts + dur / 2, 3)
        return (pid, tid, mid), (pid, tid, mid)
    m = min(MARKER_US, dur / 8)
    a0, a1 = ts + m, ts + 2 * m
    b0, b1 = ts + dur - 2 * m, ts + dur - m
    for name, t0 in ((first, a0), (last, b0)):
        out.append({"ph": "X", "cat": SPAN_CAT, "name": name, "pid": pid, "tid": tid,
                    "ts": round(t0, 3), "dur": round(m, 3), "args": {"span_id": s.span_id}})
    return (pid, tid, round((a0 + a1) / 2, 3)), (pid, tid, round((b0 + b1) / 2, 3))
