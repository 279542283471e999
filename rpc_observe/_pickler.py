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

from . import _client, _health, _runtime, _server, propagation
from .metrics import fold_finished, fold_message

_perf_counter = time.perf_counter
_time_ns = time.time_ns
_tuple_new = tuple.__new__
_MAGIC = propagation.MAGIC
_local = _client.local
_in_flight = _client.in_flight
_next_id = _client.next_id
_pending_replies = _server.pending_replies
_RemoteException = _client.RemoteException
_thread_id = threading.get_ident
_UNKNOWN = "unknown"
# torch clones a tensor before sending it when it is a small view of a big storage
# (torch/csrc/distributed/rpc/utils.cpp, cloneSparseTensors): then only its own
# bytes travel, otherwise the whole storage does.
_MIN_RECOPY_BYTES = 8 * 1024
_MIN_MULTIPLE = 2


def tensor_sizes(tensors) -> tuple[int, int]:
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


def _on_other_message(runtime, obj, data: bytes, tensors, seconds: float):
    """Requests, and responses that are not echoed (or whose trailer is malformed)."""
    size, fields = propagation.split(data)
    record = runtime.metrics.record if runtime.metrics is not None else None
    if fields is not None and fields[0] == "r":  # not in flight (any more), or a hostile id
        if record is not None:
            logical, traveling = tensor_sizes(tensors) if tensors else (0, 0)
            record((fold_message, _unknown_cells(runtime, "deserialize", "response"), size, len(tensors), logical,
                    traveling, seconds, None, 0))
        return obj
    request = type(obj) is _PythonUDF
    if fields is not None and fields[0] == "q" and (request or isinstance(obj, AttributeError)):
        if request:
            obj = _tuple_new(_IncomingUDF, obj)
        obj.rpc_observe_fields = fields  # for the wrapped _run_function
    if record is not None:
        if request:
            cells = runtime.request_cells.get(obj.func) or _request_cells(runtime, obj.func)
        else:
            cells = _unknown_cells(runtime, "deserialize", "request" if isinstance(obj, AttributeError) else "response")
        logical, traveling = tensor_sizes(tensors) if tensors else (0, 0)
        record((fold_message, cells, size, len(tensors), logical, traveling, seconds, None, 0))
    return obj


def _request_cells(runtime, func) -> tuple:
    cells = runtime.metrics.message_cells("deserialize", "request", _client.method_name(func))
    try:
        if len(runtime.request_cells) > 10_000:
            runtime.request_cells.clear()
        runtime.request_cells[func] = cells
    except TypeError:  # an unhashable callable
        pass
    return cells


def _unknown_cells(runtime, direction: str, message: str) -> tuple | None:
    """Cells of messages that cannot be told apart: a response without an echo, an unpicklable request."""
    if runtime.metrics is None:
        return None
    key = (direction, message)
    cells = runtime.request_cells.get(key)
    if cells is None:
        cells = runtime.request_cells[key] = runtime.metrics.message_cells(direction, message, _UNKNOWN)
    return cells


_PythonUDF = _IncomingUDF = None  # set when torch.distributed.rpc is patched


def _bind_torch_types() -> None:
    global _PythonUDF, _IncomingUDF
    if _PythonUDF is None:
        from torch.distributed.rpc.internal import PythonUDF

        class _IncomingUDF(PythonUDF):
            """A PythonUDF that also carries the caller's trailer fields to `_run_function`."""

        _PythonUDF, _IncomingUDF = PythonUDF, _IncomingUDF


