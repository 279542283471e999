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

from . import _client, _health, _runtime, propagation

_perf_counter = time.perf_counter
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
        useful = t.numel() * t.element_size()
        try:
            storage = t.untyped_storage().nbytes()
        except Exception:  # sparse and other storage-less tensors
            storage = useful
        logical += useful
        recopied = storage >= _MIN_RECOPY_BYTES and storage >= useful * _MIN_MULTIPLE
        traveling += useful if recopied else storage
    return logical, traveling


def _message_cells(runtime, direction: str, message: str, method: str):
    sites = runtime.message_sites
    key = (direction, message, method)
    cells = sites.get(key)
    if cells is None:
        cells = sites[key] = runtime.metrics.message_cells(direction, message, method)
    return cells


def _on_serialize(runtime, obj, data: bytes, tensors, seconds: float) -> bytes:
    call = getattr(_client.local, "call", None)
    request = call is not None and type(obj) is _PythonUDF
    if request:
        cells = call.site.request_cells
        trailer = call.request_trailer()
    else:
        method = _client.pending_replies.pop(_thread_id(), None)
        trailer = propagation.response_trailer(method) if method is not None else b""
        cells = _message_cells(runtime, "serialize", "response", method or _UNKNOWN) if runtime.metrics else None
    metrics = runtime.metrics
    if metrics is not None:
        logical, traveling = tensor_sizes(tensors)
        if request:
            metrics.observe_message(cells, len(data), len(tensors), logical, traveling, seconds,
                                    call.site.cells[3], len(data) + len(trailer) + traveling)
        else:
            metrics.observe_message(cells, len(data), len(tensors), logical, traveling, seconds)
    return data + trailer if trailer else data


def _on_deserialize(runtime, obj, data: bytes, tensors, seconds: float):
    size, fields = propagation.split(data)
    metrics = runtime.metrics
    if type(obj) is _PythonUDF or isinstance(obj, AttributeError):
        message = "request"
        if metrics is None:
            method = _UNKNOWN  # only the metric label needs it
        else:
            method = _UNKNOWN if isinstance(obj, AttributeError) else _client.method_name(obj.func)
        if fields is not None and fields[0] == "q":
            if isinstance(obj, AttributeError):
                obj.rpc_observe_fields = fields
            else:
                obj = _IncomingUDF(*obj)
                obj.rpc_observe_fields = fields
    else:
        message = "response"
        method = fields[1] if fields is not None and fields[0] == "r" else _UNKNOWN
    if metrics is not None:
        logical, traveling = tensor_sizes(tensors)
        cells = _message_cells(runtime, "deserialize", message, method)
        metrics.observe_message(cells, size, len(tensors), logical, traveling, seconds)
    return obj


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
