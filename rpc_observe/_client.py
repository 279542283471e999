"""Client side: `rpc_sync`, `rpc_async`, `remote` and the RRef proxies built on them.

`rpc_sync` and `rpc_async` both go through `api._invoke_rpc`, so that is what is
wrapped (plus `rpc_sync`, to end sync calls inline); `rpc_async` itself stays torch's
object, because `rref_proxy._invoke_rpc` tells async proxies apart by identity
(`rpc_api is not rpc_async`). `remote` is
wrapped in `api` and in its `torch.distributed.rpc` re-export before `init_rpc`, when
the C++ handler looks it up for the RRef proxies.
A call's span, profiler event and metrics end when its future completes.
"""

from __future__ import annotations

import threading
import time

from . import _health, _runtime, propagation

local = threading.local()  # .call: the client call being serialized on this thread
# Method of the UDF whose response is pickled next on a thread, keyed by thread id: torch's
# pool threads get a fresh Python thread state (and empty threading.local) every time they
# take the GIL, between running a UDF and pickling its response.
pending_replies: dict[int, str] = {}
_time_ns = time.time_ns
_native_id = threading.get_native_id


_method_names: dict = {}


def method_name(func) -> str:
    """The name torch puts in the profiling key (cached: the callee asks for every request)."""
    try:
        return _method_names[func]
    except (KeyError, TypeError):
        pass
    name = _method_name(func)
    try:
        if len(_method_names) > 10_000:
            _method_names.clear()
        _method_names[func] = name
    except TypeError:  # an unhashable callable
        pass
    return name


def _method_name(func) -> str:
    """Builtin, TorchScript or Python qualname, as torch's `_enable_rpc_profiler` picks it."""
    import torch

    builtin = torch.jit._builtins._find_builtin(func)
    if builtin is not None:
        return builtin
    if isinstance(func, torch.jit.ScriptFunction):
        return torch._jit_internal._qualified_name(func)
    return getattr(func, "__qualname__", None) or type(func).__qualname__


def is_internal(func) -> bool:
    """torch's own RPCs (init_rpc's all-gather, shutdown, RRef type queries)."""
    return (getattr(func, "__module__", None) or "").startswith("torch.distributed")


def profiling_key(mode: str, method: str, src: str, dst: str) -> str:
    """torch's key, as `internal._build_rpc_profiling_key` builds it."""
    return f"rpc_{mode}#{method}({src} -> {dst})"


class ClientSite:
    """What every call of one function, mode and destination shares: names, attributes, metric cells."""

    __slots__ = ("key", "span_name", "method", "mode", "dst", "attributes", "cells", "request_cells", "trailer_head")

    def __init__(self, runtime, func, mode: str, dst: str):
        self.method = method_name(func)
        self.mode, self.dst = mode, dst
        self.key = profiling_key(mode, self.method, runtime.worker, dst)
        self.span_name = self.key if runtime.config.span_names == "key" else self.method
        self.attributes = {
            "rpc.system": "torch_rpc", "rpc.system.name": "torch_rpc", "rpc.method": self.method,
            "torch.rpc.src": runtime.worker, "torch.rpc.dst": dst, "torch.rpc.exec_mode": mode,
            "torch.rpc.profiling_key": self.key, "torch.rpc.internal": is_internal(func),
        }
        self.trailer_head = propagation.request_head(runtime.worker, mode)
        metrics = runtime.metrics
        self.cells = metrics.client_cells(self.method, mode, dst) if metrics else None
        self.request_cells = metrics.message_cells("serialize", "request", self.method) if metrics else None


class Call:
    """One client call in flight."""

    __slots__ = ("runtime", "site", "start_ns", "span", "rf", "tid")

    def __init__(self, runtime, site: ClientSite):
        self.runtime, self.site = runtime, site
        self.start_ns = _time_ns()
        self.tid = _native_id()
        tracer, profiler, metrics = runtime.tracer, runtime.profiler, runtime.metrics
        self.span = tracer.start_client(site.span_name, site.attributes, self.start_ns) if tracer else None
        self.rf = profiler.client_start(site.key) if profiler else None
        if metrics is not None:
            metrics.client_started(site.cells)

    def request_trailer(self) -> bytes:
        runtime, span = self.runtime, self.span
        carrier = runtime.tracer.carrier(span) if span is not None else {}
        return propagation.request_trailer(runtime.worker, self.site.mode, carrier, self.site.trailer_head)

    def finish(self, error: BaseException | None) -> None:
        end_ns = _time_ns()
        runtime, site = self.runtime, self.site
        error_type = classify(error) if error is not None else None
        metrics = runtime.metrics
        if metrics is not None:
            metrics.client_finished(site.cells, (end_ns - self.start_ns) / 1e9)
            if error_type is not None:
                metrics.count_error("client", site.method, site.dst, error_type)
        if self.span is not None:
            runtime.tracer.end(self.span, end_ns, error, error_type)
        profiler = runtime.profiler
        if profiler is not None and self.rf is None and profiler.armed:
            profiler.record(site.key, "client", self.start_ns, end_ns, self.tid, self.span)

    def on_done(self, future) -> None:
        try:
            self.finish(future_error(future))
        except Exception:
            _health.internal_error("client_done")