def wrap_serialize(original):
    _bind_torch_types()

    def serialize(self, obj):
        runtime = _runtime.current
        if runtime is None:
            return original(self, obj)
        start = _perf_counter()
        data, tensors = original(self, obj)
        seconds = _perf_counter() - start
        # Inline on purpose, like `deserialize`: see there.
        try:
            call = getattr(_local, "call", None) if type(obj) is _PythonUDF else None
            if call is not None:  # a request
                site = call.site
                if site.echoed:
                    call.id = _next_id()
                    _in_flight[call.id] = call
                context = runtime.tracer.context_text(call.span) if call.span is not None else ""
                trailer = propagation.request_trailer(site.trailer_head, call.id, context)
                record = site.record
                if record is not None:
                    logical, traveling = tensor_sizes(tensors) if tensors else (0, 0)
                    record((fold_message, site.request_cells, len(data), len(tensors), logical, traveling, seconds,
                            site.cells[3], len(data) + len(trailer) + traveling))
                return data + trailer, tensors
            reply = _pending_replies.pop(_thread_id(), None)
            if reply is not None:  # the response of a UDF this thread just ran
                site, call_id = reply
                record = site.record
                trailer = propagation.response_trailer(call_id) if call_id else b""
            else:
                record = runtime.metrics.record if runtime.metrics is not None else None
                trailer = b""
            if record is not None:
                cells = site.response_cells if reply is not None else _unknown_cells(runtime, "serialize", "response")
                logical, traveling = tensor_sizes(tensors) if tensors else (0, 0)
                record((fold_message, cells, len(data), len(tensors), logical, traveling, seconds, None, 0))
            return (data + trailer if trailer else data), tensors
        except Exception:
            _health.internal_error("serialize")
        return data, tensors

    return serialize


def wrap_deserialize(original):
    _bind_torch_types()

    def deserialize(self, binary_data, tensor_table):
        runtime = _runtime.current
        if runtime is None:
            return original(self, binary_data, tensor_table)
        start = _perf_counter()
        obj = original(self, binary_data, tensor_table)
        seconds = _perf_counter() - start
        # Inline on purpose: this runs on the agent's pool threads with cold caches, where
        # each function (and module) touched costs microseconds of cache misses, several
        # times its warm cost (BENCHMARKS.md). The commonest messages, a request with our
        # trailer and the echoed response to one of our calls (ended here), take no call of ours.
        try:
            data, tensors = binary_data, tensor_table
            if data[-8:] == _MAGIC and len(data) > 10 and data[-9] == 0:
                size = data[-10]
                payload = data[-10 - size:-10]
                if payload[:2] == b"r\x1f" and payload[2:].isdigit():
                    call = _in_flight.pop(int(payload[2:]), None)
                    if call is not None:
                        site = call.site
                        end_ns = _time_ns()
                        record = site.record
                        if record is not None:
                            logical, traveling = tensor_sizes(tensors) if tensors else (0, 0)
                            record((fold_message, site.response_cells, len(data) - size - 10, len(tensors), logical,
                                    traveling, seconds, None, 0))
                        if type(obj) is _RemoteException or call.rf is not None or (
                                runtime.profiler is not None and runtime.profiler.armed):
                            call.finish(end_ns, _client.remote_error(obj))
                            return obj
                        if record is not None:
                            record((fold_finished, site.cells, (end_ns - call.start_ns) / 1e9))
                        if call.span is not None:
                            runtime.tracer.end(call.span, end_ns)
                        return obj
                elif payload[:2] == b"q\x1f" and type(obj) is _PythonUDF and payload.isascii():
                    # A request: the same checks as `propagation.split`, which handles the rest.
                    fields = payload.decode("ascii").split("\x1f")
                    call_id = fields[3] if len(fields) >= 4 else "x"
                    if not call_id or (len(call_id) <= 20 and call_id.isdigit()):
                        obj = _tuple_new(_IncomingUDF, obj)
                        obj.rpc_observe_fields = fields  # for the wrapped _run_function
                        if runtime.metrics is not None:
                            cells = runtime.request_cells.get(obj.func) or _request_cells(runtime, obj.func)
                            logical, traveling = tensor_sizes(tensors) if tensors else (0, 0)
                            runtime.metrics.record((fold_message, cells, len(data) - size - 10, len(tensors), logical,
                                                    traveling, seconds, None, 0))
                        return obj
            return _on_other_message(runtime, obj, data, tensors, seconds)
        except Exception:
            _health.internal_error("deserialize")
            return obj

    return deserialize
