"""Fixtures of the in-process unit tests: fresh globals for every test, as in
opentelemetry-python-contrib's TestBase, and the `tests/` helpers on sys.path."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rpc_observe import _bootstrap, _patching
from rpc_observe.telemetry import health, runtime

TESTS = str(Path(__file__).resolve().parents[1])
if TESTS not in sys.path:  # `from cluster import ...` as in tests/conftest.py
    sys.path.insert(0, TESTS)


def reset_health() -> None:
    with health._lock:
        health.internal_errors.clear()
        health.spans_dropped.update(dict.fromkeys(health.spans_dropped, 0))
        health.invalid_contexts[0] = 0


@pytest.fixture(autouse=True)
def fresh_globals() -> Iterator[None]:
    """Zeroed health counters, no current runtime, no patches and no post-import finders of a test's own."""
    reset_health()
    current = runtime.current
    applied = list(_patching._applied)
    meta_path = list(sys.meta_path)
    runtime.current = None
    yield
    runtime.current = current
    _patching._applied[:] = applied
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _bootstrap._PostImportFinder)
                        or f in meta_path]
    reset_health()
    from rpc_observe.hooks import trailer

    if trailer.core is not None:
        trailer.core.take_incoming()  # a request a test unpickled in C and did not run: not the next test's


@pytest.fixture
def metrics_runtime(tmp_path: Path) -> Iterator[runtime.Runtime]:
    """A real Runtime (metrics, no spans, no profiler events), current for the hooks, gone after the test."""
    from rpc_observe import config

    cfg = config.load({"RPC_OBSERVE_DIR": str(tmp_path), "OTEL_TRACES_EXPORTER": "none",
                       "RPC_OBSERVE_PROFILER_EVENTS": "0"})
    rt = runtime.Runtime(cfg, "worker0", 0)
    runtime.current = rt
    yield rt
    runtime.current = None
    from rpc_observe.hooks import calls

    calls.in_flight.clear()
    rt.close()


@pytest.fixture(params=["python", "c"])
def codec(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The pickler's hot paths with the Python codec and fast paths (the reference), then with the C
    ones (hooks/_core.c, where built), whose clock is then `pickler._time_ns` (which tests replace)."""
    from rpc_observe.hooks import client, pickler, server, trailer

    core = trailer.core
    if request.param == "c" and core is None:
        pytest.skip("the C core is not built here (or RPC_OBSERVE_NO_EXTENSIONS=1)")
    python = request.param == "python"
    monkeypatch.setattr(pickler, "_core", None if python else core)  # wrap_(de)serialize: Python, or the C Hook
    monkeypatch.setattr(server, "_core", None if python else core)  # wrap_run_function: Python, or the C Hook
    monkeypatch.setattr(client, "_core", None if python else core)  # wrap_invoke_rpc too
    if not python:
        from rpc_observe.telemetry import tracing

        pickler.configure_core(lambda: pickler._time_ns(), lambda: pickler._perf_counter())
        server.configure_spans(lambda bits: tracing._getrandbits(bits))  # a test's ids
    yield str(request.param)
    if not python:
        import random
        import time

        # not pickler's clocks nor tracing's ids: the test's replacements may still be there
        pickler.configure_core(time.time_ns, time.perf_counter)
        server.configure_spans(random.getrandbits)


@pytest.fixture
def kept_request() -> Callable[[Any], tuple[list[str], float] | None]:
    """What the pickler kept of a request for `_run_function`: (the caller's fields, the unpickling's start), or
    None. The Python path attaches them to the UDF (an `_IncomingUDF`); the C path keeps them for the thread, with
    the UDF, and this takes them."""
    from rpc_observe.hooks import pickler, trailer

    def kept(udf: Any) -> tuple[list[str], float] | None:
        held = trailer.core.take_incoming() if trailer.core is not None else None
        if isinstance(udf, pickler._IncomingUDF):
            return udf.rpc_observe_fields, udf.rpc_observe_start
        if held is not None and held[0] is udf:
            return held[1], held[2]
        return None

    return kept
