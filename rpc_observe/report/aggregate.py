"""What a report keeps of a run's spans, taken as they stream by: bounded tables, whatever
the run's size.

- per method (at most ``MAX_METHODS``, the rest in one ``(other)`` row): calls and errors,
  client and server latency histograms, and for the calls whose SERVER span was seen the
  split client = server + outside;
- per caller -> callee pair (at most ``MAX_WORKERS`` workers, the rest as ``(other)``): calls, errors;
- per worker, the time bins of :mod:`.series`;
- the ``SLOWEST`` slowest client calls, at most ``SLOWEST_PER_METHOD`` of a method (a heap per
  method), whose traces a second pass reads whole;
- per ordered worker pair, the bounds each paired call puts on the clock offset (as
  :mod:`rpc_observe.merge.clock` takes them).

A CLIENT span and its SERVER span (``parentSpanId`` = the client's span id) are paired as
they come; one whose peer has not come within ``PAIR_HORIZON_NS`` of the reading front (the
streams are read in time order) is given up, so memory holds only the calls in flight.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from rpc_observe.merge.model import KIND_CLIENT, KIND_SERVER, Span

from .series import Latency, TimeBins

MAX_METHODS = 40
MAX_WORKERS = 32
SLOWEST = 12
SLOWEST_PER_METHOD = 3  # so that one slow method does not hide the others' slowest calls
OTHER = "(other)"
PAIR_HORIZON_NS = 60 * 10**9
_ERROR = 2  # OTLP status code


@dataclass
class MethodStats:
    calls: int = 0
    errors: int = 0
    server_calls: int = 0
    server_errors: int = 0
    client: Latency = field(default_factory=Latency)
    server: Latency = field(default_factory=Latency)
    paired: int = 0
    paired_client_ns: int = 0
    paired_server_ns: int = 0
    slowest: list[tuple[int, str, str]] = field(default_factory=list)  # min-heap of (duration, trace id, span id)


@dataclass
class PairStats:
    calls: int = 0
    errors: int = 0


@dataclass
class ClockBounds:
    """offset[server] - offset[client] lies in [lo_ns, hi_ns] (intersected over the pairs)."""

    lo_ns: int
    hi_ns: int
    pairs: int = 0


class RunStats:
    """Takes spans (``add_many``) and keeps the bounded summary above."""

    def __init__(self) -> None:
        self.spans = 0
        self.methods: dict[str, MethodStats] = {}
        self.pairs: dict[tuple[str, str], PairStats] = {}
        self.workers: dict[str, int] = {}  # worker -> spans
        self.bins: TimeBins | None = None
        self.clock: dict[tuple[str, str], ClockBounds] = {}
        self.front_ns = 0
        self.unpaired = 0
        self._clients: OrderedDict[str, Span] = OrderedDict()  # span id -> client waiting for its server
        self._servers: OrderedDict[str, Span] = OrderedDict()  # parent span id -> server waiting for its client

    def _method(self, name: str) -> MethodStats:
        stats = self.methods.get(name)
        if stats is None:
            if len(self.methods) >= MAX_METHODS:
                name = OTHER
            stats = self.methods.setdefault(name, MethodStats())
        return stats

    def _worker(self, name: str) -> str:
        if name in self.workers:
            return name
        if len(self.workers) >= MAX_WORKERS:
            name = OTHER
        self.workers.setdefault(name, 0)
        return name

    def add_many(self, spans: list[Span]) -> None:
        for sp in spans:
            self.add(sp)

    def add(self, sp: Span) -> None:
        if sp.kind not in (KIND_CLIENT, KIND_SERVER):
            return
        self.spans += 1
        worker = self._worker(sp.worker)
        self.workers[worker] += 1
        attrs = sp.attrs
        stats = self._method(str(attrs.get("rpc.method") or sp.name))
        duration = sp.end_ns - sp.start_ns
        failed = sp.status_code == _ERROR
        if sp.kind == KIND_CLIENT:
            stats.calls += 1
            stats.errors += failed
            stats.client.add(duration)
            pair = self.pairs.setdefault((worker, self._worker(str(attrs.get("torch.rpc.dst") or "?"))), PairStats())
            pair.calls += 1
            pair.errors += failed
            if self.bins is None:
                self.bins = TimeBins(sp.start_ns)
            self.bins.add(worker, sp.start_ns, sp.end_ns, failed)
            entry = (duration, sp.trace_id, sp.span_id)
            if len(stats.slowest) < 2 * SLOWEST_PER_METHOD:  # room for calls of one trace that crowd the top
                heapq.heappush(stats.slowest, entry)
            elif entry > stats.slowest[0]:
                heapq.heapreplace(stats.slowest, entry)
            server = self._servers.pop(sp.span_id, None)
            if server is None:
                self._clients[sp.span_id] = sp
            else:
                self._pair(sp, server, stats)
        else:
            stats.server_calls += 1
            stats.server_errors += failed
            stats.server.add(duration)
            client = self._clients.pop(sp.parent_id, None) if sp.parent_id else None
            if client is None:
                if sp.parent_id:
                    self._servers[sp.parent_id] = sp
            else:
                self._pair(client, sp, stats)

    def _pair(self, client: Span, server: Span, stats: MethodStats) -> None:
        stats.paired += 1
        stats.paired_client_ns += client.end_ns - client.start_ns
        stats.paired_server_ns += server.end_ns - server.start_ns
        if client.worker == server.worker or client.status_code == _ERROR:
            return  # a failed client (timeout, lost peer) may end before its server: no bound on the clocks
        lo, hi = client.start_ns - server.start_ns, client.end_ns - server.end_ns
        bounds = self.clock.get((client.worker, server.worker))
        if bounds is None:
            bounds = self.clock[client.worker, server.worker] = ClockBounds(lo, hi)
        else:
            bounds.lo_ns, bounds.hi_ns = max(bounds.lo_ns, lo), min(bounds.hi_ns, hi)
        bounds.pairs += 1

    def advance(self, front_ns: int) -> None:
        """The streams have been read up to ``front_ns``: give up on calls whose peer is overdue."""
        self.front_ns = max(self.front_ns, front_ns)
        horizon = self.front_ns - PAIR_HORIZON_NS
        for waiting in (self._clients, self._servers):
            while waiting:
                sp = next(iter(waiting.values()))
                if sp.start_ns >= horizon:
                    break
                waiting.popitem(last=False)
                self.unpaired += 1

    def finish(self) -> None:
        self.unpaired += len(self._clients) + len(self._servers)
        self._clients.clear()
        self._servers.clear()

    def slowest_calls(self) -> list[tuple[int, str, str]]:
        """The ``SLOWEST`` slowest client calls, one per trace, slowest first: at most
        ``SLOWEST_PER_METHOD`` of a method, unless fewer methods leave room."""
        seen: set[str] = set()
        picked, rest = [], []
        for m in self.methods.values():
            kept = 0
            for entry in sorted(m.slowest, reverse=True):
                if entry[1] in seen:
                    continue
                seen.add(entry[1])
                if kept < SLOWEST_PER_METHOD:
                    picked.append(entry)
                    kept += 1
                else:
                    rest.append(entry)
        picked = sorted(picked, reverse=True)[:SLOWEST]
        return sorted(picked + sorted(rest, reverse=True)[:SLOWEST - len(picked)], reverse=True)

    def clock_pairs(self) -> list[tuple[Any, ...]]:
        """One constraint tuple per ordered worker pair, in :func:`rpc_observe.merge.clock.estimate_offsets`'
        form (client, server, client start, client end, server start, server end, in us): its bounds
        are exactly the intersection of all the pair's calls."""
        return [(c, s, b.lo_ns / 1000, b.hi_ns / 1000, 0.0, 0.0) for (c, s), b in sorted(self.clock.items())]
