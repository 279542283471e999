"""The RPC pickler: message metrics, and the context trailer on requests and responses.

`_InternalRPCPickler.serialize` / `deserialize` are wrapped on the class, so torch's
module functions (`internal.serialize`, used by the C++ agent), `api._default_pickler`
and custom picklers that subclass it and call these methods are all covered.
Tensor accounting walks the tensor table, never the payload: its cost grows with the
number of tensors, not with their bytes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch.distributed.rpc.internal import PythonUDF, RemoteException

from ..telemetry import health
from ..telemetry import runtime as _runtime
from ..telemetry.declarations import COUNT_BUCKETS, LATENCY_BUCKETS, SERIALIZATION_BUCKETS, SIZE_BUCKETS
from ..telemetry.metrics import (
    ClientCells,
    MessageCells,
    ServerCells,
    fold_finished,
    fold_message,
    fold_served,
    fold_split,
    fold_started,
)
from . import calls, thread_states, trailer
from .naming import RREF_FETCH, is_proxy, method_name, proxy_method

if TYPE_CHECKING:
    from ..telemetry.runtime import Runtime

_perf_counter = time.perf_counter
_time_ns = time.time_ns
_tuple_new = tuple.__new__
_thread_id = threading.get_ident
_local, _in_flight, _next_id = calls.local, calls.in_flight, calls.next_id
_current_call, _take_pending_reply = calls.current_call, calls.take_pending_reply
_keep_thread_state = thread_states.keep
_finished_append = calls.finished.append  # calls.finished is one object for the process's life
_MAX_IN_FLIGHT = calls.MAX_IN_FLIGHT
# The trailer codec (in C where built; trailer.py has the references).
_parse, _request_trailer, _response_trailer = trailer.parse, trailer.request_trailer, trailer.response_trailer
_UNKNOWN = "unknown"
_MAX_CACHED = 10_000
# torch clones a tensor before sending it when it is a small view of a big storage
# (torch/csrc/distributed/rpc/utils.cpp, cloneSparseTensors): then only its own
# bytes travel, otherwise the whole storage does.
_MIN_RECOPY_BYTES = 8 * 1024
_MIN_MULTIPLE = 2


def tensor_sizes(tensors: list[Any]) -> tuple[int, int]:
    """(logical bytes, storage bytes that travel) of a tensor table."""
    logical = traveling = 0
    for t in tensors:
        try:
            useful = t.nbytes
            storage = t.untyped_storage().nbytes()
        except Exception:  # sparse and other storage-less tensors
            useful = storage = t.numel() * t.element_size()
        logical += useful
        recopied = storage >= _MIN_RECOPY_BYTES and storage >= useful * _MIN_MULTIPLE
        traveling += useful if recopied else storage
    return logical, traveling


def _on_other_message(runtime: Runtime, obj: Any, data: bytes, tensors: list[Any], start: float,
                      seconds: float) -> Any:
    """Requests, and responses that are not echoed (or whose trailer is malformed)."""
    size, fields = trailer.split(data)
    record = runtime.metrics.record if runtime.metrics is not None else None
    if fields is not None and fields[trailer.KIND] == trailer.RESPONSE:  # not in flight (any more), or a hostile id
        if record is not None:
            logical, traveling = tensor_sizes(tensors) if tensors else (0, 0)
            record((fold_message, _message_cells(runtime, "deserialize", "response"), size, len(tensors), logical,
                    traveling, seconds, None, 0))
        return obj
    request = type(obj) is PythonUDF
    if fields is not None and fields[trailer.KIND] == trailer.REQUEST and (request or isinstance(obj, AttributeError)):
        if request:
            obj = _tuple_new(_IncomingUDF, obj)
            obj.rpc_observe_start = start
        obj.rpc_observe_fields = fields  # for the wrapped _run_function
    if record is not None:
        peer_cell, wire_bytes = None, 0
        fetch = getattr(_local, "fetch", None) if not request else None
        if request:
            cells = runtime.request_cells.get(obj.func) or _request_cells(runtime, obj.func, obj.args)
        elif fetch is not None and fields is None:  # the value of an RRef.to_here() on this thread (traffic.py)
            cells, peer_cell = fetch.response_cells, fetch.received
            _local.fetch = None  # counted here: the fetch wrapper must not count it again
        else:
            cells = _message_cells(runtime, "deserialize", "request" if isinstance(obj, AttributeError) else "response")
        logical, traveling = tensor_sizes(tensors) if tensors else (0, 0)
        if peer_cell is not None:
            wire_bytes = len(data) + traveling
        record((fold_message, cells, size, len(tensors), logical, traveling, seconds, peer_cell, wire_bytes))
    return obj


def _request_cells(runtime: Runtime, func: Any, args: Any = None) -> MessageCells:
    """The request metrics of `func`; an RRef proxy's are cached per method it runs, never by func alone."""
    key, name = func, None
    if is_proxy(func):
        name = proxy_method(args, local=True)
        key = (func, name)
        cached = runtime.request_cells.get(key)
        if cached is not None:
            return cached
    metrics = runtime.metrics  # callers record: metrics are on
    cells = metrics.message_cells(  # type: ignore[union-attr]
        "deserialize", "request", name or method_name(func))
    try:
        if len(runtime.request_cells) > _MAX_CACHED:
            runtime.request_cells.clear()
        runtime.request_cells[key] = cells
    except TypeError:  # an unhashable callable
        pass
    return cells


