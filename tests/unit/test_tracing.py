"""The Tracer: sampling, context in and out, the bounded queue, flush and shutdown.

Every Tracer is built from `config.load({...})` with an explicit environ and exports to
an in-memory sink; the export thread sleeps an hour (OTEL_BSP_SCHEDULE_DELAY) unless a
test wants it running, so what reaches the sink is decided by the test alone.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from opentelemetry import context, trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from rpc_observe import config
from rpc_observe.telemetry import health, propagation, tracing
from rpc_observe.telemetry.tracing import CLIENT, SERVER, SpanRecord, Tracer

MASK = 2**64 - 1
IDLE = {"OTEL_BSP_SCHEDULE_DELAY": "3600000"}  # the export thread never wakes on its own
ATTRS = {"rpc.method": "f"}


class MemorySink:
    """Keeps exported records in a list; like the SDK's InMemorySpanExporter, refuses exports after shutdown."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.records: list[SpanRecord] = []
        self.batches: list[int] = []
        self.delay_s = delay_s
        self.is_shut_down = False
        self.late: list[SpanRecord] = []  # exported after shutdown: lost

    def export(self, records: Any) -> bool:
        records = list(records)
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.is_shut_down:
            self.late.extend(records)
            return False
        self.records.extend(records)
        self.batches.append(len(records))
        return True

    def shutdown(self) -> None:
        self.is_shut_down = True


TracerFactory = Callable[..., tuple[Tracer, MemorySink]]


@pytest.fixture
def make_tracer() -> Iterator[TracerFactory]:
    """Builds Tracers from explicit environs, each with its own MemorySink; shuts them all down afterwards."""
    made: list[Tracer] = []

    def make(env: dict[str, str] | None = None, sink: MemorySink | None = None,
             clock: Callable[[], float] = time.monotonic) -> tuple[Tracer, MemorySink]:
        sink = sink if sink is not None else MemorySink()
        tracer = Tracer(config.load({**IDLE, **(env or {})}), [sink], clock)
        made.append(tracer)
        return tracer, sink

    yield make
    for tracer in made:
        if not tracer._stopping:
            tracer.shutdown()
        tracer._thread.join(2.0)  # nothing of a test's tracer runs on into the next test


@pytest.fixture
def trace_ids(monkeypatch: pytest.MonkeyPatch) -> Callable[[list[int]], None]:
    """Makes the tracer's random ids deterministic: trace ids from the given list, span ids 1, 2, 3..."""

    def use(ids: list[int]) -> None:
        trace_iter, span_iter = iter(ids), itertools.count(1)

        def getrandbits(bits: int) -> int:
            return next(trace_iter) if bits == 128 else next(span_iter)

        monkeypatch.setattr(tracing, "_getrandbits", getrandbits)

    return use


def with_parent(trace_id: int, span_id: int, sampled: bool, remote: bool = False) -> object:
    """Attaches a current OpenTelemetry span with this context; returns the token for context.detach."""
    flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
    span = NonRecordingSpan(SpanContext(trace_id, span_id, remote, flags))
    return context.attach(trace.set_span_in_context(span))


def deterministic_ids(ratio: float) -> list[int]:
    """Trace ids around the ratio's bound and at the ends of the low 64 bits, with random high bits, plus 300
    seeded random ones."""
    rng = random.Random(20240611)
    bound = int(ratio * 2**64)
    lows = [0, 1, MASK - 1, MASK, 2**63 - 1, 2**63] + [b for b in (bound - 1, bound, bound + 1) if 0 <= b <= MASK]
    ids = [(rng.getrandbits(64) << 64) | low for low in lows]
    ids += [rng.getrandbits(128) for _ in range(300)]
    return ids


# -- sampling ---------------------------------------------------------------------


@pytest.mark.parametrize("sampler, expected", [("always_on", True), ("always_off", False),
                                               ("parentbased_always_on", True), ("parentbased_always_off", False)])
