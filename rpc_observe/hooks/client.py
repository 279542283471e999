"""Client side: `rpc_sync`, `rpc_async`, `remote` and the RRef proxies built on them.

`rpc_sync` and `rpc_async` both go through `api._invoke_rpc`, so that is what is
wrapped; `rpc_async` itself stays torch's object, because `rref_proxy._invoke_rpc`
tells async proxies apart by identity (`rpc_api is not rpc_async`). `remote` is
wrapped in `api` and in its `torch.distributed.rpc` re-export before `init_rpc`, when
the C++ handler looks it up for the RRef proxies. How a call ends is `calls`' business.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd import _profiler_enabled
from torch.distributed.rpc.api import RPCExecMode

from ..telemetry import health
from ..telemetry import runtime as _runtime
from ..telemetry.metrics import Cell, ClientCells, MessageCells, Record, StartedRecord, fold_started
from . import trailer
from .calls import MAX_IN_FLIGHT, Call, current_call, end_raised, future_error, in_flight, next_id, set_current_call
from .naming import helper_target, is_internal, is_proxy, method_name, profiling_key, proxy_method, span_attributes

if TYPE_CHECKING:
    from ..telemetry.runtime import Runtime

_MAX_SITES = 10_000
_SYNC = RPCExecMode.SYNC


class ClientSite:
    """What every call of one function, mode and destination shares: names, attributes, metric cells."""

    __slots__ = ("key", "span_name", "method", "mode", "dst", "attributes", "record", "cells", "started",
                 "request_cells", "response_cells", "received", "trailer_head", "echoed", "swept")
    record: Callable[[Record], None] | None  # Metrics.record; None without metrics
    # Set only with metrics: read only where `record` is not None.
    cells: ClientCells
    started: StartedRecord
    request_cells: MessageCells
    response_cells: MessageCells
    received: Cell

    def __init__(self, runtime: Runtime, func: Any, mode: str, dst: str, named: str | None = None,
                 target: str | None = None) -> None:
        torch_name = method_name(func)
        self.method = named or torch_name  # an RRef proxy call is named by the method it runs
        self.mode, self.dst = mode, dst
        self.key = profiling_key(mode, self.method, runtime.worker, dst)
        self.span_name = self.key if runtime.config.span_names == "key" else self.method
        torch_key = profiling_key(mode, torch_name, runtime.worker, dst)
        self.attributes = span_attributes(self.method, runtime.worker, dst, mode, torch_key, is_internal(func))
        if target is not None:
            self.attributes["torch.rpc.target"] = target
        self.trailer_head = trailer.request_head(runtime.worker, mode)
        # Only a Python function's response goes through the pickler, and only a plain
        # one's is pickled on the thread that ran it, where the callee can echo the id.
        torch_only = torch.jit._builtins._find_builtin(func) is not None or isinstance(func, torch.jit.ScriptFunction)
        self.echoed = mode != "remote" and not hasattr(func, "_wrapped_async_rpc_function") and not torch_only
        # torch completes these futures without Python (a remote() confirmation, a builtin's or TorchScript
        # function's reply). A Python callback on one is freed by the pool thread that completes it, which must
        # then take the GIL: while the interpreter finalizes, CPython 3.11 ends that thread with pthread_exit,
        # and in torch's C++ frames that is std::terminate. So these calls take no callback: the sweep ends
        # them, and an rpc_sync ends where its wait returns.
        self.swept = mode == "remote" or torch_only
        metrics = runtime.metrics
        self.record = metrics.record if metrics is not None else None
        if metrics is not None:  # without metrics (record None) the cells are never read: left unset
            self.cells = metrics.client_cells(self.method, mode, dst)
            self.started = (fold_started, self.cells)
            self.request_cells = metrics.message_cells("serialize", "request", self.method)
            self.response_cells = metrics.message_cells("deserialize", "response", self.method)
            self.received = self.cells.received_bytes  # response bytes from dst


def _begin(runtime: Runtime, to: Any, func: Any, mode: str, udf_args: Any = None) -> Call | None:
    try:
        try:
            dst = to if type(to) is str else _worker_name(to)
        except Exception:  # an invalid destination: torch raises it to the caller, we count the failure
            dst = "unknown"
        named = target = None
        if is_proxy(func):
            named = proxy_method(udf_args, local=False)
        elif udf_args:
            target = helper_target(udf_args)
        # Sites that the arguments name are never cached by (func, mode, dst), the inline lookup's key.
        key = (func, mode, dst) if named is None and target is None else (func, mode, dst, named, target)
        sites = runtime.client_sites
        try:
            site = sites.get(key)
        except TypeError:  # an unhashable func: a site of its own, not cached
            return Call(runtime, ClientSite(runtime, func, mode, dst))
        if site is None:
            if len(sites) > _MAX_SITES:
                sites.clear()
            site = sites[key] = ClientSite(runtime, func, mode, dst, named, target)
        return Call(runtime, site)
    except Exception:
        health.internal_error("client_start")
        return None


def _worker_name(to: Any) -> str:
    """The name of a WorkerInfo or rank (RRef proxies pass `rref.owner()`, a WorkerInfo)."""
    name = getattr(to, "name", None)
    if isinstance(name, str):
        return name
    from torch.distributed.rpc import api

    return api._to_worker_info(to).name


def _watch(call: Call, future: Any) -> Any:
    """Ends the call when `future` completes (unless its response ends it); returns the future the caller waits on.

    With a profiler event open, the event is closed before the caller's wait returns, so a profiler stopped
    right after wait() never races a pool thread that closes it: rpc_sync's by this thread, which waits here
    (its next step anyway), any other's by torch's own profiling path (`_call_end_callbacks_on_future`), whose
    future completes, with the same value or exception, once the event is closed.
    """
    try:
        if call.id:
            call.future = future
        else:  # in the table too (room permitting), so that shutdown can end it; its callback or the sweep ends it
            if len(in_flight) < MAX_IN_FLIGHT:
                call.id = next_id()
                in_flight[call.id] = call
            if call.site.swept and call.id:  # no Python callback on a future torch completes alone (ClientSite)
                call.future = future
            else:
                future.add_done_callback(call.on_done)
        if call.rf is not None:
            return call.runtime.profiler.client_end_on(  # type: ignore[union-attr]  # rf: a profiler
                call.rf, future, call.site)
    except Exception:
        health.internal_error("client_watch")
    return future


class _EndsOnWait:
    """What `_invoke_rpc` hands torch's `rpc_sync` (which only waits on it) for a swept call: the call ends
    where the wait returns, as precisely as a callback would; any other use goes to torch's future."""

    __slots__ = ("future", "call")

    def __init__(self, future: Any, call: Call) -> None:
        self.future, self.call = future, call

    def wait(self) -> Any:
        try:
            return self.future.wait()
        finally:
            call = self.call
            try:
                if in_flight.pop(call.id, None) is not None:  # else a sweep or shutdown ended it already
                    call.fail(future_error(self.future))
            except Exception:
                health.internal_error("client_wait")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.future, name)