def _message_cells(runtime: Runtime, direction: str, message: str, method: str = _UNKNOWN) -> MessageCells:
    """Cells of messages named without a call site: `unknown` (a response without an echo, an unpicklable
    request), or an RRef fetch's reply on its owner (`RREF_FETCH`, as the caller names it)."""
    key = (direction, message, method)
    cells = runtime.request_cells.get(key)
    if cells is None:
        metrics = runtime.metrics  # callers record: metrics are on
        cells = runtime.request_cells[key] = metrics.message_cells(  # type: ignore[union-attr]
            direction, message, method)
    return cells


class _IncomingUDF(PythonUDF):
    """A PythonUDF that also carries the caller's trailer fields to `_run_function` (the Python path; the C core
    keeps them per thread instead, without an object: `incoming` in hooks/_core.c)."""

    rpc_observe_fields: list[str]
    rpc_observe_start: float  # perf_counter() when its unpickling started


def _finish_echoed(call: calls.Call, obj: Any, end_ns: int, callee_ns: int) -> None:
    """The C fast path's way out for an echoed response it does not end inline (an error, a profiler)."""
    call.finish(end_ns, calls.remote_error(obj), callee_ns)


# The pickler's fast paths in C (hooks/_core.c) where built; the Python ones below are their reference.
_NOT_HANDLED = object()
_core = trailer.core




def _serialize_other(runtime: Runtime, obj: Any, data: bytes, tensors: list[Any], seconds: float) -> Any:
    """A message pickled on a thread with no call of ours being sent and no UDF run to reply to."""
    if runtime.metrics is not None:
        # Without a UDF run on this thread, a Python value torch pickles is an RRef fetch's reply:
        # `serializePyObject` serves only UDF results and PythonRRefFetchCall (request_callback_impl.cpp).
        cells = _message_cells(runtime, "serialize", "response", RREF_FETCH)
        logical, traveling = tensor_sizes(tensors) if tensors else (0, 0)
        runtime.metrics.record((fold_message, cells, len(data), len(tensors), logical, traveling, seconds, None, 0))
    return data, tensors


def configure_core(time_ns: Callable[[], int], perf_counter: Callable[[], float]) -> None:
    """Hands the C hot paths the tables and functions they use, and their clocks (a test's, in tests)."""
    if _core is not None:
        _core.configure(_in_flight, calls.finished, fold_message, fold_split, fold_finished, RemoteException,
                        PythonUDF, _request_cells, _finish_echoed, _NOT_HANDLED, time_ns,
                        _next_id, _MAX_IN_FLIGHT)
        _core.configure_hooks(_runtime, perf_counter, health.internal_error, _on_other_message, _serialize_other)
        _core.configure_fold(fold_message, fold_started, fold_finished, fold_split, fold_served, SIZE_BUCKETS,
                             COUNT_BUCKETS, LATENCY_BUCKETS, SERIALIZATION_BUCKETS, MessageCells, ClientCells,
                             ServerCells)


configure_core(_time_ns, _perf_counter)


