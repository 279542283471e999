"""Server side: the wrapped `internal._run_function`, which runs every Python UDF.

The C++ handler looks `_run_function` up once, in `init_rpc`, so this wrapper must be
in place before then. torch's `_run_function` turns a UDF's exception into a
`RemoteException` value; the wrapper hands torch exactly what the original returned.
The SERVER span is the current OpenTelemetry span while the UDF runs, so RPCs and user
spans inside it are its children. async_execution UDFs end when their Future does.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch.distributed.rpc.internal import RemoteException

from ..telemetry import health, tracing
from ..telemetry import runtime as _runtime
from ..telemetry.metrics import MessageCells, Record, ServerCells, fold_served
from ..telemetry.tracing import SpanRecord
from . import thread_states, trailer
from .calls import future_error, remote_error, serving, set_pending_reply
from .naming import PROXY_FUNCTIONS, is_internal, method_name, profiling_key, proxy_method, span_attributes

if TYPE_CHECKING:
    from ..telemetry.runtime import Runtime

_time_ns = time.time_ns
_native_id = threading.get_native_id
_thread_id = threading.get_ident
UNKNOWN = "unknown"
_MAX_SITES = 10_000
_SRC, _MODE, _CALL_ID, _CONTEXT = trailer.SRC, trailer.MODE, trailer.CALL_ID, trailer.CONTEXT
_PROXIES = PROXY_FUNCTIONS


class ServerSite:
    """What every run of one function for one caller and mode shares: names, attributes, metric cells."""

    __slots__ = ("key", "span_name", "method", "src", "attributes", "record", "cells", "response_cells",
                 "is_async", "replies", "replies_later")
    record: Callable[[Record], None] | None  # Metrics.record; None without metrics
    cells: ServerCells  # set only with metrics, as response_cells: read only where `record` is not None
    response_cells: MessageCells

    def __init__(self, runtime: Runtime, func: Any, src: str, mode: str, named: str | None = None) -> None:
        torch_name = method_name(func) if func is not None else UNKNOWN
        self.method = named or torch_name  # an RRef proxy call is named by the method it runs
        self.src = src
        self.is_async = hasattr(func, "_wrapped_async_rpc_function")
        self.replies = mode != "remote" and not self.is_async  # a response is pickled on this thread
        self.replies_later = mode != "remote" and self.is_async  # ... on the thread that completes its Future
        self.key = profiling_key(mode, self.method, src, runtime.worker)
        self.span_name = self.key if runtime.config.span_names == "key" else self.method
        torch_key = profiling_key(mode, torch_name, src, runtime.worker)
        self.attributes = span_attributes(self.method, src, runtime.worker, mode, torch_key, is_internal(func))
        metrics = runtime.metrics
        self.record = metrics.record if metrics is not None else None
        if metrics is not None:  # without metrics (record None) the cells are never read: left unset
            self.cells = metrics.server_cells(self.method, src)
            self.response_cells = metrics.message_cells("serialize", "response", self.method)


def _site(runtime: Runtime, key: tuple[Any, ...]) -> ServerSite:
    sites = runtime.server_sites
    site = ServerSite(runtime, *key)
    try:
        if len(sites) > _MAX_SITES:
            sites.clear()
        sites[key] = site
    except TypeError:  # an unhashable func: not cached
        pass
    return site


class Serving:
    """A UDF run that does not end the plain way: async_execution, failed, or seen by a profiler."""

    __slots__ = ("runtime", "site", "start_ns", "span", "tid")

    def __init__(self, runtime: Runtime, site: ServerSite, start_ns: int, span: Any, tid: int) -> None:
        self.runtime, self.site, self.start_ns, self.span, self.tid = runtime, site, start_ns, span, tid

    def finish(self, error_type: str | None, message: str | None) -> None:
        """The reference ending of a UDF run; `_run_function` inlines its plain, successful form."""
        end_ns = _time_ns()
        runtime, site = self.runtime, self.site
        if site.record is not None:
            site.record((fold_served, site.cells, (end_ns - self.start_ns) / 1e9, self.span))
            if error_type is not None:
                runtime.metrics.count_error(  # type: ignore[union-attr]  # a record implies metrics
                    "server", site.method, site.src, error_type)
        if self.span is not None:
            runtime.tracer.end(self.span, end_ns, message, error_type)  # type: ignore[union-attr]  # span: tracer
        profiler = runtime.profiler
        if profiler is not None and profiler.armed:
            profiler.record(site.key, "server", self.start_ns, end_ns, self.tid, self.span)

    def on_done(self, future: Any) -> None:
        error = future_error(future)
        try:
            if error is None and self.site.replies_later:
                # torch pickles the value in a callback it adds after this one, on this thread: name its response.
                set_pending_reply(self.site, "", 0.0)
            self.finish(type(error).__name__ if error is not None else None,
                        str(error) if error is not None else None)
        except Exception:
            health.internal_error("server_done")


def _site_of(runtime: Runtime, python_udf: Any, fields: list[str] | None) -> ServerSite:
    """The site of a run: (func, the caller, its mode), and for an RRef proxy call the method it runs."""
    func = getattr(python_udf, "func", None)  # None: the UDF could not be unpickled
    key: tuple[Any, ...] = (func, fields[_SRC], fields[_MODE]) if fields is not None else (func, UNKNOWN, UNKNOWN)
    try:
        if func in _PROXIES:  # an RRef proxy call: a site per method it runs
            key += (proxy_method(python_udf.args, local=True),)
        return runtime.server_sites.get(key) or _site(runtime, key)
    except TypeError:  # an unhashable func
        return _site(runtime, key)


def _end_other(runtime: Runtime, site: ServerSite, start_ns: int, span: Any, profiled: bool, result: Any,
               fields: list[str] | None, request_start: float) -> None:
    """The end of a run that is not plain (async_execution, failed, or seen by a profiler): the C Hook's way out."""
    tid = _native_id() if profiled else 0
    if site.is_async and hasattr(result, "add_done_callback"):
        result.add_done_callback(Serving(runtime, site, start_ns, span, tid).on_done)
        return
    error = remote_error(result)
    Serving(runtime, site, start_ns, span, tid).finish(*(error or (None, None)))
    if site.replies:
        if fields is not None:
            set_pending_reply(site, fields[_CALL_ID], request_start)
        else:
            set_pending_reply(site, "", 0.0)


