"""The spans the C core makes inline (hooks/_core.c) against `tracing.Tracer`'s methods, the reference the
Python paths call: the SERVER span of `_run_function` (start_server, attach, detach, end) for every
context a peer can send, with the same per-thread parent while the UDF runs and after and the same
invalid-context count; the CLIENT span of `_invoke_rpc` (start_client) and the context its request
carries (context_text) in every situation a caller can be in; all with the ids in full. And the C
traceparent parser against the regex on hostile text. Real torch objects, no RPC."""

from __future__ import annotations

import os
import random
import string
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from torch.distributed.rpc.internal import PythonUDF

from rpc_observe import config
from rpc_observe.hooks import calls, pickler, server, trailer
from rpc_observe.telemetry import health, propagation, runtime, tracing

core = trailer.core
needs_c = pytest.mark.skipif(core is None, reason="the C core is not built here")

TRACE, PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
VALID = f"traceparent=00-{TRACE}-{PARENT}-01"


def noop() -> None:
    pass


def reference_parse(entry: str) -> tuple[int, int, bool] | None:
    """What Tracer.start_server reads of one context entry (its inline parse)."""
    match = propagation.TRACEPARENT_ENTRY(entry)
    if match is None:
        return None
    trace_id, parent_id = int(match[1], 16), int(match[2], 16)
    if not trace_id or not parent_id:
        return None
    return trace_id, parent_id, match[3] in propagation.SAMPLED_LAST_DIGITS


def hostile_entries(count: int, seed: int = 7) -> Iterator[str]:
    rng = random.Random(seed)
    alphabet = string.hexdigits + "-=xX \x00\u00e9\u0660\U0001f600ff"
    yield from [VALID, VALID.upper(), VALID.replace("00-", "ff-", 1), VALID.replace("00-", "fe-", 1),
                f"traceparent=00-{'0' * 32}-{PARENT}-01", f"traceparent=00-{TRACE}-{'0' * 16}-01", VALID + "\n",
                VALID[:-1], VALID + "0", "", "traceparent=", VALID.replace("-", "_"), " " + VALID[1:],
                VALID.replace("4bf9", "4bF9"), VALID.replace("4bf9", "4b\u00e99"[:4])]
    yield from [VALID[:-1] + digit for digit in "0123456789abcdefABCDEFg"]
    for _ in range(count):
        chars = list(VALID)
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(len(chars))
            action = rng.randrange(3)
            if action == 0:
                chars[at] = rng.choice(alphabet)
            elif action == 1:
                del chars[at]
            else:
                chars.insert(at, rng.choice(alphabet))
        yield "".join(chars)
        yield VALID[:12] + "".join(rng.choice("0123456789abcdef-") for _ in range(55))


@needs_c
def test_the_c_traceparent_parse_is_the_regex() -> None:
    entries = list(hostile_entries(20_000))
    agreed = [core.parse_traceparent(e) == reference_parse(e) for e in entries]
    assert all(agreed), [e for e, ok in zip(entries, agreed) if not ok][:5]
    assert sum(reference_parse(e) is not None for e in entries) > 1000  # not only rejects
    assert core.parse_traceparent(VALID) == (int(TRACE, 16), int(PARENT, 16), True)
    for not_text in (None, 3, b"x", ["a"]):
        assert core.parse_traceparent(not_text) is None  # type: ignore[arg-type]


