"""Every cache and table of the hot path has a bound, tested directly: left on for days, nothing grows."""

from __future__ import annotations

import types
from typing import Any

import torch
from torch.distributed.rpc.internal import PythonUDF

from rpc_observe.hooks import calls, client, naming, pickler, server
from rpc_observe.hooks.profiler_events import ProfilerEvents
from rpc_observe.telemetry import runtime


def _functions(n: int) -> list[Any]:
    return [types.FunctionType((lambda: None).__code__, {}, f"f{i}") for i in range(n)]


def test_client_sites_are_bounded(metrics_runtime: runtime.Runtime) -> None:
    for func in _functions(client._MAX_SITES + 50):
        assert client._begin(metrics_runtime, "worker1", func, "sync") is not None
    assert len(metrics_runtime.client_sites) <= client._MAX_SITES + 1


def test_server_sites_are_bounded(metrics_runtime: runtime.Runtime) -> None:
    for func in _functions(server._MAX_SITES + 50):
        server._site(metrics_runtime, (func, "worker1", "sync"))
    assert len(metrics_runtime.server_sites) <= server._MAX_SITES + 1


def test_request_cells_and_method_names_are_bounded(metrics_runtime: runtime.Runtime) -> None:
    for func in _functions(pickler._MAX_CACHED + 50):
        pickler._request_cells(metrics_runtime, func)
    assert len(metrics_runtime.request_cells) <= pickler._MAX_CACHED + 1
    assert len(naming._method_names) <= naming._MAX_CACHED + 1


def test_the_profiler_ring_keeps_only_its_capacity() -> None:
    events = ProfilerEvents("worker0", "run", capacity=100)
    for i in range(1000):
        events.record(f"k{i}", "server", i, i + 1, 1, None)
    assert len(events._ring) == 100 and events._ring[-1][0] == "k999"  # the newest are kept


def test_the_call_table_is_bounded_and_calls_past_it_still_end(metrics_runtime: runtime.Runtime) -> None:
    filler = object()
    calls.in_flight.update((-i, filler) for i in range(1, calls.MAX_IN_FLIGHT + 1))  # type: ignore[misc]
    call = client._begin(metrics_runtime, "worker1", _functions(1)[0], "sync")
    assert call is not None and call.site.echoed
    runtime_current = runtime.current
    calls.set_current_call(call)
    try:  # the request asks for no echo: the table is full
        data, _ = pickler.wrap_serialize(lambda self, obj: (b"P", []))(None, PythonUDF(print, (), {}))
    finally:
        calls.set_current_call(None)
    assert call.id == 0 and runtime_current is metrics_runtime and b"\x00rpcobs1" in data
    future: torch.futures.Future = torch.futures.Future()
    assert client._watch(call, future) is future
    assert len(calls.in_flight) == calls.MAX_IN_FLIGHT  # not added
    future.set_result(None)  # the done-callback ends it
    folds = [r[0].__name__ for r in metrics_runtime.metrics._records]
    assert folds.count("fold_finished") == 1