_core = trailer.core  # the C Hook where built (hooks/_core.c); `_run_function` below is its reference
if _core is not None:
    _core.configure_run(serving, _PROXIES, _site_of, _end_other, fold_served, UNKNOWN)


def configure_spans(getrandbits: Callable[[int], int] | None = None) -> None:
    """Hands the C core's inline span starts (the SERVER span here, the CLIENT span in `_invoke_rpc`; references:
    tracing.Tracer's methods) what they read of tracing.py, and their id source: None, the core's own draw (no call
    into `random` per id; reseeded in a forked child, as `random` is), or a test's."""
    if _core is not None:
        _core.configure_spans(SpanRecord, getrandbits, tracing.trace, tracing._get_current, tracing._SPAN_KEY,
                              tracing._BAGGAGE_KEY, tracing._TRACEPARENT_ENTRY_FORMAT, tracing._FLAGS)
        tracing.Tracer.settings_changed = _core.tracer_settings_changed


configure_spans()


def wrap_run_function(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Wraps `internal._run_function(python_udf)` (with the C core's `Hook` where built)."""
    if _core is not None:
        return _core.Hook(original, _core.RUN_FUNCTION)

    def _run_function(python_udf: Any) -> Any:
        runtime = _runtime.current
        if runtime is None:
            return original(python_udf)
        if not thread_states.enabled:
            return _serve(runtime, python_udf)
        thread_states.keep()  # and the UDF in an empty context, as on a new thread state
        return contextvars.Context().run(_serve, runtime, python_udf)

    def _serve(runtime: Runtime, python_udf: Any) -> Any:
        # Inline on purpose: this runs on the agent's pool threads, where each function
        # touched costs microseconds of cache misses (see `pickler.wrap_deserialize`).
        try:
            fields = getattr(python_udf, "rpc_observe_fields", None)  # the caller's trailer, set by the pickler
            site = _site_of(runtime, python_udf, fields)
            start_ns = _time_ns()
            tracer = runtime.tracer
            span = token = None
            if tracer is not None:
                context = fields[_CONTEXT:] if fields is not None else None
                span = tracer.start_server(site.span_name, site.attributes, context, start_ns)
                token = tracer.attach(span)
            profiler = runtime.profiler
            tid = _native_id() if profiler is not None and profiler.armed else 0
            thread = _thread_id()
            outer = serving.get(thread)  # a UDF that runs another in-process: restored after
            serving[thread] = (site, fields[_CALL_ID] if fields is not None else "", start_ns,
                               span.trace_id if span is not None else 0)
        except Exception:
            health.internal_error("server_start")
            return original(python_udf)
        try:
            result = original(python_udf)
        finally:
            try:
                if outer is None:
                    serving.pop(thread, None)
                else:
                    serving[thread] = outer
                if token is not None:
                    tracer.detach(token)  # type: ignore[union-attr]  # a token implies a tracer
            except Exception:
                health.internal_error("server_detach")
        try:
            if (site.is_async and hasattr(result, "add_done_callback")) or type(result) is RemoteException or tid:
                _end_other(runtime, site, start_ns, span, bool(tid), result, fields,
                           getattr(python_udf, "rpc_observe_start", 0.0))
                return result
            # Serving.finish, inline, for a plain successful run (tests/unit/test_endings.py)
            end_ns = _time_ns()
            if site.record is not None:
                site.record((fold_served, site.cells, (end_ns - start_ns) / 1e9, span))
            if span is not None:
                tracer.end(span, end_ns)  # type: ignore[union-attr]  # a span implies a tracer
            if site.replies:
                if fields is not None:
                    set_pending_reply(site, fields[_CALL_ID], getattr(python_udf, "rpc_observe_start", 0.0))
                else:
                    set_pending_reply(site, "", 0.0)
        except Exception:
            health.internal_error("server_end")
        return result

    return _run_function