def test_fixed_samplers_decide_every_root_span(make_tracer: TracerFactory, sampler: str, expected: bool) -> None:
    tracer, sink = make_tracer({"OTEL_TRACES_SAMPLER": sampler})
    spans = [tracer.start_client("c", ATTRS, 10) for _ in range(20)]
    spans += [tracer.start_server("s", ATTRS, None, 10) for _ in range(20)]
    assert [s.sampled for s in spans] == [expected] * 40
    for span in spans:
        tracer.end(span, 20)
    assert tracer.flush(2.0) is True
    assert len(sink.records) == (40 if expected else 0)
    assert sum(health.spans_dropped.values()) == 0


@pytest.mark.parametrize("sampler", ["traceidratio", "parentbased_traceidratio"])
@pytest.mark.parametrize("ratio", [0.0, 0.001, 0.1, 0.25, 0.5, 0.9, 1.0])
def test_traceidratio_decides_on_the_low_64_bits(make_tracer: TracerFactory, trace_ids: Callable[[list[int]], None],
                                                  sampler: str, ratio: float) -> None:
    tracer, _ = make_tracer({"OTEL_TRACES_SAMPLER": sampler, "OTEL_TRACES_SAMPLER_ARG": str(ratio)})
    assert tracer._config.sampler_ratio == ratio
    ids = deterministic_ids(ratio)
    trace_ids(ids + ids)
    clients = [tracer.start_client("c", ATTRS, 1) for _ in ids]
    servers = [tracer.start_server("s", ATTRS, None, 1) for _ in ids]
    expected = [(tid & MASK) < ratio * 2**64 for tid in ids]
    assert [s.trace_id for s in clients] == ids and [s.trace_id for s in servers] == ids
    assert [s.sampled for s in clients] == expected
    assert [s.sampled for s in servers] == expected
    if 0.0 < ratio < 1.0:  # the set is not trivially all-in or all-out
        assert 0 < sum(expected) < len(expected)


@pytest.mark.parametrize("sampler", ["parentbased_always_on", "parentbased_always_off",
                                     "parentbased_traceidratio"])
@pytest.mark.parametrize("parent_sampled", [True, False])
@pytest.mark.parametrize("remote", [False, True])
def test_parentbased_client_follows_the_current_otel_span(make_tracer: TracerFactory, sampler: str,
                                                          parent_sampled: bool, remote: bool) -> None:
    # Ratio 0 and a trace id whose low half is all ones: the root sampler alone would say no.
    tracer, sink = make_tracer({"OTEL_TRACES_SAMPLER": sampler, "OTEL_TRACES_SAMPLER_ARG": "0.0"})
    trace_id, span_id = (0x1234 << 64) | MASK, 0xABCDEF
    token = with_parent(trace_id, span_id, parent_sampled, remote)
    try:
        span = tracer.start_client("c", ATTRS, 5)
    finally:
        context.detach(token)
    assert (span.kind, span.trace_id, span.parent_id, span.remote_parent) == (CLIENT, trace_id, span_id, remote)
    assert span.sampled is parent_sampled
    assert span.span_id not in (0, span_id)
    tracer.end(span, 6)
    tracer.flush(2.0)
    assert [r.span_id for r in sink.records] == ([span.span_id] if parent_sampled else [])
    root = tracer.start_client("c", ATTRS, 7)  # detached: a new trace again
    assert root.parent_id == 0 and root.trace_id != trace_id


@pytest.mark.parametrize("sampler, parent_sampled, expected", [
    ("always_on", False, True), ("always_off", True, False), ("traceidratio", True, False),
])
def test_non_parentbased_samplers_ignore_the_parent(make_tracer: TracerFactory, sampler: str, parent_sampled: bool,
                                                    expected: bool) -> None:
    tracer, _ = make_tracer({"OTEL_TRACES_SAMPLER": sampler, "OTEL_TRACES_SAMPLER_ARG": "0.5"})
    trace_id = MASK  # low half above 0.5 * 2**64
    token = with_parent(trace_id, 7, parent_sampled)
    try:
        client = tracer.start_client("c", ATTRS, 1)
    finally:
        context.detach(token)
    server = tracer.start_server("s", ATTRS, [f"traceparent=00-{trace_id:032x}-{7:016x}-0{int(parent_sampled)}"], 1)
    assert (client.sampled, server.sampled) == (expected, expected)
    assert (client.parent_id, server.parent_id, server.trace_id) == (7, 7, trace_id)


