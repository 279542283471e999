"""Prometheus metrics of RPC traffic, kept cheap enough for every call.

An RPC's hot path runs on the agent's pool threads with cold caches, where every Python
step costs several times its warm cost. So the hot path only appends one tuple per
message or call to a deque (a single C call, safe across threads), and `drain` folds
them into plain lists under one lock: the housekeeping thread does it a few times a
second, and every scrape does it first, so a scrape is always exact. A custom
collector turns the lists into metric families, as `declarations` declares them. Label sets are bound once per call
site; function names (`RPC_OBSERVE_MAX_METHODS`) and peer names (`RPC_OBSERVE_MAX_PEERS`) are
capped, the rest become `other`.

Series must not grow with the world size: by default (`RPC_OBSERVE_PEER_LABELS=counters`)
a peer is a label only of the caller's counters and its in-flight gauge (the traffic
matrix), never of a histogram or of the callee's series; `histograms` also puts `dst` and
`src` on the latency histograms (and `src` on server errors), as before.
"""

from __future__ import annotations

import bisect
import collections
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Exemplar
from prometheus_client.utils import floatToGoString

from . import health

if TYPE_CHECKING:
    from .tracing import SpanRecord
from .declarations import (
    BY_NAME,
    CALL_METRICS,
    COUNT_BUCKETS,
    LATENCY_BUCKETS,
    SERIALIZATION_BUCKETS,
    SIZE_BUCKETS,
    MetricDeclaration,
)

OTHER = "other"
DEFAULT_MAX_PEERS = 256  # config.Config.max_peers
Cell = list  # [value] for counters and gauges; [bucket counts..., sum] for histograms


class MessageCells(NamedTuple):
    """The histograms of one (direction, message, method), bound once per call site."""

    payload_bytes: Cell
    tensors: Cell
    tensor_bytes: Cell
    storage_bytes: Cell
    seconds: Cell


class ClientCells(NamedTuple):
    """The metrics of one client call site (method, mode, destination)."""

    duration: Cell
    requests: Cell
    in_flight: Cell
    sent_bytes: Cell
    received_bytes: Cell
    callee: Cell  # the callee's own time, as its response says
    outside: Cell  # the call's time minus the callee's: its pool's queue, (de)serialization, the wire
    exemplars: list  # duration's exemplar per bucket: (span, seconds) of a sampled call, or None


class ServerCells(NamedTuple):
    """The metrics of one served call site (method, and src with RPC_OBSERVE_PEER_LABELS=histograms)."""

    duration: Cell
    exemplars: list  # as ClientCells.exemplars


# The records the hot paths queue, built there as plain tuple displays: a NamedTuple
# instance costs 2-4x more to build (+85 ns warm per record, 4 records per RPC). These
# aliases cost nothing at run time; mypy checks each display against them, and each fold
# function's unpacking too. Each record starts with the fold function that takes it:
# (fold_message, MessageCells, payload bytes, tensors, tensor bytes, storage bytes, seconds,
#  peer bytes cell or None, bytes on the wire): the cell is the destination's sent_bytes for
#  a request the caller pickles, its received_bytes for a response it unpickles.
# A call's or a served call's span (None without a tracer): if sampled, its bucket's exemplar;
# the fold keeps a reference, the scrape formats its ids.
MessageRecord = tuple["Callable[[MessageRecord], None]", MessageCells, int, int, int, int, float, "Cell | None", int]
StartedRecord = tuple["Callable[[StartedRecord], None]", ClientCells]  # a call started
# A call ended: (..., seconds, span).
FinishedRecord = tuple["Callable[[FinishedRecord], None]", ClientCells, float, "SpanRecord | None"]
# A call whose response gave the callee's time: (..., seconds, the callee's seconds, span).
SplitRecord = tuple["Callable[[SplitRecord], None]", ClientCells, float, float, "SpanRecord | None"]
# A UDF run ended: (..., seconds, span).
ServedRecord = tuple["Callable[[ServedRecord], None]", ServerCells, float, "SpanRecord | None"]
Record = MessageRecord | StartedRecord | FinishedRecord | SplitRecord | ServedRecord


