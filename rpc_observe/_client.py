"""Client side: `rpc_sync`, `rpc_async`, `remote` and the RRef proxies built on them.

`rpc_sync` and `rpc_async` both go through `api._invoke_rpc`, so that is what is
wrapped; `rpc_async` itself stays torch's object, because `rref_proxy._invoke_rpc`
tells async proxies apart by identity (`rpc_api is not rpc_async`). `remote` is
wrapped in `api` and in its `torch.distributed.rpc` re-export before `init_rpc`, when
the C++ handler looks it up for the RRef proxies.

Where a call ends: a call of a Python function gets an id in its request trailer, the
callee echoes it in the response's, and the call ends where the caller unpickles that
response, on the agent thread that holds the GIL for it anyway. A done-callback would
take the GIL once more per call, on a pool thread with a fresh thread state, while the
caller wakes up and wants it too. Calls that get no such response (builtins,
TorchScript, async_execution functions, `remote`, and peers without rpc_observe) end
in a done-callback; a call whose request went out but that failed without a response
(a timeout, a lost peer) is ended by `sweep`, from the housekeeping thread or a scrape.
"""

from __future__ import annotations

import itertools
import threading
import time

import torch
from torch.autograd import _profiler_enabled
from torch.distributed.rpc.internal import RemoteException

from . import _health, _runtime, propagation
from .metrics import fold_finished, fold_started

local = threading.local()  # .call: the client call being serialized on this thread
# Calls that end when their response is unpickled, by call id.
in_flight: dict[int, "Call"] = {}
next_id = itertools.count(1).__next__
_sweep_lock = threading.Lock()
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

    __slots__ = ("key", "span_name", "method", "mode", "dst", "attributes", "record", "cells", "started",
                 "request_cells", "response_cells", "trailer_head", "echoed")

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
        # Only a Python function's response goes through the pickler, and only a plain
        # one's is pickled on the thread that ran it, where the callee can echo the id.
        self.echoed = (mode != "remote" and not hasattr(func, "_wrapped_async_rpc_function")
                       and torch.jit._builtins._find_builtin(func) is None
                       and not isinstance(func, torch.jit.ScriptFunction))
        metrics = runtime.metrics
        self.record = metrics.record if metrics else None
        self.cells = metrics.client_cells(self.method, mode, dst) if metrics else None
        self.started = (fold_started, self.cells) if metrics else None
        self.request_cells = metrics.message_cells("serialize", "request", self.method) if metrics else None
        self.response_cells = metrics.message_cells("deserialize", "response", self.method) if metrics else None


class Call:
    """One client call in flight."""

    __slots__ = ("runtime", "site", "start_ns", "span", "rf", "tid", "id", "future")

    def __init__(self, runtime, site: ClientSite):
        self.runtime, self.site = runtime, site
        self.start_ns = _time_ns()
        self.id = 0
        self.future = None
        tracer, profiler = runtime.tracer, runtime.profiler
        self.span = tracer.start_client(site.span_name, site.attributes, self.start_ns) if tracer else None
        if profiler is not None:
            self.rf = profiler.client_start(site.key) if _profiler_enabled() else None
            self.tid = _native_id() if profiler.armed else 0
        else:
            self.rf = None
        if site.record is not None:
            site.record(site.started)

    def finish(self, end_ns: int | None = None, error: tuple[str, str] | None = None) -> None:
        """Ends the call at `end_ns` (now if None); `error` is its (error.type, message)."""
        end_ns = _time_ns() if end_ns is None else end_ns
        runtime, site = self.runtime, self.site
        if site.record is not None:
            site.record((fold_finished, site.cells, (end_ns - self.start_ns) / 1e9))
            if error is not None:
                runtime.metrics.count_error("client", site.method, site.dst, error[0])
        if self.span is not None:
            if error is None:
                runtime.tracer.end(self.span, end_ns)
            else:
                runtime.tracer.end(self.span, end_ns, error[1], error[0])
        profiler = runtime.profiler
        if profiler is not None and self.rf is None and profiler.armed:
            profiler.record(site.key, "client", self.start_ns, end_ns, self.tid, self.span)

    def fail(self, error: BaseException | None) -> None:
        self.finish(None, (classify(error), str(error)) if error is not None else None)

    def on_done(self, future) -> None:
        try:
            self.fail(future_error(future))
        except Exception:
            _health.internal_error("client_done")


def remote_error(obj) -> tuple[str, str] | None:
    """(error.type, message) of a response that is a UDF's exception (torch raises it on the caller)."""
    return (obj.exception_type.__name__, obj.msg) if type(obj) is RemoteException else None


def sweep() -> None:
    """Ends the calls that completed without an echoed response: failed ones, and replies of peers
    without rpc_observe (their call sites stop waiting for an echo).

    One sweep at a time, so that a scrape that sweeps first also sees what a concurrent
    sweep (the housekeeping thread's) has taken out of `in_flight` but not yet recorded.
    """
    with _sweep_lock:
        for call_id, call in list(in_flight.items()):
            future = call.future
            if future is None or not future.done() or in_flight.pop(call_id, None) is None:
                continue
            error = future_error(future)
            if error is None:
                call.site.echoed = False
            try:
                call.fail(error)
            except Exception:
                _health.internal_error("client_sweep")


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
    """Ends the call when `future` completes (unless its response ends it); returns the future the caller waits on.

    With a profiler event open, that is the future torch's own profiling path returns
    (`_call_end_callbacks_on_future`): same value or exception, completed only after the
    event is closed, so a profiler stopped right after wait() never races the pool thread
    that closes it.
    """
    try:
        if call.id:
            call.future = future
        else:
            future.add_done_callback(call.on_done)
        if call.rf is not None:
            return call.runtime.profiler.client_end_on(call.rf, future)
    except Exception:
        _health.internal_error("client_watch")
    return future


def _end_inline(call: Call, error: BaseException) -> None:
    """Ends a call that raised before it had a future."""
    try:
        if call.id:
            in_flight.pop(call.id, None)
        if call.rf is not None:
            call.runtime.profiler.client_end(call.rf)
        call.fail(error)
    except Exception:
        _health.internal_error("client_end")


def wrap_invoke_rpc(original):
    """Wraps `api._invoke_rpc(to, func, rpc_type, ...)`, behind rpc_sync and rpc_async."""

    def _invoke_rpc(to, func, rpc_type, *args, **kwargs):
        runtime = _runtime.current
        call = None
        if runtime is not None:
            mode = rpc_type._value_  # not .value: a descriptor, a Python call
            try:  # a known site by name, inline; _begin for the rest
                site = runtime.client_sites.get((func, mode, to)) if type(to) is str else None
                call = Call(runtime, site) if site is not None else _begin(runtime, to, func, mode)
            except Exception:
                _health.internal_error("client_start")
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
        if call.id and call.rf is None:  # its echoed response ends it
            call.future = future
            return future
        return _watch(call, future)

    return _invoke_rpc


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