def future_error(future) -> BaseException | None:
    """The exception a completed torch Future holds (already on its way to the caller), or None."""
    try:
        future.value()
    except BaseException as e:
        return e
    return None


def classify(error: BaseException) -> str:
    """The error.type of a failed call: the exception class, or timeout / connection_error."""
    name = type(error).__name__
    if name == "RuntimeError":
        text = str(error)[:512].lower()
        if "timeout" in text or "timed out" in text:
            return "timeout"
        if "connection" in text or "pipe" in text or "eof" in text or "shut down" in text:
            return "connection_error"
    return name


def _begin(runtime, to, func, mode: str) -> Call | None:
    try:
        try:
            dst = to if type(to) is str else _worker_name(to)
        except Exception:  # an invalid destination: torch raises it to the caller, we count the failure
            dst = "unknown"
        sites = runtime.client_sites
        site = sites.get((func, mode, dst))
        if site is None:
            if len(sites) > 10_000:
                sites.clear()
            site = sites[(func, mode, dst)] = ClientSite(runtime, func, mode, dst)
        return Call(runtime, site)
    except Exception:
        _health.internal_error("client_start")
        return None


def _worker_name(to) -> str:
    """The name of a WorkerInfo or rank (RRef proxies pass `rref.owner()`, a WorkerInfo)."""
    name = getattr(to, "name", None)
    if isinstance(name, str):
        return name
    from torch.distributed.rpc import api

    return api._to_worker_info(to).name


def _watch(call: Call, future):
    """Ends the call when `future` completes; returns the future the caller should wait on.

    With a profiler event open, that is the future torch's own profiling path returns
    (`_call_end_callbacks_on_future`): same value or exception, completed only after the
    event is closed, so a profiler stopped right after wait() never races the pool thread
    that closes it.
    """
    try:
        future.add_done_callback(call.on_done)
        if call.rf is not None:
            return call.runtime.profiler.client_end_on(call.rf, future)
    except Exception:
        _health.internal_error("client_watch")
    return future


def _end_inline(call: Call, error: BaseException | None) -> None:
    """Ends a call on the caller's thread: it failed before a future, or rpc_sync's wait() returned."""
    try:
        if call.rf is not None:
            call.runtime.profiler.client_end(call.rf)
        call.finish(error)
    except Exception:
        _health.internal_error("client_end")


def wrap_invoke_rpc(original):
    """Wraps `api._invoke_rpc(to, func, rpc_type, ...)`, behind rpc_sync and rpc_async."""

    def _invoke_rpc(to, func, rpc_type, *args, **kwargs):
        runtime = _runtime.current
        call = _begin(runtime, to, func, rpc_type.value) if runtime is not None else None
        if call is None:
            return original(to, func, rpc_type, *args, **kwargs)
        outer = getattr(local, "call", None)
        local.call = call
        try:
            future = original(to, func, rpc_type, *args, **kwargs)
        except BaseException as e:
            local.call = outer
            _end_inline(call, e)
            raise
        local.call = outer
        if getattr(local, "sync_waiting", False) and call.site.mode == "sync":
            local.sync_call = call  # the rpc_sync wrapper ends it after wait(), on this thread
            return future
        return _watch(call, future)

    return _invoke_rpc


def wrap_rpc_sync(original):
    """Wraps `api.rpc_sync`: ends the call inline once wait() returns.

    A done-callback would run on the agent's pool thread, which must take the GIL (with a
    fresh thread state) once more per call while the caller wakes up and wants it too;
    ending the call here saves that hand-off on the commonest call of all.
    """

    def rpc_sync(*args, **kwargs):
        if _runtime.current is None:
            return original(*args, **kwargs)
        outer = getattr(local, "sync_waiting", False), getattr(local, "sync_call", None)
        local.sync_waiting, local.sync_call = True, None
        try:
            value = original(*args, **kwargs)
        except BaseException as e:
            call = local.sync_call
            local.sync_waiting, local.sync_call = outer
            if call is not None:
                _end_inline(call, e)
            raise
        call = local.sync_call
        local.sync_waiting, local.sync_call = outer
        if call is not None:
            _end_inline(call, None)
        return value

    return rpc_sync


def wrap_remote(original):
    """Wraps `api.remote(to, func, ...)`; the call ends when the owner confirms the RRef."""

    def remote(to, func, *args, **kwargs):
        runtime = _runtime.current
        call = _begin(runtime, to, func, "remote") if runtime is not None else None
        if call is None:
            return original(to, func, *args, **kwargs)
        outer = getattr(local, "call", None)
        local.call = call
        try:
            rref = original(to, func, *args, **kwargs)
        except BaseException as e:
            local.call = outer
            _end_inline(call, e)
            raise
        local.call = outer
        try:
            future = rref._get_future()
        except Exception:
            _health.internal_error("client_watch")
            return rref
        profiled = _watch(call, future)
        if profiled is not future:
            try:
                rref._set_profiling_future(profiled)  # as torch does under its legacy profiler
            except Exception:
                _health.internal_error("client_watch")
        return rref

    return remote