class RecordQueue(Protocol):
    """The queue of records `drain` folds: a deque, or the C core's `Records` (hooks/_core.c), which its hot paths
    fill without making tuples and which gives the same tuples to Python."""

    def append(self, record: Record, /) -> None: ...
    def popleft(self) -> Record: ...
    def clear(self) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Record]: ...


class _Family:
    """One declared metric: its label names and, per label values, a cell (counter/gauge) or histogram."""

    def __init__(self, declaration: MetricDeclaration, peer_histograms: bool) -> None:
        self.declaration, self.buckets = declaration, declaration.buckets
        self.labels = declaration.label_names(peer_histograms)
        self.children: dict[tuple[str, ...], list] = {}
        # Per label values, a bucket's last exemplar: (span record, seconds) or None; declared histograms only.
        self.exemplars: dict[tuple[str, ...], list] | None = {} if declaration.exemplars else None

    def exemplars_of(self, values: tuple[str, ...]) -> list:
        """The exemplar slots of `values` (one per bucket, +Inf included); call with the child made."""
        assert self.exemplars is not None and self.buckets is not None
        return self.exemplars.setdefault(values, [None] * (len(self.buckets) + 1))

    def child(self, values: tuple[str, ...]) -> Cell:
        """The cell for `values`: [value] for counters and gauges; [counts..., sum] for histograms."""
        cell = self.children.get(values)
        if cell is None:
            cell = [0] * (len(self.buckets) + 2) if self.buckets is not None else [0]
            cell = self.children.setdefault(values, cell)
        return cell


def value_family(declaration: MetricDeclaration,
                 labels: tuple[str, ...] | None = None) -> CounterMetricFamily | GaugeMetricFamily:
    """An empty family of a declared counter or gauge (`labels`: its declared ones if None)."""
    labels = declaration.label_names() if labels is None else labels
    if declaration.kind == "counter":  # prometheus_client adds the _total
        return CounterMetricFamily(declaration.name.removesuffix("_total"), declaration.help, labels=labels)
    return GaugeMetricFamily(declaration.name, declaration.help, labels=labels)


_INTERNAL_ERRORS = BY_NAME["rpc_observe_internal_errors_total"]
_SPANS_DROPPED = BY_NAME["rpc_observe_spans_dropped_total"]
_INVALID_CONTEXT = BY_NAME["rpc_observe_invalid_context_total"]
_EXPORTS_FAILED = BY_NAME["rpc_observe_metric_exports_failed_total"]
_AGENT_GAUGES = (  # (declaration, key in the agent's debug info, scale to the declared unit)
    (BY_NAME["torch_rpc_agent_threads"], "agent.thread_pool_size", 1.0),
    (BY_NAME["torch_rpc_agent_idle_threads"], "agent.num_idle_threads", 1.0),
    (BY_NAME["torch_rpc_agent_gil_wait_seconds"], "agent.gil_average_wait_time_us", 1e-6),
)
_ACTIVE_CALLS = BY_NAME["torch_rpc_agent_active_calls"]
_ACTIVE_CALLS_KEYS = (("client", "agent.client_active_calls"), ("server", "agent.server_active_calls"),
                      ("async", "agent.server_active_async_calls"))


_bisect = bisect.bisect_left


