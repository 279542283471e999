"""Server side: the wrapped `internal._run_function`, which runs every Python UDF.

The C++ handler looks `_run_function` up once, in `init_rpc`, so this wrapper must be
in place before then. torch's `_run_function` turns a UDF's exception into a
`RemoteException` value; the wrapper hands torch exactly what the original returned.
The SERVER span is the current OpenTelemetry span while the UDF runs, so RPCs and user
spans inside it are its children. async_execution UDFs end when their Future does.
"""

from __future__ import annotations

import threading
import time

from . import _client, _health, _runtime

_time_ns = time.time_ns
_native_id = threading.get_native_id
_thread_id = threading.get_ident
UNKNOWN = "unknown"
# The site and caller's call id of the UDF whose response is pickled next on a thread, by
# thread id: torch's pool threads get a fresh Python thread state (and empty
# threading.local) every time they take the GIL, between running a UDF and pickling its response.
pending_replies: dict[int, tuple] = {}


class ServerSite:
    __slots__ = ("key", "span_name", "method", "src", "attributes", "duration", "response_cells", "is_async",
                 "replies")

    def __init__(self, runtime, func, src: str, mode: str):
        self.method = _client.method_name(func) if func is not None else UNKNOWN
        self.src = src
        self.is_async = hasattr(func, "_wrapped_async_rpc_function")
        self.replies = mode != "remote" and not self.is_async  # a response is pickled on this thread
        self.key = _client.profiling_key(mode, self.method, src, runtime.worker)
        self.span_name = self.key if runtime.config.span_names == "key" else self.method
        self.attributes = {
            "rpc.system": "torch_rpc", "rpc.system.name": "torch_rpc", "rpc.method": self.method,
            "torch.rpc.src": src, "torch.rpc.dst": runtime.worker, "torch.rpc.exec_mode": mode,
            "torch.rpc.profiling_key": self.key, "torch.rpc.internal": _client.is_internal(func),
        }
        metrics = runtime.metrics
        self.duration = metrics.server_cell(self.method, src) if metrics else None
        self.response_cells = metrics.message_cells("serialize", "response", self.method) if metrics else None


class Serving:
    """One UDF being run."""

    __slots__ = ("runtime", "site", "start_ns", "span", "token", "tid", "call_id")

    def __init__(self, runtime, python_udf):
        fields = getattr(python_udf, "rpc_observe_fields", None)
        src, mode, self.call_id = (fields[1], fields[2], fields[3]) if fields else (UNKNOWN, UNKNOWN, "")
        func = None if isinstance(python_udf, BaseException) else python_udf.func
        sites = runtime.server_sites
        site = sites.get((func, src, mode))
        if site is None:
            if len(sites) > 10_000:
                sites.clear()
            site = sites[(func, src, mode)] = ServerSite(runtime, func, src, mode)
        self.runtime, self.site = runtime, site
        self.start_ns = _time_ns()
        profiler = runtime.profiler
        self.tid = _native_id() if profiler is not None and profiler.armed else 0
        tracer = runtime.tracer
        self.span = self.token = None
        if tracer is not None:
            self.span = tracer.start_server(site.span_name, site.attributes, fields, self.start_ns)
            self.token = tracer.attach(self.span)

    def leave(self) -> None:
        if self.token is not None:
            self.runtime.tracer.detach(self.token)

    def finish(self, error_type: str | None, message: str | None) -> None:
        end_ns = _time_ns()
        runtime, site = self.runtime, self.site
        metrics = runtime.metrics
        if metrics is not None:
            metrics.served(site.duration, (end_ns - self.start_ns) / 1e9)
            if error_type is not None:
                metrics.count_error("server", site.method, site.src, error_type)
        if self.span is not None:
            runtime.tracer.end(self.span, end_ns, message, error_type)
        profiler = runtime.profiler
        if profiler is not None and profiler.armed:
            profiler.record(site.key, "server", self.start_ns, end_ns, self.tid, self.span)

    def on_done(self, future) -> None:
        error = _client.future_error(future)
        try:
            self.finish(type(error).__name__ if error is not None else None,
                        str(error) if error is not None else None)
        except Exception:
            _health.internal_error("server_done")

    def returned(self, result) -> None:
        if self.site.is_async and hasattr(result, "add_done_callback"):
            result.add_done_callback(self.on_done)
            return
        exception_type = getattr(result, "exception_type", None)
        if exception_type is not None and type(result).__name__ == "RemoteException":
            self.finish(exception_type.__name__, result.msg)
        else:
            self.finish(None, None)
        if self.site.replies:
            pending_replies[_thread_id()] = (self.site, self.call_id)


def wrap_run_function(original):
    """Wraps `internal._run_function(python_udf)`."""

    def _run_function(python_udf):
        runtime = _runtime.current
        serving = None
        if runtime is not None:
            try:
                serving = Serving(runtime, python_udf)
            except Exception:
                _health.internal_error("server_start")
        if serving is None:
            return original(python_udf)
        try:
            result = original(python_udf)
        finally:
            try:
                serving.leave()
            except Exception:
                _health.internal_error("server_detach")
        try:
            serving.returned(result)
        except Exception:
            _health.internal_error("server_end")
        return result

    return _run_function