@pytest.mark.parametrize("sampler", ["parentbased_always_on", "parentbased_always_off"])
@pytest.mark.parametrize("flags, sampled", [("01", True), ("00", False), ("03", True), ("02", False)])
def test_parentbased_server_follows_the_traceparent(make_tracer: TracerFactory, sampler: str, flags: str,
                                                    sampled: bool) -> None:
    tracer, sink = make_tracer({"OTEL_TRACES_SAMPLER": sampler})
    trace_id, span_id = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331
    span = tracer.start_server("s", ATTRS, [f"traceparent=00-{trace_id:032x}-{span_id:016x}-{flags}"], 100)
    assert (span.kind, span.trace_id, span.parent_id, span.remote_parent) == (SERVER, trace_id, span_id, True)
    assert span.sampled is sampled and span.start_ns == 100
    assert health.invalid_contexts[0] == 0
    tracer.end(span, 200)
    tracer.flush(2.0)
    assert len(sink.records) == int(sampled)


def test_server_context_through_the_propagators(make_tracer: TracerFactory) -> None:
    """More than a traceparent (baggage too): the context goes through opentelemetry.propagate."""
    tracer, _ = make_tracer({"OTEL_TRACES_SAMPLER": "parentbased_always_on"})
    traceparent = propagation.format_traceparent(0xFEED, 0xBEEF, False)
    span = tracer.start_server("s", ATTRS, [f"traceparent={traceparent}", "baggage=k=v"], 1)
    assert (span.trace_id, span.parent_id, span.sampled) == (0xFEED, 0xBEEF, False)
    assert health.invalid_contexts[0] == 0


def test_client_context_text_names_the_client_span(make_tracer: TracerFactory) -> None:
    tracer, _ = make_tracer()
    span = tracer.start_client("c", ATTRS, 1)
    text = tracer.context_text(span)
    assert text == f"traceparent=00-{span.trace_id:032x}-{span.span_id:016x}-01"
    server = tracer.start_server("s", ATTRS, text.split(propagation.SEP), 2)
    assert (server.trace_id, server.parent_id, server.sampled) == (span.trace_id, span.span_id, True)
    off, _ = make_tracer({"OTEL_PROPAGATORS": "none"})
    assert off.context_text(span) == ""


GARBAGE = [
    "traceparent=garbage",
    "traceparent=",
    "traceparent=00-" + "g" * 32 + "-" + "b" * 16 + "-01",  # not hex
    "traceparent=00-" + "A" * 32 + "-" + "b" * 16 + "-01",  # upper case
    "traceparent=00-" + "0" * 32 + "-" + "b" * 16 + "-01",  # all-zero trace id
    "traceparent=00-" + "a" * 32 + "-" + "0" * 16 + "-01",  # all-zero span id
    "traceparent=ff-" + "a" * 32 + "-" + "b" * 16 + "-01",  # version ff is invalid
    "traceparent=00-" + "a" * 31 + "-" + "b" * 16 + "-01",  # short trace id
    "traceparent=00-" + "a" * 32 + "-" + "b" * 16 + "-01-",  # trailing dash on version 00
    "traceparent=00_" + "a" * 32 + "_" + "b" * 16 + "_01",
    "nonsense",
    "",
]


@pytest.mark.parametrize("entry", GARBAGE)
def test_garbage_context_starts_a_new_trace_and_is_counted(make_tracer: TracerFactory,
                                                           trace_ids: Callable[[list[int]], None], entry: str) -> None:
    tracer, _ = make_tracer({"OTEL_TRACES_SAMPLER": "parentbased_always_off"})
    new_trace = (0x5EED << 64) | 3
    trace_ids([new_trace])
    span = tracer.start_server("s", ATTRS, [entry], 1)
    assert (span.trace_id, span.parent_id, span.kind) == (new_trace, 0, SERVER)
    assert span.sampled is False  # a root under parentbased_always_off: the garbage's flags are not followed
    assert health.invalid_contexts[0] == 1


