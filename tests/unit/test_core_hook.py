"""The C core's `Hook` (hooks/_core.c), the pickler's methods where the core is built: bound like a function,
patched and restored like one, torch's result and errors untouched, its own errors counted and swallowed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.rpc.internal import PythonUDF

from rpc_observe import _patching
from rpc_observe.hooks import calls, pickler, trailer
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
    calls.pending_replies.clear()
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
        assert calls.serving[thread] is outer
        assert calls.pending_replies.pop(thread)[1] == "7"  # the response echoes the caller's call id
        error = ValueError("the UDF's own")

        def raising(udf: Any) -> Any:
            raise error

        with pytest.raises(ValueError) as raised:
            core.Hook(raising, core.RUN_FUNCTION)(udf)
        assert raised.value is error and calls.serving[thread] is outer
        site = metrics_runtime.server_sites[(noop, "worker1", "sync")]
        assert type(site) is server.ServerSite
        served = [r for r in metrics_runtime.metrics._records if r[1] is site.cells]
        assert len(served) == 1  # the run that returned; torch's raise is not a run of ours to end
        assert health.internal_errors == {}
    finally:
        calls.serving.pop(thread, None)
        calls.pending_replies.clear()


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
