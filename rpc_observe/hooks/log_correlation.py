"""Trace ids in `logging` records: the ids of the span a record was made in, under the attribute
names of OpenTelemetry's logging instrumentation (`otelTraceID`, `otelSpanID`, `otelServiceName`,
`otelTraceSampled`), so a format string such as `%(otelTraceID)s` or a JSON handler prints them.

A record made inside a UDF carries its SERVER span; a record made by a thread while a call it
issued is in flight carries that CLIENT span (the newest one); otherwise the current
OpenTelemetry span, if any. Outside any call the values are empty strings (and False), so a
format string never raises. The lookup runs when a record is made, never per RPC: it reads the
tables the hooks keep anyway (`calls.in_flight`, `Tracer.serving`). On with RPC_OBSERVE=1;
OTEL_PYTHON_LOG_CORRELATION=false turns it off.

Installed when instrumentation starts (at interpreter start with RPC_OBSERVE=1), so records made
before init_rpc have the attributes too; it imports neither torch nor OpenTelemetry: it reads
their modules only once the job has imported them.
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

from ..telemetry import health
from ..telemetry import runtime as _runtime

# The newest in-flight calls looked at for a record: a thread waits on few calls at a time, and
# the scan must stay cheap with thousands in flight.
NEWEST_CALLS_SCANNED = 64
_EMPTY = ("", "", "", False)
_CALLS = __package__ + ".calls"  # the hooks' call table, once torch and the hooks are loaded
_reporting = threading.local()
_installed: Callable[..., logging.LogRecord] | None = None  # our factory, while it is logging's


def current_ids() -> tuple[str, str, str, bool]:
    """(trace id, span id, service name, sampled) of the span this thread is in, or empties."""
    runtime = _runtime.current
    ident = threading.get_ident()
    span = None
    calls = sys.modules.get(_CALLS)
    if runtime is not None and runtime.tracer is not None and calls is not None:
        try:  # the newest call this thread issued that has not completed
            for call in itertools.islice(reversed(calls.in_flight.values()), NEWEST_CALLS_SCANNED):
                future = call.future
                if call.thread == ident and call.span is not None and (future is None or not future.done()):
                    span = call.span
                    break
        except RuntimeError:  # the table changed under the scan: another thread started or ended a call
            span = None
        if span is None:
            span = runtime.tracer.serving.get(ident)  # the UDF this thread serves (no TracerProvider)
    if span is not None:
        trace_id, span_id, sampled = span.trace_id, span.span_id, span.sampled
    else:
        trace = sys.modules.get("opentelemetry.trace")
        if trace is None:
            return _EMPTY
        context = trace.get_current_span().get_span_context()  # a TracerProvider's span, ours or the user's
        if not context.is_valid:
            return _EMPTY
        trace_id, span_id, sampled = context.trace_id, context.span_id, context.trace_flags.sampled
    service = (runtime.config.service_name or runtime.worker) if runtime is not None else ""
    return format(trace_id, "032x"), format(span_id, "016x"), service, bool(sampled)


def _wrap(original: Callable[..., logging.LogRecord]) -> Callable[..., logging.LogRecord]:
    def record_factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = original(*args, **kwargs)
        try:
            ids = current_ids()
        except Exception:
            ids = _EMPTY
            if not getattr(_reporting, "active", False):  # the warning's own record fails too: count once
                _reporting.active = True
                try:
                    health.internal_error("log_correlation")
                finally:
                    _reporting.active = False
        record.otelTraceID, record.otelSpanID, record.otelServiceName, record.otelTraceSampled = ids
        return record

    record_factory.__rpc_observe_original__ = original  # type: ignore[attr-defined]
    return record_factory


def install() -> None:
    """Makes logging's record factory add the ids; idempotent."""
    global _installed
    if _installed is None or logging.getLogRecordFactory() is not _installed:
        _installed = _wrap(logging.getLogRecordFactory())
        logging.setLogRecordFactory(_installed)


def uninstall() -> None:
    """Puts back the factory we wrapped, unless someone has replaced ours since (then theirs stays)."""
    global _installed
    if _installed is not None and logging.getLogRecordFactory() is _installed:
        logging.setLogRecordFactory(_installed.__rpc_observe_original__)  # type: ignore[attr-defined]
    _installed = None