@pytest.mark.parametrize("entry", GARBAGE + ["traceparent=00-" + "a" * 32 + "-" + "b" * 16 + f"-{flags}"
                                           for flags in ("00", "01", "02", "03", "0f", "fe", "ff")])
def test_the_inline_traceparent_parse_agrees_with_parse_traceparent(make_tracer: TracerFactory, entry: str) -> None:
    """start_server parses a lone traceparent inline (the callee's hot path): the same as the reference parser."""
    tracer, _ = make_tracer()
    span = tracer.start_server("s", ATTRS, [entry], 1)
    expected = propagation.parse_traceparent(entry[12:]) if entry.startswith("traceparent=") else None
    if expected is None:
        assert span.parent_id == 0 and health.invalid_contexts[0] == 1
    else:
        assert (span.trace_id, span.parent_id, span.sampled) == expected and health.invalid_contexts[0] == 0


@pytest.mark.parametrize("entries", [["traceparent=00-" + "0" * 32 + "-" + "b" * 16 + "-01", "baggage=k=v"],
                                     ["traceparent=zzz", "tracestate=a=b"]])
def test_garbage_context_through_the_propagators_is_counted(make_tracer: TracerFactory, entries: list[str]) -> None:
    tracer, _ = make_tracer()
    span = tracer.start_server("s", ATTRS, entries, 1)
    assert span.parent_id == 0 and span.trace_id != 0 and span.sampled is True
    assert health.invalid_contexts[0] == 1


@pytest.mark.parametrize("ctx", [None, []])
def test_no_context_is_not_an_invalid_context(make_tracer: TracerFactory, ctx: list[str] | None) -> None:
    tracer, _ = make_tracer()
    span = tracer.start_server("s", ATTRS, ctx, 1)
    assert span.parent_id == 0 and span.sampled is True
    assert health.invalid_contexts[0] == 0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def roots(tracer: Tracer, n: int) -> list[bool]:
    """Sampling decisions of n new traces, alternately started as client and as server (no context) roots."""
    return [(tracer.start_client("c", ATTRS, 1) if i % 2 else tracer.start_server("s", ATTRS, None, 1)).sampled
            for i in range(n)]


def test_rate_limited_sampler_starts_at_most_n_traces_per_second(make_tracer: TracerFactory) -> None:
    clock = FakeClock()
    tracer, sink = make_tracer({"OTEL_TRACES_SAMPLER": "parentbased_rpc_observe_ratelimit",
                                "OTEL_TRACES_SAMPLER_ARG": "5"}, clock=clock)
    assert roots(tracer, 20) == [True] * 5 + [False] * 15  # a burst of 5, then none
    clock.now += 0.2
    assert roots(tracer, 3) == [True, False, False]  # 5/s: one more every 0.2 s
    clock.now += 0.1
    assert roots(tracer, 3) == [False] * 3
    clock.now += 0.1
    assert roots(tracer, 3) == [True, False, False]
    clock.now += 3600  # an idle hour does not save up an hour of traces
    assert roots(tracer, 20).count(True) == 5
    for second in range(10):  # steady overload: 5 per second, every second
        clock.now += 1.0
        assert roots(tracer, 100).count(True) == 5, second
    assert sum(health.spans_dropped.values()) == 0


def test_rate_limited_sampler_below_one_per_second(make_tracer: TracerFactory) -> None:
    clock = FakeClock()
    tracer, _ = make_tracer({"OTEL_TRACES_SAMPLER": "parentbased_rpc_observe_ratelimit",
                             "OTEL_TRACES_SAMPLER_ARG": "0.5"}, clock=clock)
    assert roots(tracer, 3) == [True, False, False]
    clock.now += 1.0
    assert roots(tracer, 1) == [False]
    clock.now += 1.0
    assert roots(tracer, 2) == [True, False]


