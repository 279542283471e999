"""Spans of RPCs: cheap records on the hot path, exported by a background thread.

An OpenTelemetry SDK span costs 15-40 us to start and end; a no-op RPC costs ~450 us.
So the wrappers create plain `SpanRecord`s (ids, times, a shared attribute dict) and
queue them; the exporter thread turns them into OTLP JSON lines or SDK `ReadableSpan`s
for the configured exporters. The queue is bounded: when it is full, spans are dropped
and counted in rpc_observe_spans_dropped_total, so an RPC never waits on an exporter.

Sampling follows OTEL_TRACES_SAMPLER, plus `(parentbased_)rpc_observe_ratelimit`: at most
OTEL_TRACES_SAMPLER_ARG new traces per second per worker, for long high-rate jobs.
"""

from __future__ import annotations

import collections
import contextvars
import logging
import random
import threading
import time
from collections.abc import Callable, MutableMapping
from typing import Any, ClassVar

from opentelemetry import context, propagate, trace
from opentelemetry.baggage import _BAGGAGE_KEY
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from opentelemetry.trace.propagation import _SPAN_KEY

from ..config import Config
from . import health, propagation

_logger = logging.getLogger("rpc_observe")

INTERNAL = 1  # OTLP SpanKind values
SERVER = 2
CLIENT = 3
_getrandbits = random.getrandbits
_LOW_64 = (1 << 64) - 1  # the trace id bits a ratio sampler decides on
_traceparent_entry, _SAMPLED_LAST_DIGITS = propagation.TRACEPARENT_ENTRY, propagation.SAMPLED_LAST_DIGITS
_TRACEPARENT_ENTRY_FORMAT, _FLAGS = propagation.TRACEPARENT_ENTRY_FORMAT, propagation.FLAGS


def _context_getter():
    """`context.get_current`, without its two Python frames when the runtime context is
    OpenTelemetry's default (a ContextVar); each frame counts on the hot path."""
    var = getattr(getattr(context, "_RUNTIME_CONTEXT", None), "_current_context", None)
    return var.get if isinstance(var, contextvars.ContextVar) else context.get_current


_get_current = _context_getter()
_get_ident = threading.get_ident
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)


class SpanRecord:
    """One finished or running span, kept as plain data until export."""

    __slots__ = (
        "name",
        "kind",
        "trace_id",
        "span_id",
        "parent_id",
        "remote_parent",
        "start_ns",
        "end_ns",
        "attributes",
        "error_type",
        "error_message",
        "sampled",
        "callee_ns",
    )

    def __init__(self, name, kind, trace_id, span_id, parent_id, remote_parent, sampled, attributes, start_ns):
        self.name = name
        self.kind = kind
        self.trace_id = trace_id
        self.span_id = span_id
        self.parent_id = parent_id
        self.remote_parent = remote_parent
        self.sampled = sampled
        self.attributes = attributes  # shared per call site: never mutate
        self.start_ns = start_ns
        self.end_ns = 0
        self.error_type = None
        self.error_message = None
        self.callee_ns = -1  # a CLIENT span: the callee's own time, from its response (-1: not known)