# Record handlers, applied by `Metrics.drain` under its lock; each record is (handler, ...).
# The hot paths build the records themselves and pass them to `Metrics.record`.
def fold_message(r: MessageRecord) -> None:
    """Five observations, inlined: a function call per histogram made the fold ~15 % dearer (2.45 against
    2.1 us per RPC's records, warm), and it runs for every message in the process everyone calls.
    Sizes and counts are >= 0; a duration is clamped at 0, as client_python does."""
    _, cells, nbytes, ntensors, tensor_bytes, storage_bytes, seconds, peer_cell, wire_bytes = r
    if peer_cell is not None:
        peer_cell[0] += wire_bytes
    cell = cells.payload_bytes
    cell[_bisect(SIZE_BUCKETS, nbytes)] += 1
    cell[-1] += nbytes
    cell = cells.tensors
    cell[_bisect(COUNT_BUCKETS, ntensors)] += 1
    cell[-1] += ntensors
    cell = cells.tensor_bytes
    cell[_bisect(SIZE_BUCKETS, tensor_bytes)] += 1
    cell[-1] += tensor_bytes
    cell = cells.storage_bytes
    cell[_bisect(SIZE_BUCKETS, storage_bytes)] += 1
    cell[-1] += storage_bytes
    cell = cells.seconds
    cell[_bisect(SERIALIZATION_BUCKETS, seconds)] += 1
    cell[-1] += seconds if seconds > 0 else 0.0


def fold_started(r: StartedRecord) -> None:
    _, cells = r
    cells.requests[0] += 1
    cells.in_flight[0] += 1


def fold_finished(r: FinishedRecord) -> None:
    _, cells, seconds, span = r
    cell = cells.duration
    bucket = _bisect(LATENCY_BUCKETS, seconds)
    cell[bucket] += 1
    cell[-1] += seconds if seconds > 0 else 0.0
    cells.in_flight[0] -= 1
    if span is not None and span.sampled:
        cells.exemplars[bucket] = (span, seconds)


def fold_split(r: SplitRecord) -> None:
    """fold_finished, and the call's time split into the callee's own and the rest (client = callee + outside)."""
    _, cells, seconds, callee, span = r
    cell = cells.duration
    bucket = _bisect(LATENCY_BUCKETS, seconds)
    cell[bucket] += 1
    cell[-1] += seconds if seconds > 0 else 0.0
    cells.in_flight[0] -= 1
    if span is not None and span.sampled:
        cells.exemplars[bucket] = (span, seconds)
    cell = cells.callee
    cell[_bisect(LATENCY_BUCKETS, callee)] += 1
    cell[-1] += callee
    outside = seconds - callee if seconds > callee else 0.0  # clocks of one process: < 0 only by rounding
    cell = cells.outside
    cell[_bisect(LATENCY_BUCKETS, outside)] += 1
    cell[-1] += outside


def fold_served(r: ServedRecord) -> None:
    _, cells, seconds, span = r
    cell = cells.duration
    bucket = _bisect(LATENCY_BUCKETS, seconds)
    cell[bucket] += 1
    cell[-1] += seconds if seconds > 0 else 0.0
    if span is not None and span.sampled:
        cells.exemplars[bucket] = (span, seconds)


def fold_records(records: RecordQueue, n: int) -> None:
    """Pops `n` records off the left of `records` and folds each with the function it starts with.
    The reference of the C core's `fold` (hooks/_core.c), which `Metrics.fold_records` becomes where it is built."""
    pop = records.popleft
    for _ in range(n):
        record = pop()
        record[0](record)  # type: ignore[arg-type]  # each record holds the fold that takes it


def _exemplar(span: Any, seconds: float) -> Exemplar:
    """OpenMetrics exemplar of a sampled call: its trace and span ids (shown only to an OpenMetrics scrape)."""
    return Exemplar({"trace_id": format(span.trace_id, "032x"), "span_id": format(span.span_id, "016x")},
                    seconds, span.end_ns / 1e9 if span.end_ns else None)