def test_rate_limited_sampler_children_follow_their_parent_and_take_no_token(make_tracer: TracerFactory) -> None:
    clock = FakeClock()
    tracer, sink = make_tracer({"OTEL_TRACES_SAMPLER": "parentbased_rpc_observe_ratelimit",
                                "OTEL_TRACES_SAMPLER_ARG": "2"}, clock=clock)
    first, second, third = (tracer.start_client("root", ATTRS, 1) for _ in range(3))
    assert (first.sampled, second.sampled, third.sampled) == (True, True, False)
    for parent in (first, third):  # the bucket is empty: children follow anyway, both ways
        for _ in range(10):
            server = tracer.start_server("s", ATTRS, tracer.context_text(parent).split(propagation.SEP), 2)
            assert (server.trace_id, server.parent_id, server.sampled) == (parent.trace_id, parent.span_id,
                                                                           parent.sampled)
            token = tracer.attach(server)  # a nested call made by the UDF
            try:
                nested = tracer.start_client("nested", ATTRS, 3)
            finally:
                tracer.detach(token)
            assert (nested.trace_id, nested.sampled) == (parent.trace_id, parent.sampled)
        token = with_parent(parent.trace_id, parent.span_id, parent.sampled)  # an OpenTelemetry parent
        try:
            assert tracer.start_client("c", ATTRS, 4).sampled is parent.sampled
        finally:
            context.detach(token)
    clock.now += 0.5  # one token back: the 40 children took none
    assert roots(tracer, 2) == [True, False]


def test_rate_limited_sampler_without_parentbased_limits_every_span(make_tracer: TracerFactory) -> None:
    """Documented: the plain form ignores the caller's decision, so a callee may keep half a trace."""
    tracer, _ = make_tracer({"OTEL_TRACES_SAMPLER": "rpc_observe_ratelimit", "OTEL_TRACES_SAMPLER_ARG": "1"},
                            clock=FakeClock())
    root = tracer.start_client("c", ATTRS, 1)
    server = tracer.start_server("s", ATTRS, tracer.context_text(root).split(propagation.SEP), 2)
    assert (root.sampled, server.sampled, server.parent_id) == (True, False, root.span_id)