def wrap_invoke_rpc(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps `api._invoke_rpc(to, func, rpc_type, ...)`, behind rpc_sync and rpc_async (with the C core's
    `Hook` where built, which makes each call's `Call` in C: `_core.new_call`, held to `Call` by the tests)."""
    if _core is not None:
        return _core.Hook(original, _core.INVOKE_RPC)

    def _invoke_rpc(to: Any, func: Any, rpc_type: Any, *args: Any, **kwargs: Any) -> Any:
        runtime = _runtime.current
        call = None
        if runtime is not None:
            try:  # a known site by name, inline; _begin for the rest
                mode = rpc_type._value_  # not .value: a descriptor, a Python call
                try:
                    site = runtime.client_sites.get((func, mode, to)) if type(to) is str else None
                except TypeError:  # an unhashable func
                    site = None
                call = Call(runtime, site) if site is not None else _begin(runtime, to, func, mode,
                                                                           args[0] if args else kwargs.get("args"))
            except Exception:
                health.internal_error("client_start")
        if call is None:
            return original(to, func, rpc_type, *args, **kwargs)
        outer = current_call()
        set_current_call(call)
        try:
            future = original(to, func, rpc_type, *args, **kwargs)
        except BaseException as e:
            set_current_call(outer)
            end_raised(call, e)
            raise
        set_current_call(outer)
        return _after_invoke(call, future, rpc_type)

    return _invoke_rpc


def _after_invoke(call: Call, future: Any, rpc_type: Any) -> Any:
    """What `rpc_sync`/`rpc_async` get for a call whose request left: the future, watched unless its echoed
    response ends the call."""
    try:
        if call.id and call.rf is None:  # its echoed response ends it
            call.future = future
            return future
        watched = _watch(call, future)
        if call.site.swept and call.future is not None and rpc_type is _SYNC:
            return _EndsOnWait(watched, call)
        return watched
    except Exception:
        health.internal_error("client_watch")
        return future


_core = trailer.core  # the C Hook where built (hooks/_core.c); `wrap_invoke_rpc`'s function is its reference
if _core is not None:
    _core.configure_invoke(Call, _begin, end_raised, _after_invoke, _profiler_enabled, threading.get_native_id)


def wrap_remote(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps `api.remote(to, func, ...)`; the call ends when the owner confirms the RRef."""

    def remote(to: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        runtime = _runtime.current
        call = (_begin(runtime, to, func, "remote", args[0] if args else kwargs.get("args"))
                if runtime is not None else None)
        if call is None:
            return original(to, func, *args, **kwargs)
        outer = current_call()
        set_current_call(call)
        try:
            rref = original(to, func, *args, **kwargs)
        except BaseException as e:
            set_current_call(outer)
            end_raised(call, e)
            raise
        set_current_call(outer)
        try:
            future = rref._get_future()
        except Exception:
            health.internal_error("client_watch")
            return rref
        profiled = _watch(call, future)
        if profiled is not future:
            try:
                rref._set_profiling_future(profiled)  # as torch does under its legacy profiler
            except Exception:
                health.internal_error("client_watch")
        return rref

    return remote
