"""RPC spans laid out on the merged timeline: client slices on the caller and
server slices on the callee, on "RPC client"/"RPC server" lanes of the
worker's process, joined by flow arrows client -> server (request) and
server -> client (reply), which :mod:`.encode` writes out."""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from .model import KIND_CLIENT, KIND_SERVER, Span

SPAN_CAT = "rpc_observe.span"
FLOW_CAT = "rpc_observe.flow"
LANE_TID_BASE = 1_000_000_000  # above any Linux tid (pid_max <= 2**22)
MARKER_US = 1.0  # send/receive marker slices that flows bind to


@dataclass
class SpanIndex:
    """What the layout needs of the spans, gathered in one pass over them:
    each worker's client and server spans (sorted by start, longest first),
    and the (client, server) pairs."""

    groups: dict[tuple[str, int], list[Span]] = field(default_factory=dict)
    pairs: list[tuple[Span, Span]] = field(default_factory=list)

    def first_ns(self) -> dict[str, int]:
        """Each worker's earliest drawn span start."""
        first: dict[str, int] = {}
        for (w, _), group in self.groups.items():
            if group and group[0].start_ns < first.get(w, group[0].start_ns + 1):
                first[w] = group[0].start_ns
        return first


def index_spans(spans: dict[tuple[str, str], Span]) -> SpanIndex:
    """Index the spans; a pair is a server span whose parent is a client span
    (numbered in ``Span.pair``; a client's first server span only).  Spans that
    are neither client nor server (internal) are not drawn."""
    index = SpanIndex()
    groups, pairs, get = index.groups, index.pairs, spans.get
    for s in spans.values():
        kind = s.kind
        if kind == KIND_SERVER:
            if s.parent_id:
                c = get((s.trace_id, s.parent_id))
                if c is not None and c.kind == KIND_CLIENT and c.pair < 0:  # one call, one server span
                    c.pair = s.pair = len(pairs)
                    pairs.append((c, s))
        elif kind != KIND_CLIENT:
            continue
        group = groups.get((s.worker, kind))
        if group is None:
            group = groups[(s.worker, kind)] = []
        group.append(s)
    for group in groups.values():
        group.sort(key=attrgetter("end_ns"), reverse=True)  # two stable sorts: by start, longest first
        group.sort(key=attrgetter("start_ns"))
    return index


def lanes(workers: list[str]) -> Iterator[tuple[str, int, str, int]]:
    """(worker, kind, lane label, base tid) of every RPC lane group, in order."""
    for wi, w in enumerate(workers):
        for role, kind, label in ((0, KIND_CLIENT, "RPC client"), (1, KIND_SERVER, "RPC server")):
            yield w, kind, label, LANE_TID_BASE + wi * 10_000 + role * 5_000


def lane_meta(pid: int, label: str, base_tid: int, n_lanes: int) -> list[dict[str, Any]]:
    """The thread metadata events of a group's lanes."""
    meta: list[dict[str, Any]] = []
    for lane in range(n_lanes):
        tid = base_tid + lane
        meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": f"{label} #{lane}"}})
        # Negative sort index: the RPC lanes come above the profiler's threads.
        meta.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                     "args": {"sort_index": -100_000 + tid % 10_000}})
    return meta


def assign_lanes(items: list[Span], base_tid: int) -> int:
    """Interval partitioning of spans sorted by start (longest first), first
    fit: each span on the lowest free lane, so slices on one thread never
    overlap (concurrent async calls need several).  Sets ``tid``; returns the
    number of lanes."""
    busy: list[tuple[int, int]] = []  # (end, lane) of the lanes in use
    free: list[int] = []
    n = 0
    push, pop = heapq.heappush, heapq.heappop
    for s in items:
        start = s.start_ns
        while busy and busy[0][0] <= start:
            push(free, pop(busy)[1])
        if free:
            lane = pop(free)
        else:
            lane, n = n, n + 1
        push(busy, (s.end_ns, lane))
        s.tid = base_tid + lane
    return n