def test_rate_limited_sampler_is_exact_across_threads(make_tracer: TracerFactory) -> None:
    tracer, _ = make_tracer({"OTEL_TRACES_SAMPLER": "parentbased_rpc_observe_ratelimit",
                             "OTEL_TRACES_SAMPLER_ARG": "100"}, clock=FakeClock())
    decisions: list[bool] = []

    def start() -> None:
        decisions.extend(roots(tracer, 500))

    threads = [threading.Thread(target=start) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(decisions) == 4000 and decisions.count(True) == 100


def test_rate_limiter_with_the_real_clock() -> None:
    limiter = tracing.RateLimiter(1000.0)
    taken = sum(limiter.take() for _ in range(5000))
    assert 1000 <= taken < 1500  # the burst, plus what refilled while this loop ran


# -- ending, the queue, flush -------------------------------------------------------


def test_end_sets_times_and_error(make_tracer: TracerFactory) -> None:
    tracer, sink = make_tracer({"RPC_OBSERVE_MAX_EXCEPTION_MESSAGE": "5"})
    ok, failed, typed = (tracer.start_client("c", ATTRS, 10) for _ in range(3))
    tracer.end(ok, 11)
    tracer.end(failed, 12, ValueError("0123456789"))
    tracer.end(typed, 13, "remote says no", "KeyError")
    assert tracer.flush(2.0) is True
    assert [(r.end_ns, r.error_type, r.error_message) for r in sink.records] == [
        (11, None, None), (12, "ValueError", "01234"), (13, "KeyError", "remot")]
    assert sink.records[0].attributes is ATTRS  # shared, never copied


def test_full_queue_drops_and_counts(make_tracer: TracerFactory) -> None:
    tracer, sink = make_tracer({"OTEL_BSP_MAX_QUEUE_SIZE": "3"})
    spans = [tracer.start_client(f"c{i}", ATTRS, i) for i in range(8)]
    for span in spans:
        tracer.end(span, 100)
    assert health.spans_dropped["queue_full"] == 5
    assert tracer.flush(2.0) is True
    assert [r.name for r in sink.records] == ["c0", "c1", "c2"]
    for span in [tracer.start_client("again", ATTRS, 1) for _ in range(4)]:  # room again after the flush
        tracer.end(span, 2)
    assert health.spans_dropped["queue_full"] == 6
    tracer.flush(2.0)
    assert [r.name for r in sink.records].count("again") == 3


def test_unsampled_spans_are_neither_queued_nor_dropped(make_tracer: TracerFactory) -> None:
    tracer, sink = make_tracer({"OTEL_TRACES_SAMPLER": "always_off", "OTEL_BSP_MAX_QUEUE_SIZE": "1"})
    for _ in range(5):
        tracer.end(tracer.start_client("c", ATTRS, 1), 2)
    tracer.flush(2.0)
    assert sink.records == [] and sum(health.spans_dropped.values()) == 0


def test_flush_exports_everything_queued_in_batches(make_tracer: TracerFactory) -> None:
    tracer, sink = make_tracer({"OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "4"})
    spans = [tracer.start_client("c", ATTRS, i) for i in range(10)]
    for span in spans:
        tracer.end(span, 1000 + span.start_ns)
    assert sink.records == []  # nothing leaves before a flush (the export thread sleeps)
    assert tracer.flush(2.0) is True
    assert sink.batches == [4, 4, 2]
    assert [r.span_id for r in sink.records] == [s.span_id for s in spans]
    assert tracer.flush(2.0) is True and sink.batches == [4, 4, 2]  # nothing twice


def test_failed_and_raising_exports_count_dropped_spans(make_tracer: TracerFactory) -> None:
    class Refusing(MemorySink):
        def export(self, records: Any) -> bool:
            return False

    class Raising(MemorySink):
        def export(self, records: Any) -> bool:
            raise OSError("disk full")

    for sink_class, errors in ((Refusing, {}), (Raising, {"span_export": 2})):
        tracer, _ = make_tracer({"OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "2"}, sink_class())
        for _ in range(3):
            tracer.end(tracer.start_client("c", ATTRS, 1), 2)
        assert tracer.flush(2.0) is True
        assert health.spans_dropped == {**dict.fromkeys(health.SPAN_DROP_REASONS, 0), "export_failed": 3}
        assert health.internal_errors == errors
        health.spans_dropped["export_failed"] = 0


def test_flush_of_a_hung_exporter_times_out_and_shutdown_drops(make_tracer: TracerFactory,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    release = threading.Event()

    class Hung(MemorySink):
        def export(self, records: Any) -> bool:
            release.wait(5.0)
            return super().export(records)

    tracer, sink = make_tracer({"OTEL_BSP_EXPORT_TIMEOUT": "100", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "1"}, Hung())
    try:
        for _ in range(3):
            tracer.end(tracer.start_client("c", ATTRS, 1), 2)
        started = time.monotonic()
        assert tracer.flush() is False  # OTEL_BSP_EXPORT_TIMEOUT: 0.1 s
        tracer.shutdown()  # its flush waits 0.1 s at most now
        assert time.monotonic() - started < 0.6  # flush 0.1 s, shutdown's flush and join 0.1 s each
        at_shutdown = health.spans_dropped["timeout"]
        assert f"span export did not finish within 0.1s (OTEL_BSP_EXPORT_TIMEOUT); {at_shutdown} queued" in caplog.text
        assert sink.is_shut_down and sink.records == []
    finally:
        release.set()
        tracer._thread.join(2.0)
        for thread in threading.enumerate():
            if thread.name == "rpc_observe-span-flush":
                thread.join(2.0)
    # The hung exports end after shutdown and are refused: dropped at shutdown or refused later,
    # every span is counted exactly once.
    assert len(sink.late) + at_shutdown == 3 and sink.records == []
    assert health.spans_dropped["timeout"] + health.spans_dropped["export_failed"] == 3


# -- shutdown: the last batch ---------------------------------------------------------


def test_shutdown_writes_the_last_batch(make_tracer: TracerFactory) -> None:
    tracer, sink = make_tracer()
    spans = [tracer.start_server("s", ATTRS, None, i) for i in range(7)]
    for span in spans:
        tracer.end(span, 50)
    tracer.shutdown()
    assert [r.span_id for r in sink.records] == [s.span_id for s in spans]
    assert sink.is_shut_down and sink.late == [] and sum(health.spans_dropped.values()) == 0


def test_shutdown_never_loses_the_last_batch_under_a_running_export_thread(make_tracer: TracerFactory) -> None:
    n, lost = 40, []
    for attempt in range(50):
        sink = MemorySink(delay_s=0.0005)
        tracer, _ = make_tracer({"OTEL_BSP_SCHEDULE_DELAY": "1", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "8"}, sink)
        for i in range(n):
            tracer.end(tracer.start_client("c", ATTRS, i), i + 1)
        tracer.shutdown()
        tracer._thread.join(2.0)  # a batch it exports after shutdown lands in sink.late
        if len(sink.records) != n:
            lost.append((attempt, len(sink.records), len(sink.late)))
    assert lost == []
    assert sum(health.spans_dropped.values()) == 0


def test_shutdown_waits_for_the_batch_the_export_thread_is_exporting(make_tracer: TracerFactory) -> None:
    entered, release = threading.Event(), threading.Event()

    class FirstExportBlocks(MemorySink):
        def export(self, records: Any) -> bool:
            if not entered.is_set():
                entered.set()
                release.wait(2.0)
            return super().export(records)

    sink = FirstExportBlocks()
    tracer, _ = make_tracer({"OTEL_BSP_SCHEDULE_DELAY": "1", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "4"}, sink)
    for i in range(4):
        tracer.end(tracer.start_client("c", ATTRS, i), i + 1)
    assert entered.wait(2.0)  # the export thread is inside sink.export with the batch of 4
    for i in range(3):
        tracer.end(tracer.start_client("d", ATTRS, i), i + 1)
    done = threading.Thread(target=tracer.shutdown)
    done.start()
    time.sleep(0.05)
    release.set()
    done.join(2.0)
    tracer._thread.join(2.0)
    assert len(sink.records) == 7 and sink.late == []


@pytest.mark.parametrize("provider", [False, True], ids=["no_provider", "tracer_provider"])
def test_nested_attach_detach_restores_the_outer_parent(make_tracer: TracerFactory, provider: bool,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A UDF's SERVER span stays the parent of its client spans after an INTERNAL span (a
    dist_autograd.backward inside the UDF) was attached and detached, in both modes."""
    if provider:
        from opentelemetry.sdk.trace import TracerProvider

        monkeypatch.setattr(trace, "_TRACER_PROVIDER", TracerProvider())
    else:
        monkeypatch.setattr(trace, "_TRACER_PROVIDER", None)
    tracer, _ = make_tracer()
    server = tracer.start_server("udf", ATTRS, None, time.time_ns())
    outer = tracer.attach(server)
    for _ in range(3):
        before = tracer.start_client("rpc", ATTRS, time.time_ns())
        internal = tracer.start_internal("dist_autograd.backward", ATTRS, time.time_ns())
        inner = tracer.attach(internal)
        child = tracer.start_client("grad", ATTRS, time.time_ns())
        tracer.detach(inner)
        after = tracer.start_client("rpc", ATTRS, time.time_ns())
        assert (before.parent_id, internal.parent_id, after.parent_id) == (server.span_id,) * 3
        assert child.parent_id == internal.span_id
        assert {before.trace_id, internal.trace_id, child.trace_id, after.trace_id} == {server.trace_id}
    tracer.detach(outer)
    assert tracer.start_client("rpc", ATTRS, time.time_ns()).parent_id == 0  # nothing left attached
    assert not tracer.serving