@pytest.fixture(params=["parentbased_always_on", "always_on", "parentbased_traceidratio"])
def traced(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[runtime.Runtime]:
    environ = {"RPC_OBSERVE_DIR": str(tmp_path), "OTEL_TRACES_EXPORTER": "none", "RPC_OBSERVE_PROFILER_EVENTS": "0",
               "RPC_OBSERVE_METRICS": "0", "OTEL_BSP_SCHEDULE_DELAY": "3600000", "OTEL_TRACES_SAMPLER": request.param,
               "OTEL_TRACES_SAMPLER_ARG": "0.5"}
    cfg = config.load(environ)
    rt = runtime.Runtime(cfg, "worker0", 0)
    rt.tracer = tracing.Tracer(cfg, [])
    runtime.current = rt
    yield rt
    runtime.current = None
    calls.take_pending_reply()
    rt.close()


def udf_with(context: list[str] | None) -> PythonUDF:
    udf = pickler._tuple_new(pickler._IncomingUDF, PythonUDF(noop, (), {}))
    if context is not None:
        udf.rpc_observe_fields = ["q", "worker1", "sync", "7", *context]
        udf.rpc_observe_start = 0.0
    return udf


CONTEXTS: dict[str, list[str] | None] = {
    "valid sampled": [VALID],
    "valid unsampled": [VALID[:-2] + "00"],
    "valid flags 03": [VALID[:-2] + "03"],
    "with baggage": [VALID, "baggage=k=v"],
    "malformed": [VALID.upper()],
    "zero trace id": [f"traceparent=00-{'0' * 32}-{PARENT}-01"],
    "another key": ["tracestate=a=b"],
    "empty": [],
    "no fields": None,
}


def run_once(rt: runtime.Runtime, context: list[str] | None, outer: Any) -> dict[str, Any]:
    """One run of the wrapped `_run_function`: the span it queued (all fields), the parent a client span the
    UDF starts gets, the thread's entry after the run, the errors and invalid contexts counted."""
    tracer = rt.tracer
    assert tracer is not None
    ident = threading.get_ident()
    if outer is not None:
        tracer.serving[ident] = outer
    seen: dict[str, Any] = {}

    def udf_body(python_udf: Any) -> str:
        child = tracer.start_client("child", {}, 1)
        seen["child"] = (child.trace_id, child.parent_id)
        return "result"

    errors, invalid = dict(health.internal_errors), health.invalid_contexts[0]
    assert server.wrap_run_function(udf_body)(udf_with(context)) == "result"
    spans = list(tracer._queue)
    tracer._queue.clear()
    after = tracer.serving.pop(ident, None)
    return {
        "spans": [(type(s), {name: getattr(s, name) for name in tracing.SpanRecord.__slots__}) for s in spans],
        "child": seen["child"],
        "after_is_outer": after is outer,
        "new_errors": {k: v - errors.get(k, 0) for k, v in health.internal_errors.items() if v != errors.get(k, 0)},
        "new_invalid_contexts": health.invalid_contexts[0] - invalid,
    }


@pytest.fixture
def c_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The C `_run_function` with the test's clock and ids, whatever the fixtures of other tests left."""
    if core is None:
        pytest.skip("the C core is not built here")
    clock = iter(range(1_000, 10**9, 1_000))
    monkeypatch.setattr(pickler, "_time_ns", lambda: next(clock))
    monkeypatch.setattr(server, "_time_ns", pickler._time_ns)
    monkeypatch.setattr(server, "_core", core)
    pickler.configure_core(lambda: pickler._time_ns(), lambda: pickler._perf_counter())
    server.configure_spans(lambda bits: tracing._getrandbits(bits))
    yield
    pickler.configure_core(time.time_ns, time.perf_counter)
    server.configure_spans()


@pytest.mark.parametrize("nested", [False, True], ids=["alone", "nested"])
@pytest.mark.parametrize("name", CONTEXTS)
@pytest.mark.parametrize("provider", [False, True], ids=["no_provider", "provider"])
@pytest.mark.parametrize("table", ["dict", "c_table"])
def test_the_c_server_span_is_the_tracers(traced: runtime.Runtime, c_server: None, monkeypatch: pytest.MonkeyPatch,
                                          name: str, nested: bool, provider: bool, table: str) -> None:
    """The C `_run_function`'s SERVER span against the tracer's methods, the span by thread kept in the tracer's
    reference dict or in the C table that hooks.attach gives it."""
    if table == "c_table":
        monkeypatch.setattr(traced.tracer, "serving", core.serving_spans)  # type: ignore[union-attr]

    def run(python: bool) -> dict[str, Any]:
        ids = iter(range(1, 10_000))
        clock = iter(range(1_000, 10**9, 1_000))
        monkeypatch.setattr(tracing, "_getrandbits", lambda bits: next(ids) * (3 if bits == 128 else 1))
        monkeypatch.setattr(pickler, "_time_ns", lambda: next(clock))
        monkeypatch.setattr(server, "_time_ns", pickler._time_ns)
        monkeypatch.setattr(server, "_core", None if python else core)
        return run_once(traced, CONTEXTS[name], outer)

    if provider:  # the span becomes the current OpenTelemetry span instead of a per-thread entry
        monkeypatch.setattr(trace, "_TRACER_PROVIDER", trace.NoOpTracerProvider())
    outer = tracing.SpanRecord("outer", tracing.SERVER, 99, 98, 0, False, True, {}, 1) if nested else None
    got = run(python=False)
    assert got == run(python=True)
    if traced.config.sampler == "parentbased_always_on":  # the caller's flag decides, a new trace is sampled
        assert bool(got["spans"]) == ("unsampled" not in name)
    assert got["after_is_outer"] and not got["new_errors"]
    if got["spans"] and not (provider and nested):  # (a per-thread outer entry exists only without a provider)
        assert got["child"][1] == got["spans"][0][1]["span_id"]  # the UDF's client span is the SERVER span's child
    if name == "valid sampled" and traced.config.sampler == "parentbased_always_on":
        first = got["spans"][0][1]
        assert (first["trace_id"], first["span_id"], first["parent_id"]) == (int(TRACE, 16), 1, int(PARENT, 16))
    assert got["new_invalid_contexts"] == (1 if name in ("malformed", "zero trace id", "another key") else 0)


SITUATIONS = ["root", "in a served UDF", "an OpenTelemetry span current", "baggage current", "a sampled-out parent"]
SAMPLERS = ["parentbased_always_on", "always_on", "parentbased_traceidratio", "rpc_observe_ratelimit",
            "always_off"]


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("situation", SITUATIONS)
@pytest.mark.parametrize("propagators", ["tracecontext,baggage", "none"])
@pytest.mark.parametrize("table", ["dict", "c_table"])
def test_the_c_client_span_and_its_context_are_the_tracers(tmp_path: Path, c_server: None,
                                                           monkeypatch: pytest.MonkeyPatch, sampler: str,
                                                           situation: str, propagators: str, table: str) -> None:
    from opentelemetry import baggage, context
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    from rpc_observe.hooks.client import ClientSite

    environ = {"RPC_OBSERVE_DIR": str(tmp_path), "OTEL_TRACES_EXPORTER": "none", "RPC_OBSERVE_PROFILER_EVENTS": "0",
               "RPC_OBSERVE_METRICS": "0", "OTEL_BSP_SCHEDULE_DELAY": "3600000", "OTEL_TRACES_SAMPLER": sampler,
               "OTEL_TRACES_SAMPLER_ARG": "0.5", "OTEL_PROPAGATORS": propagators}
    cfg = config.load(environ)
    rt = runtime.Runtime(cfg, "worker0", 0)
    rt.tracer = tracing.Tracer(cfg, [])
    if table == "c_table":  # the SERVER span by thread in the C table hooks.attach gives the tracer
        rt.tracer.serving = core.serving_spans  # type: ignore[union-attr]
    runtime.current = rt
    site = ClientSite(rt, noop, "sync", "worker1")
    monkeypatch.setattr(calls, "_time_ns", lambda: 1_700_000_000_000_000_000)  # the Python Call's clock
    monkeypatch.setattr(pickler, "_time_ns", calls._time_ns)  # the C one's (c_server)
    ident = threading.get_ident()
    token = None
    if situation == "in a served UDF":
        rt.tracer.serving[ident] = tracing.SpanRecord("udf", tracing.SERVER, 77, 66, 5, True, True, {}, 1)
    elif situation == "a sampled-out parent":
        rt.tracer.serving[ident] = tracing.SpanRecord("udf", tracing.SERVER, 77, 66, 5, True, False, {}, 1)
    elif situation == "an OpenTelemetry span current":
        parent = SpanContext(0xABC, 0xDEF, True, TraceFlags(TraceFlags.SAMPLED))
        token = context.attach(trace.set_span_in_context(NonRecordingSpan(parent)))
    elif situation == "baggage current":
        token = context.attach(baggage.set_baggage("k", "v"))
    try:
        made = []
        for make in (calls.Call, core.new_call):
            ids = iter(range(1, 10_000))
            monkeypatch.setattr(tracing, "_getrandbits",
                                lambda bits, ids=ids: next(ids) * (2**70 + 3 if bits == 128 else 1))
            if rt.tracer._limiter is not None:  # a full bucket each way
                rt.tracer._limiter = tracing.RateLimiter(0.5)
            call = make(rt, site)
            span = call.span
            # the context the request carries: the serialize Hook's trailer (C) against Tracer.context_text
            calls.set_current_call(call)
            monkeypatch.setattr(pickler, "_core", core if make is core.new_call else None)
            data, _ = pickler.wrap_serialize(lambda self, o: (b"PICKLE.", []))(None, PythonUDF(noop, (), {}))
            calls.set_current_call(None)
            _, fields = trailer.split(data)
            assert fields is not None
            made.append((type(span), {name: getattr(span, name) for name in tracing.SpanRecord.__slots__},
                         fields[trailer.CONTEXT:], rt.tracer.context_text(span)))
            calls.in_flight.clear()
        assert made[0] == made[1]
        assert made[0][2] == (made[0][3].split(trailer.SEP) if made[0][3] else [])  # Tracer.context_text's
        if situation == "in a served UDF":
            assert made[0][1]["trace_id"] == 77 and made[0][1]["parent_id"] == 66
    finally:
        calls.set_current_call(None)
        if token is not None:
            context.detach(token)
        rt.tracer.serving.pop(ident, None)
        runtime.current = None
        rt.close()


@pytest.mark.parametrize("trace_id, span_id, sampled", [
    (int(TRACE, 16), int(PARENT, 16), True), (1, 1, False), ((1 << 128) - 1, (1 << 64) - 1, True),
    (1 << 128, 1, True), (1, 1 << 64, True), (-1, 5, True), (5, -1, False), (True, 7, True), (7, 7, 1),
])
def test_the_c_traceparent_entry_is_the_format(tmp_path: Path, c_server: None, trace_id: int, span_id: int,
                                               sampled: Any) -> None:
    """The request's traceparent entry written inline in C is TRACEPARENT_ENTRY_FORMAT's, for ids at and past
    the edges of their widths (those the C code does not write go to the format: the same text either way)."""
    from rpc_observe.hooks.client import ClientSite

    environ = {"RPC_OBSERVE_DIR": str(tmp_path), "OTEL_TRACES_EXPORTER": "none", "RPC_OBSERVE_PROFILER_EVENTS": "0",
               "RPC_OBSERVE_METRICS": "0", "OTEL_BSP_SCHEDULE_DELAY": "3600000"}
    cfg = config.load(environ)
    rt = runtime.Runtime(cfg, "worker0", 0)
    rt.tracer = tracing.Tracer(cfg, [])
    runtime.current = rt
    try:
        call = core.new_call(rt, ClientSite(rt, noop, "sync", "worker1"))
        call.span = tracing.SpanRecord("f", tracing.CLIENT, trace_id, span_id, 0, False, sampled, {}, 1)
        calls.set_current_call(call)
        data, _ = pickler.wrap_serialize(lambda self, o: (b"PICKLE.", []))(None, PythonUDF(noop, (), {}))
        _, fields = trailer.split(data)
        assert fields is not None
        expected = propagation.TRACEPARENT_ENTRY_FORMAT % (trace_id, span_id, propagation.FLAGS[sampled])
        assert fields[trailer.CONTEXT:] == [expected] == [rt.tracer.context_text(call.span)]
    finally:
        calls.set_current_call(None)
        calls.in_flight.clear()
        runtime.current = None
        rt.close()


def test_a_full_span_queue_drops_and_counts_either_way(tmp_path: Path, c_server: None,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    environ = {"RPC_OBSERVE_DIR": str(tmp_path), "OTEL_TRACES_EXPORTER": "none", "RPC_OBSERVE_PROFILER_EVENTS": "0",
               "RPC_OBSERVE_METRICS": "0", "OTEL_BSP_SCHEDULE_DELAY": "3600000", "OTEL_BSP_MAX_QUEUE_SIZE": "2"}
    cfg = config.load(environ)
    rt = runtime.Runtime(cfg, "worker0", 0)
    rt.tracer = tracing.Tracer(cfg, [])
    runtime.current = rt
    try:
        outcomes = []
        for python in (False, True):
            monkeypatch.setattr(server, "_core", None if python else core)
            dropped = health.spans_dropped["queue_full"]
            for _ in range(5):
                assert server.wrap_run_function(lambda python_udf: 1)(udf_with([VALID])) == 1
            outcomes.append((len(rt.tracer._queue), health.spans_dropped["queue_full"] - dropped,
                             [s.end_ns > 0 for s in rt.tracer._queue]))
            rt.tracer._queue.clear()
        assert outcomes[0] == outcomes[1] == (2, 3, [True, True])
    finally:
        runtime.current = None
        calls.take_pending_reply()
        rt.close()


def test_a_span_type_other_than_span_records_is_refused(c_server: None) -> None:
    """The C core writes a span's slots where SpanRecord's __slots__ put them: any other type is refused."""

    class Other:
        __slots__ = ("name", "kind")

    for wrong in (tuple, Other, type("Sub", (tracing.SpanRecord,), {"__slots__": ()})):
        with pytest.raises(TypeError, match="SpanRecord"):
            core.configure_spans(wrong, random.getrandbits, trace, tracing._get_current, tracing._SPAN_KEY,
                                 tracing._BAGGAGE_KEY, tracing._TRACEPARENT_ENTRY_FORMAT, tracing._FLAGS)


@needs_c
def test_the_c_ids_are_random_and_a_forked_child_draws_its_own() -> None:
    """The ids the C paths draw without a configured source (`random.getrandbits` is the reference): in range, no
    repeats, the low 64 bits of trace ids (what a ratio sampler reads) spread evenly; a forked child, like `random`,
    is seeded again and never draws the parent's next ids."""
    assert core is not None
    spans = [core.random_id(64) for _ in range(20_000)]
    traces = [core.random_id(128) for _ in range(20_000)]
    assert len(set(spans)) == len(spans) and len(set(traces)) == len(traces)
    assert all(0 <= i < 2**64 for i in spans) and all(0 <= i < 2**128 for i in traces)
    assert sum(i >= 2**127 for i in traces) == pytest.approx(10_000, abs=500)  # each half of the range
    assert sum((i & (2**64 - 1)) < 2**62 for i in traces) == pytest.approx(5_000, abs=400)  # a ratio of 0.25
    with pytest.raises(ValueError):
        core.random_id(32)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        try:
            os.write(write, ",".join(str(core.random_id(64)) for _ in range(4)).encode())
        finally:
            os._exit(0)
    os.close(write)
    child = [int(i) for i in os.read(read, 4096).decode().split(",")]
    os.close(read)
    os.waitpid(pid, 0)
    assert len(child) == 4 and not set(child) & {core.random_id(64) for _ in range(4)}


def test_the_c_client_span_of_a_new_trace_samples_its_ratio(tmp_path: Path, c_server: None) -> None:
    """Configured as at import (the core's own ids), the C `_invoke_rpc`'s root spans sample the ratio that
    OTEL_TRACES_SAMPLER_ARG asks for, from ids in full range."""
    from rpc_observe.hooks.client import ClientSite

    server.configure_spans()  # the core's own draw (the fixture's is the test's ids)
    environ = {"RPC_OBSERVE_DIR": str(tmp_path), "OTEL_TRACES_EXPORTER": "none", "RPC_OBSERVE_PROFILER_EVENTS": "0",
               "RPC_OBSERVE_METRICS": "0", "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"}
    rt = runtime.Runtime(config.load(environ), "worker0", 0)
    rt.tracer = tracing.Tracer(rt.config, [])
    site = ClientSite(rt, noop, "sync", "worker1")
    try:
        made = [core.new_call(rt, site).span for _ in range(8_000)]  # type: ignore[union-attr]
    finally:
        rt.close()
    assert len({s.trace_id for s in made}) == len(made) and len({s.span_id for s in made}) == len(made)
    assert max(s.trace_id for s in made) >= 2**126 and all(s.parent_id == 0 for s in made)
    assert sum(s.sampled for s in made) == pytest.approx(2_000, abs=250)


CHANGES: list[tuple[str, Any]] = [
    ("_propagates", False), ("_propagates", True), ("_root_bound", 0), ("_root_bound", 1 << 64),
    ("_root_bound", (1 << 64) - 1), ("_root_bound", 1 << 63), ("_root_bound", -1), ("_root_bound", 3.5),
    ("_limiter", "a limiter"), ("_limiter", None), ("_fast_propagation", False), ("_max_queue", 0),
    ("_max_queue", 100), ("serving", "the C table"), ("_queue", "a new deque"),
]


def test_a_tracer_setting_set_again_reaches_the_c_paths(tmp_path: Path, c_server: None,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The C span paths read the tracer's settings once per tracer (Tracer.__setattr__ tells them to read them anew):
    after each change, made after C spans have read the settings, a C root CLIENT span, its context and a C SERVER
    span's queueing are the Python paths'."""
    from rpc_observe.hooks.client import ClientSite

    environ = {"RPC_OBSERVE_DIR": str(tmp_path), "OTEL_TRACES_EXPORTER": "none", "RPC_OBSERVE_PROFILER_EVENTS": "0",
               "RPC_OBSERVE_METRICS": "0", "OTEL_BSP_SCHEDULE_DELAY": "3600000",
               "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.5"}
    cfg = config.load(environ)
    rt = runtime.Runtime(cfg, "worker0", 0)
    tracer = rt.tracer = tracing.Tracer(cfg, [])
    runtime.current = rt
    site = ClientSite(rt, noop, "sync", "worker1")
    try:
        for name, value in [("", None), *CHANGES]:
            if value == "a limiter":
                value = tracing.RateLimiter(0.5)
            elif value == "the C table":
                value = core.serving_spans  # type: ignore[union-attr]
            elif value == "a new deque":
                value = type(tracer._queue)()
            if name:
                setattr(tracer, name, value)
            made = []
            for c in (False, True):
                ids = iter(range(1, 10_000))
                monkeypatch.setattr(tracing, "_getrandbits", lambda bits, ids=ids: next(ids) * (2**63 + 2**61 + 1))
                if tracer._limiter is not None:  # a full bucket each way
                    object.__setattr__(tracer, "_limiter", tracing.RateLimiter(0.5))  # not a change of setting
                monkeypatch.setattr(pickler, "_core", core if c else None)
                monkeypatch.setattr(server, "_core", core if c else None)
                spans, context = [], []
                for _ in range(3):
                    call = (core.new_call if c else calls.Call)(rt, site)  # type: ignore[union-attr]
                    calls.set_current_call(call)
                    data, _ = pickler.wrap_serialize(lambda self, o: (b"P.", []))(None, PythonUDF(noop, (), {}))
                    calls.set_current_call(None)
                    spans.append(call.span)
                    context.append(trailer.split(data)[1][trailer.CONTEXT:])  # type: ignore[index]
                for _ in range(2):
                    assert server.wrap_run_function(lambda python_udf: 1)(udf_with([VALID])) == 1
                made.append(([s.sampled for s in spans], context, len(tracer._queue)))
                if not name:  # roots sampled and not, the SERVER spans queued: each change can show
                    assert True in made[-1][0] and False in made[-1][0] and made[-1][2] == 2
                tracer._queue.clear()
            assert made[0] == made[1], (name, value)
    finally:
        calls.set_current_call(None)
        calls.in_flight.clear()
        calls.take_pending_reply()
        runtime.current = None
        rt.close()
