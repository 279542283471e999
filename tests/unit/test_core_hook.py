"""The C core's `Hook` (hooks/_core.c), the pickler's methods where the core is built: bound like a function,
patched and restored like one, torch's result and errors untouched, its own errors counted and swallowed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.rpc.internal import PythonUDF

from rpc_observe import _patching
from rpc_observe.hooks import calls, client, pickler, trailer  # noqa: F401  # client: configures the _invoke_rpc Hook
from rpc_observe.telemetry import health, runtime

core = trailer.core
pytestmark = pytest.mark.skipif(core is None, reason="the C core is not built here")


def noop() -> None:
    pass


class Pickler:
    def serialize(self, obj: Any) -> tuple[bytes, list[Any]]:
        return b"PICKLE." + repr((type(self).__name__, obj)).encode(), []

    def deserialize(self, data: bytes, tensors: list[Any]) -> Any:
        return ("unpickled", len(data), len(tensors))


def test_a_hook_binds_patches_and_restores_like_the_function_it_wraps() -> None:
    original = Pickler.__dict__["serialize"]
    _patching.patch(Pickler, "serialize", pickler.wrap_serialize)
    try:
        hook = Pickler.__dict__["serialize"]
        assert type(hook) is core.Hook and hook.__rpc_observe_original__ is original  # type: ignore[union-attr]
        assert hook.__wrapped__ is original and hook.__name__ == "serialize"
        assert Pickler().serialize(5) == original(Pickler(), 5)  # runtime off: torch's call, as it is
        assert Pickler.serialize is hook  # from the class: itself, as a function is
    finally:
        _patching.restore_all()
    assert Pickler.__dict__["serialize"] is original


def test_off_it_hands_back_exactly_what_torch_returns_and_raises() -> None:
    assert runtime.current is None
    result = object()
    assert core.Hook(lambda self, obj: result, core.SERIALIZE)(None, 1) is result
    error = ValueError("torch's")

    def raising(self: Any, data: bytes, tensors: list[Any]) -> Any:
        raise error

    with pytest.raises(ValueError) as raised:
        core.Hook(raising, core.DESERIALIZE)(None, b"x", [])
    assert raised.value is error


def test_on_torch_errors_pass_through_and_odd_results_are_not_read(metrics_runtime: runtime.Runtime) -> None:
    error = RuntimeError("torch's")

    def raising(self: Any, obj: Any) -> Any:
        raise error

    with pytest.raises(RuntimeError) as raised:
        core.Hook(raising, core.SERIALIZE)(None, 1)
    assert raised.value is error
    odd = ("not", "a", "pair")
    assert core.Hook(lambda self, obj: odd, core.SERIALIZE)(None, 1) is odd
    assert core.Hook(lambda self, obj, extra=1: odd, core.SERIALIZE)(None, 1, extra=2) is odd  # not torch's call
    assert health.internal_errors == {}


def test_its_own_errors_are_counted_and_torch_gets_its_object(metrics_runtime: runtime.Runtime,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """A record that fails (here: the metrics' queue raises) is an internal error, said once with its traceback;
    the UDF torch unpickled and the message torch pickled go on unchanged."""
    def broken(record: Any) -> None:
        raise KeyError("broken record")

    monkeypatch.setattr(metrics_runtime.metrics, "record", broken)
    udf = PythonUDF(noop, (), {})
    data = b"PICKLE." + trailer.request_trailer(trailer.request_head("worker1", "sync"), 3, "")
    out = core.Hook(lambda self, d, t: udf, core.DESERIALIZE)(None, data, [torch.ones(2)])
    assert tuple(out) == tuple(udf)
    assert health.internal_errors == {"deserialize": 1}
    assert "broken record" in caplog.text  # the traceback of the exception, as an except block logs it
    calls.take_pending_reply()
    health.internal_errors.clear()


def test_run_function_hook_restores_the_thread_and_passes_torch_errors(metrics_runtime: runtime.Runtime) -> None:
    """A UDF run inside another on the same thread: the outer one is this thread's again after it, whether the
    inner one returned or raised (torch's exception, raised as it is); each run is counted once."""
    from rpc_observe.hooks import server

    hook = core.Hook(lambda udf: ("ran", udf.args), core.RUN_FUNCTION)
    thread = pickler._thread_id()
    outer = ("outer site", "9", 1, 0)
    calls.serving[thread] = outer
    try:
        udf = pickler._tuple_new(pickler._IncomingUDF, PythonUDF(noop, (3,), {}))
        udf.rpc_observe_fields = ["q", "worker1", "sync", "7"]
        udf.rpc_observe_start = 0.0
        assert hook(udf) == ("ran", (3,))
        assert calls.serving[thread] == outer
        reply = calls.take_pending_reply()
        assert reply is not None and reply[1] == "7"  # the response echoes the caller's call id
        error = ValueError("the UDF's own")

        def raising(udf: Any) -> Any:
            raise error

        with pytest.raises(ValueError) as raised:
            core.Hook(raising, core.RUN_FUNCTION)(udf)
        assert raised.value is error and calls.serving[thread] == outer
        site = metrics_runtime.server_sites[(noop, "worker1", "sync")]
        assert type(site) is server.ServerSite
        served = [r for r in metrics_runtime.metrics._records if r[1] is site.cells]
        assert len(served) == 1  # the run that returned; torch's raise is not a run of ours to end
        assert health.internal_errors == {}
    finally:
        calls.serving.pop(thread, None)
        calls.take_pending_reply()


def test_run_function_hook_counts_its_own_errors(metrics_runtime: runtime.Runtime,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A broken site lookup: counted as server_start, and the UDF still runs, once, with torch's result."""
    from rpc_observe.hooks import server

    def broken(*args: Any) -> Any:
        raise KeyError("broken lookup")

    monkeypatch.setattr(server, "_core", core)
    core.configure_run(calls.serving, set(), broken, server._end_other, server.fold_served, server.UNKNOWN)
    try:
        ran = []
        result = object()
        assert core.Hook(lambda udf: ran.append(udf) or result, core.RUN_FUNCTION)(PythonUDF(noop, (), {})) is result
        assert len(ran) == 1 and health.internal_errors == {"server_start": 1}
    finally:
        core.configure_run(calls.serving, server._PROXIES, server._site_of, server._end_other, server.fold_served,
                           server.UNKNOWN)
        health.internal_errors.clear()


@pytest.mark.parametrize("queue", ["deque", "records"])
@pytest.mark.parametrize("spans", [False, True], ids=["metrics", "metrics+spans"])
def test_the_core_keeps_no_object_per_call(tmp_path: Any, spans: bool, queue: str) -> None:
    """A whole RPC through the four C paths (request out, request in, the UDF run, response out and in), 10,000
    times: every object they make is freed again (a reference kept per call would be a leak in every job)."""
    import gc
    import sys

    from rpc_observe import config
    from rpc_observe.hooks import server
    from rpc_observe.hooks.client import ClientSite
    from rpc_observe.telemetry import tracing
    from rpc_observe.telemetry.metrics import Metrics

    cfg = config.load({"RPC_OBSERVE_DIR": str(tmp_path), "OTEL_TRACES_EXPORTER": "none",
                       "RPC_OBSERVE_PROFILER_EVENTS": "0", "RPC_OBSERVE_METRICS": "0"})
    rt = runtime.Runtime(cfg, "worker0", 0)
    rt.metrics = Metrics("worker0", 100)
    if queue == "records":  # the C queue, as under the hooks: records pushed without tuples, drained as tuples
        rt.metrics.use_queue(core.Records())
        rt.metrics.fold_records = core.fold
    rt.tracer = tracing.Tracer(cfg, []) if spans else None
    runtime.current = rt
    try:
        result, tensors = {"a": 1}, [torch.ones(2)]
        serialize = pickler.wrap_serialize(lambda self, obj: (b"PICKLE.", tensors))
        request_in = pickler.wrap_deserialize(lambda self, d, t: PythonUDF(noop, (), {}))
        response_in = pickler.wrap_deserialize(lambda self, d, t: result)
        run = server.wrap_run_function(lambda udf: result)
        assert {type(f) for f in (serialize, request_in, run)} == {core.Hook}
        site = ClientSite(rt, noop, "sync", "worker1")

        def one_rpc() -> None:
            calls.set_current_call(calls.Call(rt, site))
            request, _ = serialize(None, PythonUDF(noop, (), {}))
            calls.set_current_call(None)
            run(request_in(None, request, tensors))
            response, _ = serialize(None, result)
            assert response_in(None, response, tensors) is result

        def drained() -> int:
            rt.metrics.drain()
            if rt.tracer is not None:
                rt.tracer._queue.clear()
            calls.finished.clear()
            gc.collect()
            return sys.getallocatedblocks()

        for _ in range(1000):
            one_rpc()
        before, misses = drained(), core.slot_misses()
        for i in range(10_000):
            one_rpc()
            if i % 1000 == 0:
                drained()
        assert drained() - before < 100  # not one per call
        assert core.slot_misses() - misses < 100  # the attributes read at offsets found once, not per call
        assert not calls.in_flight and calls.take_pending_reply() is None and not calls.serving
        assert health.internal_errors == {}
    finally:
        runtime.current = None
        rt.close()


def test_invoke_rpc_hook_hands_back_torch_futures_and_errors(metrics_runtime: runtime.Runtime) -> None:
    """rpc_async's `_invoke_rpc` as a C Hook: positional and keyword arguments reach torch as given, torch's future
    comes back (watched: here no response echoes the call), torch's exception is raised as it is, and each call
    ends once, as a success or as the error torch raised."""
    from torch.distributed.rpc.api import RPCExecMode

    seen: list[tuple[Any, ...]] = []
    future: torch.futures.Future = torch.futures.Future()

    def invoke(to: Any, func: Any, rpc_type: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append((to, func, rpc_type, args, kwargs))
        assert calls.current_call() is not None  # the call being sent, for the pickler
        return future

    hook = core.Hook(invoke, core.INVOKE_RPC)
    assert hook("worker1", noop, RPCExecMode.ASYNC, (1,), {}, timeout=5.0) is future
    assert seen == [("worker1", noop, RPCExecMode.ASYNC, ((1,), {}), {"timeout": 5.0})]
    assert calls.current_call() is None  # put back as it was
    (call,) = calls.in_flight.values()
    future.set_result(3)  # its done-callback ends it
    assert not calls.in_flight and list(calls.finished)[-1][4] is None
    error = ConnectionError("torch's")

    def raising(to: Any, func: Any, rpc_type: Any, *args: Any, **kwargs: Any) -> Any:
        raise error

    with pytest.raises(ConnectionError) as raised:
        core.Hook(raising, core.INVOKE_RPC)("worker1", noop, RPCExecMode.SYNC, args=(2,))
    assert raised.value is error and list(calls.finished)[-1][4] == "ConnectionError"
    assert calls.current_call() is None and health.internal_errors == {}
    calls.finished.clear()


def _read_both(obj: Any, name: str) -> tuple[Any, Any]:
    """(getattr's value or exception type, the C paths' read's)."""
    outcomes = []
    for read in (getattr, core.slot_attr):  # type: ignore[union-attr]
        try:
            outcomes.append(("value", read(obj, name)))
        except Exception as e:  # noqa: BLE001  # the same exception either way is the point
            outcomes.append(("raised", type(e)))
    return outcomes[0], outcomes[1]


def test_the_c_paths_read_slots_as_getattr_does() -> None:
    """The hot paths read __slots__ members at their offsets, found once per (type, name): every read is
    getattr's, after the class changes, for another class's descriptor, a __getattribute__, unset slots, builtins
    and many classes sharing the table's entries."""
    import random

    class Site:
        __slots__ = ("record", "cells", "unset")

    class Derived(Site):
        __slots__ = ("extra",)

    class Other:
        __slots__ = ("a", "b")

    class Borrower:  # another class's member descriptor: getattr refuses it (its offset is one of p, q, r here)
        __slots__ = ("p", "q", "r")
        record = Site.__dict__["record"]

    class Hooked(Site):
        __slots__ = ()

        def __getattribute__(self, name: str) -> Any:
            return "hooked"

    site, derived, borrower = Site(), Derived(), Borrower()
    site.record, site.cells = "rec", [1]
    derived.record, derived.extra = "drec", 2
    borrower.p, borrower.q, borrower.r = 5, 6, 7
    hooked = Hooked()
    for obj, name in [(site, "record"), (site, "cells"), (site, "unset"), (site, "missing"), (derived, "record"),
                      (derived, "extra"), (derived, "unset"), (borrower, "record"), (borrower, "q"),
                      (hooked, "record"), (slice(1, 2), "start"), (runtime, "current"), (3, "real")]:
        for _ in range(2):  # found, then from the table
            assert _read_both(obj, name)[0] == _read_both(obj, name)[1], (obj, name)
    assert core.slot_attr(site, "record") == "rec"  # type: ignore[union-attr]
    Site.record = property(lambda self: "a property now")  # type: ignore[assignment, method-assign]
    assert core.slot_attr(site, "record") == "a property now"  # type: ignore[union-attr]
    assert core.slot_attr(derived, "record") == "a property now"  # type: ignore[union-attr]  # through the base
    Site.__getattribute__ = lambda self, name: "hooked later"  # type: ignore[method-assign, assignment, misc]
    assert core.slot_attr(site, "cells") == "hooked later"  # type: ignore[union-attr]
    rng = random.Random(3)
    classes = [type(f"C{i}", (), {"__slots__": ("x", "y", "w")}) for i in range(200)]
    objs = []
    for i, cls in enumerate(classes):
        obj = cls()
        obj.x, obj.y = i, -i  # w unset
        objs.append(obj)
    for _ in range(20_000):
        obj, name = rng.choice(objs), rng.choice("xyw")
        assert _read_both(obj, name)[0] == _read_both(obj, name)[1]
