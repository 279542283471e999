"""Clock-offset estimation for ``rpc-observe merge`` (stdlib only).

Every worker stamps its spans and profiler events with its own wall clock.
An RPC gives an NTP-style constraint between the caller's and the callee's
clocks: once both are on one clock, the server slice must lie inside the
client slice::

    client_start <= server_start + d    and    server_end + d <= client_end

where ``d = offset[server] - offset[client]`` and ``offset[w]`` is the
correction *added* to worker ``w``'s local timestamps to put them on the
reference clock.  So every pair bounds ``d`` to
``[client_start - server_start, client_end - server_end]``; pairs in the other
direction bound ``-d`` the same way.  Intersecting the intervals of all pairs
between two workers gives an edge interval: its midpoint is the estimate and
its half-width the error bound.  Offsets are propagated from a reference
worker (the one in most cross-worker pairs, offset 0) along the edges with
the smallest accumulated bound (Dijkstra; for a tree this is plain BFS), and
the bounds add up along the path.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple


class RpcPair(NamedTuple):
    """One matched client/server span pair, times in microseconds on the
    local clock of the worker that recorded them (any common origin)."""

    client_worker: str
    server_worker: str
    client_start_us: float
    client_end_us: float
    server_start_us: float
    server_end_us: float


@dataclass
class EdgeInterval:
    """Allowed values of ``offset[b] - offset[a]`` for workers ``a < b``."""

    lo: float
    hi: float
    pairs: int = 0

    @property
    def consistent(self) -> bool:
        return self.lo <= self.hi

    @property
    def midpoint(self) -> float:
        return (self.lo + self.hi) / 2.0

    @property
    def half_width(self) -> float:
        # For an inconsistent (empty) intersection, report half the gap: the
        # smallest correction that would have to be ignored to make it fit.
        return abs(self.hi - self.lo) / 2.0


@dataclass
class ClockEstimate:
    """Result of :func:`estimate_offsets`.

    ``offsets_us[w]`` is added to worker ``w``'s local timestamps.
    ``bounds_us[w]`` is the error bound (microseconds) of that offset relative
    to ``reference``; ``None`` for workers with no RPC path to the reference
    (their own wall clock is trusted, aligned only within their component).
    """

    reference: str | None
    offsets_us: dict[str, float] = field(default_factory=dict)
    bounds_us: dict[str, float | None] = field(default_factory=dict)
    edges: dict[tuple[str, str], EdgeInterval] = field(default_factory=dict)
    pairs_per_worker: dict[str, int] = field(default_factory=dict)

    @property
    def inconsistent_edges(self) -> list[tuple[str, str]]:
        return sorted(k for k, e in self.edges.items() if not e.consistent)

    @property
    def unaligned(self) -> list[str]:
        return [w for w, b in self.bounds_us.items() if b is None]


def edge_intervals(pairs: Iterable[RpcPair | tuple]) -> dict[tuple[str, str], EdgeInterval]:
    """Intersect the per-pair constraints into one interval per worker pair.

    ``pairs`` may be :class:`RpcPair` or plain tuples in its field order.
    Keys are ``(a, b)`` with ``a < b``; the interval bounds
    ``offset[b] - offset[a]``.  Same-worker pairs carry no information and
    are ignored.
    """
    edges: dict[tuple[str, str], EdgeInterval] = {}
    for c, s, c_start, c_end, s_start, s_end in pairs:
        if c == s:
            continue
        # bounds on offset[s] - offset[c]
        lo = c_start - s_start
        hi = c_end - s_end
        if c < s:
            key = (c, s)
        else:  # bounds on offset[c] - offset[s] = -(offset[s] - offset[c])
            key = (s, c)
            lo, hi = -hi, -lo
        e = edges.get(key)
        if e is None:
            edges[key] = EdgeInterval(lo, hi, 1)
        else:
            if lo > e.lo:
                e.lo = lo
            if hi < e.hi:
                e.hi = hi
            e.pairs += 1
    return edges


def estimate_offsets(
    pairs: Iterable[RpcPair | tuple], workers: Sequence[str] = ()
) -> ClockEstimate:
    """Estimate per-worker clock offsets from matched RPC pairs.

    ``workers`` lists every worker that should get an entry (workers with
    profiler traces but no spans included), in preference order for ties.
    """
    edges = edge_intervals(pairs)
    order = list(dict.fromkeys(list(workers) + sorted({w for k in edges for w in k})))
    rank = {w: i for i, w in enumerate(order)}
    count = {w: 0 for w in order}
    adj: dict[str, list[tuple[str, float, float]]] = {w: [] for w in order}
    for (a, b), e in edges.items():
        count[a] += e.pairs
        count[b] += e.pairs
        adj[a].append((b, e.midpoint, e.half_width))
        adj[b].append((a, -e.midpoint, e.half_width))

    est = ClockEstimate(reference=None, edges=edges, pairs_per_worker=dict(count))
    done: set[str] = set()
    first = True
    # Components in order of "most pairs first"; the first one holds the
    # global reference, the others are aligned internally but unanchored.
    for start in sorted(order, key=lambda w: (-count[w], rank[w])):
        if start in done:
            continue
        if first:
            est.reference = start
        heap: list[tuple[float, int, str, float]] = [(0.0, rank[start], start, 0.0)]
        while heap:
            bound, _, w, off = heapq.heappop(heap)
            if w in done:
                continue
            done.add(w)
            est.offsets_us[w] = off
            est.bounds_us[w] = bound if first else None
            for nb, mid, hw in adj[w]:
                if nb not in done:
                    heapq.heappush(heap, (bound + hw, rank[nb], nb, off + mid))
        first = False
    return est