class RateLimiter:
    """A token bucket: `rate` new traces per second, bursts of up to max(rate, 1), then none until it refills."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._rate = rate
        self._capacity = max(rate, 1.0)
        self._tokens = self._capacity
        self._clock = clock
        self._last = clock()
        self._lock = threading.Lock()  # RPC threads decide at once: the limit holds exactly

    def take(self) -> bool:
        with self._lock:
            now = self._clock()
            self._tokens = min(self._capacity, self._tokens + (now - self._last) * self._rate)
            self._last = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return True
            return False


class Tracer:
    """Starts span records, samples them, carries their context, and queues them."""

    # The C core's span paths read these once per tracer (server.configure_spans sets `settings_changed`): setting
    # one again tells it to read them anew.
    _SETTINGS = frozenset({"serving", "_queue", "_max_queue", "_fast_propagation", "_propagates", "_parent_based",
                           "_root_bound", "_limiter"})
    settings_changed: ClassVar[Callable[[], None] | None] = None

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in Tracer._SETTINGS and Tracer.settings_changed is not None:
            Tracer.settings_changed()

    def __delattr__(self, name: str) -> None:
        object.__delattr__(self, name)
        if name in Tracer._SETTINGS and Tracer.settings_changed is not None:
            Tracer.settings_changed()

    def __init__(self, config: Config, sinks: list[Any], clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._sinks = sinks
        self._queue: collections.deque = collections.deque()
        # thread id -> the SERVER span of the UDF it runs; hooks.attach puts the C core's table in its place
        self.serving: MutableMapping[int, SpanRecord] = {}
        self._max_queue = config.bsp_max_queue_size
        self._wake = threading.Event()
        self._export_lock = threading.Lock()
        self._stopping = False
        self._stuck = False
        self._fast_propagation = set(config.propagators) <= {"tracecontext", "baggage"}
        self._propagates = "none" not in config.propagators
        sampler = config.sampler
        self._parent_based = sampler.startswith("parentbased_")
        root = sampler.removeprefix("parentbased_")
        self._root_bound = {"always_on": 1 << 64, "always_off": 0}.get(root, int(config.sampler_ratio * (1 << 64)))
        # Decides roots only; with parentbased_, callees follow the caller's flag, so traces stay whole.
        self._limiter = RateLimiter(config.sampler_rate, clock) if root == "rpc_observe_ratelimit" else None
        self._thread = threading.Thread(target=self._run, name="rpc_observe-span-export", daemon=True)
        self._thread.start()

    # -- hot path ---------------------------------------------------------------
    def _should_sample(self, trace_id: int, parent_sampled: bool | None) -> bool:
        if parent_sampled is not None and self._parent_based:
            return parent_sampled
        if self._limiter is not None:
            return self._limiter.take()
        return (trace_id & _LOW_64) < self._root_bound

    def start_client(self, name: str, attributes: dict, start_ns: int, kind: int = CLIENT) -> SpanRecord:
        """A CLIENT (or `kind`) span, child of the span this thread serves, or of the current OpenTelemetry span."""
        serving = self.serving.get(_get_ident()) if self.serving else None
        if serving is not None:
            trace_id, parent_id, sampled, remote = serving.trace_id, serving.span_id, serving.sampled, False
        else:
            current = _get_current().get(_SPAN_KEY)
            parent = current.get_span_context() if current is not None else None
            if parent is not None and parent.is_valid:
                trace_id, parent_id, remote = parent.trace_id, parent.span_id, parent.is_remote
                sampled = self._should_sample(trace_id, parent.trace_flags.sampled)
            else:  # a root: `_should_sample(trace_id, None)`, inline (the caller's hot path)
                trace_id, parent_id, remote = _getrandbits(128), 0, False
                limiter = self._limiter
                sampled = (trace_id & _LOW_64) < self._root_bound if limiter is None else limiter.take()
        return SpanRecord(name, kind, trace_id, _getrandbits(64), parent_id, remote, sampled, attributes, start_ns)

    def start_internal(self, name: str, attributes: dict, start_ns: int) -> SpanRecord:
        """An INTERNAL span (dist_autograd.backward, DistributedOptimizer.step), parented like a client span."""
        return self.start_client(name, attributes, start_ns, INTERNAL)

    def context_text(self, span: SpanRecord) -> str:
        """The propagator carrier, as trailer fields, that makes `span` the parent of the callee's span."""
        if not self._propagates:
            return ""
        if self._fast_propagation and _BAGGAGE_KEY not in _get_current():
            return _TRACEPARENT_ENTRY_FORMAT % (span.trace_id, span.span_id, _FLAGS[span.sampled])
        ctx = trace.set_span_in_context(NonRecordingSpan(_span_context(span)))
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=ctx)
        return propagation.carrier_text(carrier)

    def start_server(self, name: str, attributes: dict, context: list[str] | None, start_ns: int) -> SpanRecord:
        """A SERVER span, child of the remote CLIENT span that the caller's `context` fields name.

        A missing or malformed context starts a new trace.
        """
        parent = None
        if context:
            if self._fast_propagation and len(context) == 1 and context[0][:12] == "traceparent=":
                match = _traceparent_entry(context[0])  # `propagation.parse_traceparent`, inline: the callee's hot path
                if match is not None:
                    trace_id, parent_id = int(match[1], 16), int(match[2], 16)
                    if trace_id and parent_id:
                        parent = (trace_id, parent_id, match[3] in _SAMPLED_LAST_DIGITS)
            elif self._propagates:
                sc = trace.get_current_span(propagate.extract(propagation.carrier_of(context))).get_span_context()
                parent = (sc.trace_id, sc.span_id, sc.trace_flags.sampled) if sc.is_valid else None
            if parent is None:
                health.invalid_context()
        if parent is not None:
            trace_id, parent_id, parent_sampled = parent
            sampled = parent_sampled if self._parent_based else self._should_sample(trace_id, None)
        else:
            trace_id, parent_id = _getrandbits(128), 0
            sampled = self._should_sample(trace_id, None)
        return SpanRecord(name, SERVER, trace_id, _getrandbits(64), parent_id, True, sampled, attributes, start_ns)

    def attach(self, span: SpanRecord) -> object:
        """Makes `span` the parent of what starts on this thread until `detach(token)`, which puts
        back what was there before: attach/detach nest (a `dist_autograd.backward` inside a UDF).

        With a TracerProvider set, the UDF can start spans of its own, so `span` becomes the
        current OpenTelemetry span; without one, only this add-on's client spans can be its
        children, and a per-thread entry (three dict operations) is all they need.
        """
        if trace._TRACER_PROVIDER is not None:
            return context.attach(trace.set_span_in_context(NonRecordingSpan(_span_context(span))))
        ident = _get_ident()
        serving = self.serving
        token = (ident, serving.get(ident))
        serving[ident] = span
        return token

    def detach(self, token: object) -> None:
        if type(token) is tuple:
            ident, outer = token
            if outer is None:
                self.serving.pop(ident, None)
            else:
                self.serving[ident] = outer
        else:
            context.detach(token)  # type: ignore[arg-type]

    def end(
        self, span: SpanRecord, end_ns: int, error: BaseException | str | None = None, error_type: str | None = None
    ) -> None:
        span.end_ns = end_ns
        if error is not None:
            span.error_type = error_type or type(error).__name__
            limit = self._config.max_exception_message
            span.error_message = str(error)[:limit] if limit else ""
        if not span.sampled:
            return
        if len(self._queue) >= self._max_queue:
            health.spans_lost(1, "queue_full")
            return
        self._queue.append(span)

    # -- export thread ----------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(self._config.bsp_schedule_delay_s)
            self._export_queued()

    def _export_queued(self) -> None:
        """Exports everything queued. One export at a time: a flush that finds the export thread
        writing a batch waits for it, so the sinks are never shut down under a write."""
        with self._export_lock:
            self._export_batches()

    def _export_batches(self) -> None:
        queue, size = self._queue, self._config.bsp_max_export_batch_size
        while queue:
            batch = [queue.popleft() for _ in range(min(size, len(queue)))]
            for sink in self._sinks:
                try:
                    if not sink.export(batch):
                        health.spans_lost(len(batch), "export_failed")
                except Exception:
                    health.internal_error("span_export")
                    health.spans_lost(len(batch), "export_failed")

    def flush(self, timeout_s: float | None = None) -> bool:
        """Exports what is queued; returns False if that took longer than the timeout.

        Once an export has hung (an unresponsive collector), later flushes wait 0.1 s at
        most, so rpc.shutdown() and process exit together wait about OTEL_BSP_EXPORT_TIMEOUT.
        """
        wait = self._config.bsp_export_timeout_s if timeout_s is None else timeout_s
        if self._stuck:
            wait = min(wait, 0.1)
        done = threading.Event()

        def _flush() -> None:
            try:
                self._export_queued()
            finally:
                done.set()

        threading.Thread(target=_flush, name="rpc_observe-span-flush", daemon=True).start()
        finished = done.wait(wait)
        self._stuck = self._stuck or not finished
        return finished

    def shutdown(self) -> None:
        """Flushes with a bounded wait, then shuts the exporters down; never blocks longer."""
        self._stopping = True
        self._wake.set()
        if not self.flush():
            _logger.warning(
                "rpc_observe: span export did not finish within %.1fs (OTEL_BSP_EXPORT_TIMEOUT); "
                "%d queued spans are dropped",
                self._config.bsp_export_timeout_s,
                len(self._queue),
            )
            health.spans_lost(len(self._queue), "timeout")
            self._queue.clear()
        self._thread.join(0.1 if self._stuck else self._config.bsp_export_timeout_s)
        for sink in self._sinks:
            try:
                sink.shutdown()
            except Exception:
                health.internal_error("span_exporter_shutdown")


def _span_context(span: SpanRecord) -> SpanContext:
    return SpanContext(span.trace_id, span.span_id, False, _SAMPLED if span.sampled else _NOT_SAMPLED)