def wrap_serialize(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps `_InternalRPCPickler.serialize(obj)`: counts the message, appends the trailer.

    Where the C core is built, the wrapper is its `Hook`: the same steps, no Python frame of ours (the
    function below is its reference; tests/unit/test_endings.py holds them to each other)."""
    if _core is not None:
        return _core.Hook(original, _core.SERIALIZE)

    def serialize(self: Any, obj: Any) -> Any:
        runtime = _runtime.current
        if runtime is None:
            return original(self, obj)
        _keep_thread_state()
        start = _perf_counter()
        data, tensors = original(self, obj)
        seconds = _perf_counter() - start
        # Inline on purpose, like `deserialize`: see there.
        try:
            call = _current_call() if type(obj) is PythonUDF else None
            if call is not None:  # a request
                site = call.site
                context = (runtime.tracer.context_text(call.span)  # type: ignore[union-attr]  # span: tracer
                           if call.span is not None else "")
                call_id = _next_id() if site.echoed and len(_in_flight) < _MAX_IN_FLIGHT else 0
                tail = _request_trailer(site.trailer_head, call_id, context)
                record = site.record
                if record is not None:
                    logical, traveling = tensor_sizes(tensors) if tensors else (0, 0)
                    record((fold_message, site.request_cells, len(data), len(tensors), logical, traveling, seconds,
                            site.cells.sent_bytes, len(data) + len(tail) + traveling))
                if call_id:  # in the table only once nothing of ours can fail before the request leaves
                    call.id = call_id
                    _in_flight[call_id] = call
                return data + tail, tensors
            reply = _take_pending_reply()
            if reply is None:
                return _serialize_other(runtime, obj, data, tensors, seconds)
            served, echo, request_start = reply  # the response of a UDF this thread just ran
            # The callee's time: from unpickling the request to having pickled this response.
            tail = (_response_trailer(echo, int((start + seconds - request_start) * 1e6) if request_start else -1)
                    if echo else b"")
            record = served.record
            if record is not None:
                logical, traveling = tensor_sizes(tensors) if tensors else (0, 0)
                record((fold_message, served.response_cells, len(data), len(tensors), logical, traveling, seconds, None,
                        0))
            return (data + tail if tail else data), tensors
        except Exception:
            health.internal_error("serialize")
        return data, tensors

    return serialize


def wrap_deserialize(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps `_InternalRPCPickler.deserialize(data, tensors)`: counts the message, reads the trailer (a C `Hook`
    where the core is built, as `wrap_serialize`)."""
    if _core is not None:
        return _core.Hook(original, _core.DESERIALIZE)

    def deserialize(self: Any, binary_data: bytes, tensor_table: list[Any]) -> Any:
        runtime = _runtime.current
        if runtime is None:
            return original(self, binary_data, tensor_table)
        _keep_thread_state()
        start = _perf_counter()
        obj = original(self, binary_data, tensor_table)
        seconds = _perf_counter() - start
        # Inline on purpose: this runs on the agent's pool threads with cold caches, where
        # each function (and module) touched costs microseconds of cache misses, several
        # times its warm cost (BENCHMARKS.md). The commonest messages, a request with our
        # trailer and the echoed response to one of our calls (ended here), take no call of ours.
        try:
            data, tensors = binary_data, tensor_table
            parsed = _parse(data)  # the trailer: `trailer.parse`
            if parsed is not None:
                if len(parsed) == 3:  # a response that echoes a call id: `(pickle size, call id, callee µs or -1)`
                    call = _in_flight.pop(parsed[1], None)
                    if call is not None:
                        site = call.site
                        end_ns = _time_ns()
                        callee_ns = parsed[2] * 1000 if parsed[2] >= 0 else -1
                        record = site.record
                        if record is not None:  # what came from the peer: pickle, trailer and storages
                            logical, traveling = tensor_sizes(tensors) if tensors else (0, 0)
                            record((fold_message, site.response_cells, parsed[0], len(tensors),
                                    logical, traveling, seconds, site.received, len(data) + traveling))
                        if type(obj) is RemoteException or (call.rf is None and runtime.profiler is not None
                                                            and runtime.profiler.armed):
                            call.finish(end_ns, calls.remote_error(obj), callee_ns)
                            return obj
                        # Call.finish, inline, for a successful call whose profiler event, if any, is torch's own
                        # (its future ends it; Call.finish keeps an event only for a call without one, once a
                        # profiler is armed) (tests/unit/test_endings.py).
                        _finished_append((site, call.id, call.start_ns, end_ns, None))
                        if record is not None:
                            if callee_ns >= 0:
                                record((fold_split, site.cells, (end_ns - call.start_ns) / 1e9, callee_ns / 1e9,
                                        call.span))
                            else:
                                record((fold_finished, site.cells, (end_ns - call.start_ns) / 1e9, call.span))
                        span = call.span
                        if span is not None:
                            span.callee_ns = callee_ns
                            runtime.tracer.end(span, end_ns)  # type: ignore[union-attr]  # span: tracer
                        return obj
                elif type(obj) is PythonUDF:  # a request: `(pickle size, fields)`
                    obj = _tuple_new(_IncomingUDF, obj)
                    obj.rpc_observe_fields = parsed[1]  # for the wrapped _run_function
                    obj.rpc_observe_start = start  # for the callee's time, in its response
                    if runtime.metrics is not None:
                        cells = runtime.request_cells.get(obj.func) or _request_cells(runtime, obj.func, obj.args)
                        logical, traveling = tensor_sizes(tensors) if tensors else (0, 0)
                        runtime.metrics.record((fold_message, cells, parsed[0], len(tensors),
                                                logical, traveling, seconds, None, 0))
                    return obj
            return _on_other_message(runtime, obj, data, tensors, start, seconds)
        except Exception:
            health.internal_error("deserialize")
            return obj

    return deserialize
