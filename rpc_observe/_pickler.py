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

_perf_counter = time.perf_counter
_tuple_new = tuple.__new__
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


def _on_serialize(runtime, obj, data: bytes, tensors, seconds: float) -> bytes:
    # Requests first: a pool thread pickling a response has a fresh thread state, whose
    # threading.local would be created just to be found empty.
    call = getattr(_client.local, "call", None) if type(obj) is _PythonUDF else None
    if call is not None:  # a request
        site = call.site
        trailer = call.request_trailer()
        cells = site.request_cells
    else:
        reply = _server.pending_replies.pop(_thread_id(), None)
        if reply is None:
            cells = _unknown_cells(runtime, "serialize", "response")
            trailer = b""
        else:
            site, call_id = reply
            cells = site.response_cells
            trailer = propagation.response_trailer(call_id) if call_id else b""
        call = None
    metrics = runtime.metrics
    if metrics is not None:
        logical, traveling = tensor_sizes(tensors) if tensors else (0, 0)
        if call is not None:
            metrics.message(cells, len(data), len(tensors), logical, traveling, seconds,
                            site.cells[3], len(data) + len(trailer) + traveling)
        else:
            metrics.message(cells, len(data), len(tensors), logical, traveling, seconds)
    return data + trailer if trailer else data


def _on_deserialize(runtime, obj, data: bytes, tensors, seconds: float):
    size, fields = propagation.split(data)
    metrics = runtime.metrics
    if fields is not None and fields[0] == "r":  # a response to a call of ours
        call = _client.take(fields[1])
        try:
            if metrics is not None:
                cells = call.site.response_cells if call is not None else _unknown_cells(runtime, "deserialize", "response")
                logical, traveling = tensor_sizes(tensors) if tensors else (0, 0)
                metrics.message(cells, size, len(tensors), logical, traveling, seconds)
        finally:
            if call is not None:
                _client.responded(call, obj)
        return obj
    request = type(obj) is _PythonUDF
    if fields is not None and fields[0] == "q" and (request or isinstance(obj, AttributeError)):
        if request:
            obj = _tuple_new(_IncomingUDF, obj)
        obj.rpc_observe_fields = fields  # for the wrapped _run_function
    if metrics is not None:
        if request:
            cells = runtime.request_cells.get(obj.func)
            if cells is None:
                cells = _request_cells(runtime, obj.func)
        else:
            cells = _unknown_cells(runtime, "deserialize", "request" if isinstance(obj, AttributeError) else "response")
        logical, traveling = tensor_sizes(tensors) if tensors else (0, 0)
        metrics.message(cells, size, len(tensors), logical, traveling, seconds)
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
        try:
            data = _on_serialize(runtime, obj, data, tensors, seconds)
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
        try:
            return _on_deserialize(runtime, obj, binary_data, tensor_table, seconds)
        except Exception:
            _health.internal_error("deserialize")
            return obj

    return deserialize