class Metrics(Collector):
    """The process's RPC metrics, all labelled with its own worker name."""

    __slots__ = ("record",)  # read by the C core on every call: a slot is read at its offset, not by name

    def __init__(
        self,
        worker: str,
        max_names: int,
        agent_info: Callable[[], dict[str, Any]] | None = None,
        before_collect: Callable[[], None] | None = None,
        *,
        max_peers: int = DEFAULT_MAX_PEERS,
        peer_histograms: bool = False,
    ) -> None:
        self.worker = worker
        self._records: RecordQueue = collections.deque()
        self.record: Callable[[Record], None] = self._records.append  # one C call, safe across threads
        # The fold of `drain`: `fold_records`, or the C core's where the hooks found it built.
        self.fold_records: Callable[[RecordQueue, int], None] = fold_records
        self._before_collect = before_collect
        self._limits = {"method": max_names, "peer": max_peers, "exception": max_names}
        self._names: dict[str, set] = {"method": set(), "peer": set(), "exception": set()}
        self.peer_histograms = peer_histograms  # RPC_OBSERVE_PEER_LABELS=histograms
        self.agent_info = agent_info
        self.lock = threading.Lock()
        # Resolved here, once: the hot paths only touch cells bound from these families.
        families = {d.name: _Family(d, peer_histograms) for d in CALL_METRICS}
        self._families = tuple(families.values())  # in the declared order, which is the scrape's
        self.serialized_bytes = families["torch_rpc_serialized_bytes"]
        self.serialized_tensors = families["torch_rpc_serialized_tensors"]
        self.tensor_bytes = families["torch_rpc_tensor_bytes"]
        self.storage_bytes = families["torch_rpc_tensor_storage_bytes"]
        self.serialization_seconds = families["torch_rpc_serialization_seconds"]
        self.client_duration = families["torch_rpc_client_duration_seconds"]
        self.client_callee = families["torch_rpc_client_callee_seconds"]
        self.client_outside = families["torch_rpc_client_outside_seconds"]
        self.server_duration = families["torch_rpc_server_duration_seconds"]
        self.client_requests = families["torch_rpc_client_requests_total"]
        self.client_errors = families["torch_rpc_client_errors_total"]
        self.client_sent_bytes = families["torch_rpc_client_sent_bytes_total"]
        self.client_received_bytes = families["torch_rpc_client_received_bytes_total"]
        self.server_errors = families["torch_rpc_server_errors_total"]
        self.client_in_flight = families["torch_rpc_client_in_flight"]

    # -- binding label sets (once per call site) --------------------------------
    def cap(self, kind: str, name: str) -> str:
        """`name` if fewer distinct names of its kind were seen than its cap (RPC_OBSERVE_MAX_METHODS for
        methods and exceptions, RPC_OBSERVE_MAX_PEERS for peers), else `other`."""
        seen = self._names[kind]
        if name in seen:
            return name
        with self.lock:
            if len(seen) < self._limits[kind]:
                seen.add(name)
                return name
        return OTHER

    def message_cells(self, direction: str, message: str, method: str) -> MessageCells:
        values = (self.worker, direction, message, self.cap("method", method))
        with self.lock:
            return MessageCells(
                self.serialized_bytes.child(values),
                self.serialized_tensors.child(values),
                self.tensor_bytes.child(values),
                self.storage_bytes.child(values),
                self.serialization_seconds.child(values),
            )

    # -- hot path: `record((fold_..., ...))`, one deque append ---------------------
    def use_queue(self, queue: RecordQueue) -> None:
        """Queues records in `queue` from now on (the C core's `Records`); the hooks call it before any call site
        has taken `record`. What was queued before moves over, in order."""
        with self.lock:
            old, self._records, self.record = self._records, queue, queue.append
            while old:
                queue.append(old.popleft())

    def drain(self, limit: int | None = None) -> bool:
        """Folds up to `limit` queued records (all if None) into the metric cells; True if some are left."""
        records = self._records
        with self.lock:
            self.fold_records(records, len(records) if limit is None else min(limit, len(records)))
        return bool(records)

    def client_cells(self, method: str, mode: str, dst: str) -> ClientCells:
        method, dst = self.cap("method", method), self.cap("peer", dst)
        latency = (self.worker, method, mode, dst) if self.peer_histograms else (self.worker, method, mode)
        with self.lock:
            return ClientCells(
                self.client_duration.child(latency),
                self.client_requests.child((self.worker, method, mode, dst)),
                self.client_in_flight.child((self.worker, dst)),
                self.client_sent_bytes.child((self.worker, dst)),
                self.client_received_bytes.child((self.worker, dst)),
                self.client_callee.child(latency),
                self.client_outside.child(latency),
                self.client_duration.exemplars_of(latency),
            )

    def server_cells(self, method: str, src: str) -> ServerCells:
        method = self.cap("method", method)
        values = (self.worker, method, self.cap("peer", src)) if self.peer_histograms else (self.worker, method)
        with self.lock:
            return ServerCells(self.server_duration.child(values), self.server_duration.exemplars_of(values))

    def count_error(self, side: str, method: str, peer: str, exception: str) -> None:
        method, exception = self.cap("method", method), self.cap("exception", exception)
        values: tuple[str, ...]
        if side == "client":  # the caller keeps the peer: its errors are part of the traffic matrix
            family, values = self.client_errors, (self.worker, method, self.cap("peer", peer), exception)
        elif self.peer_histograms:
            family, values = self.server_errors, (self.worker, method, self.cap("peer", peer), exception)
        else:  # the callee's series never grow with its callers (who count the same failures by dst)
            family, values = self.server_errors, (self.worker, method, exception)
        with self.lock:
            family.child(values)[0] += 1

    # -- scrape -------------------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        if self._before_collect is not None:
            try:
                self._before_collect()
            except Exception:
                health.internal_error("before_collect")
        self.drain()
        with self.lock:
            snapshot = [
                (f, [(k, list(v), list(f.exemplars.get(k, ())) if f.exemplars is not None else ())
                     for k, v in f.children.items()])
                for f in self._families
            ]
        for family, children in snapshot:
            declaration = family.declaration
            if family.buckets is not None:
                histogram = HistogramMetricFamily(declaration.name, declaration.help, labels=family.labels)
                for values, cell, exemplars in children:
                    cumulative = 0
                    buckets: list[tuple[str, float] | tuple[str, float, Exemplar]] = []
                    for i, (bound, count) in enumerate(zip(family.buckets + (float("inf"),), cell[:-1])):
                        cumulative += count
                        exemplar = exemplars[i] if exemplars else None
                        if exemplar is None:
                            buckets.append((_le(bound), cumulative))
                        else:
                            buckets.append((_le(bound), cumulative, _exemplar(*exemplar)))
                    histogram.add_metric(values, buckets, cell[-1])
                yield histogram
                continue
            metric = value_family(declaration, family.labels)
            for values, cell, _ in children:
                metric.add_metric(values, cell[0])
            yield metric
        yield from self._collect_health()
        yield from self._collect_agent()

    def _collect_health(self) -> Iterator[Metric]:
        errors = value_family(_INTERNAL_ERRORS)
        for where, count in sorted(health.internal_errors.items()):
            errors.add_metric((self.worker, where), count)
        yield errors
        dropped = value_family(_SPANS_DROPPED)
        for reason, count in health.spans_dropped.items():  # every reason, 0 too: rate() sees the first drop
            dropped.add_metric((self.worker, reason), count)
        yield dropped
        invalid = value_family(_INVALID_CONTEXT)
        invalid.add_metric((self.worker,), health.invalid_contexts[0])
        yield invalid
        failed = value_family(_EXPORTS_FAILED)
        failed.add_metric((self.worker,), health.metric_exports_failed[0])
        yield failed

    def _collect_agent(self) -> Iterator[Metric]:
        try:
            info = self.agent_info() if self.agent_info else None
        except Exception:
            info = None  # no agent (before init_rpc or after shutdown): nothing to report
        if not info:
            return
        for declaration, key, scale in _AGENT_GAUGES:
            if key in info:
                gauge = value_family(declaration)
                gauge.add_metric((self.worker,), float(info[key]) * scale)
                yield gauge
        active = value_family(_ACTIVE_CALLS)
        for side, key in _ACTIVE_CALLS_KEYS:
            if key in info:
                active.add_metric((self.worker, side), float(info[key]))
        yield active


def _le(bound: float) -> str:
    return floatToGoString(bound)  # as prometheus_client writes `le`: 1.048576e+06, +Inf
