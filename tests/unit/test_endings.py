"""The hot paths' inline endings against their references, on the same inputs (as test_trailer.py does for
the trailer): `pickler.deserialize` ends a call whose echoed response it unpickles inline, where
`calls.Call.finish` is the reference; `server._run_function` ends a plain successful UDF run inline, where
`server.Serving.finish` is. Each world (metrics, spans, an armed profiler) ends one call or run each way at
the same clock readings, and everything either way leaves must be the same: metric records and counts,
spans, profiler events, the flight recorder's last finished calls. Real torch objects, no RPC."""

from __future__ import annotations

import collections
import gc
import itertools
import random
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.rpc.internal import PythonUDF, RemoteException

from rpc_observe import config
from rpc_observe.hooks import calls, pickler, server, trailer
from rpc_observe.hooks.client import ClientSite
from rpc_observe.hooks.profiler_events import ProfilerEvents
from rpc_observe.telemetry import health, runtime, tracing
from rpc_observe.telemetry.metrics import ClientCells, Metrics, fold_finished, fold_message, fold_split

START_NS, END_NS = 1_700_000_000_000_000_000, 1_700_000_000_004_000_000
# "+records": the metrics queue their records in the C core's `Records` (as under the hooks), not a deque
WORLDS = ["metrics+spans", "metrics", "spans", "nothing", "metrics+spans+profiler", "metrics+records",
          "metrics+spans+records"]


def noop() -> None:
    pass


@pytest.fixture(params=WORLDS)
def world(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[runtime.Runtime]:
    """A real Runtime with what the world's name says, current for the hooks; spans stay in the tracer's queue,
    metric records in the metrics' (never drained: the test reads them)."""
    name = request.param
    environ = {"RPC_OBSERVE_DIR": str(tmp_path), "OTEL_TRACES_EXPORTER": "none", "RPC_OBSERVE_PROFILER_EVENTS": "0",
               "RPC_OBSERVE_METRICS": "0", "OTEL_BSP_SCHEDULE_DELAY": "3600000"}
    cfg = config.load(environ)
    rt = runtime.Runtime(cfg, "worker0", 0)
    if "metrics" in name:
        rt.metrics = Metrics("worker0", 100)  # as with RPC_OBSERVE_METRICS=1, without serving it
    if "records" in name:
        if trailer.core is None:
            pytest.skip("the C core is not built here")
        rt.metrics.use_queue(trailer.core.Records())  # type: ignore[union-attr]
    if "spans" in name:
        rt.tracer = tracing.Tracer(cfg, [])  # no sink: ended spans wait in its queue, read below
    if "profiler" in name:
        rt.profiler = ProfilerEvents("worker0", "")
        rt.profiler.armed = True
    calls.finished.clear()
    runtime.current = rt
    yield rt
    runtime.current = None
    calls.in_flight.clear()
    calls.finished.clear()
    rt.close()


def _span(span: tracing.SpanRecord) -> tuple[Any, ...]:
    """A span's fields, but its own random id."""
    return (span.name, span.kind, span.parent_id, span.remote_parent, span.sampled, span.attributes, span.start_ns,
            span.end_ns, span.error_type, span.error_message, span.callee_ns)


def _effects(rt: runtime.Runtime, messages: bool = False) -> dict[str, Any]:
    """What the ending left (with `messages`, also every record, messages' too, as "records_all"), taken out of
    the runtime so that the next ending starts from nothing."""
    records = list(rt.metrics._records) if rt.metrics is not None else []
    errors = ({family.declaration.name: {k: list(v) for k, v in family.children.items()}
               for family in (rt.metrics.client_errors, rt.metrics.server_errors)} if rt.metrics is not None else {})
    # a record's span (an exemplar) compared by its fields
    records = [tuple(_span(x) if isinstance(x, tracing.SpanRecord) else x for x in r) for r in records]
    effects = {
        "records": [r for r in records if r[0] is not fold_message],  # the message is counted either way
        "errors": errors,
        "spans": [_span(s) for s in rt.tracer._queue] if rt.tracer is not None else [],
        "profiler": [e[:5] for e in rt.profiler._ring] if rt.profiler is not None else [],  # not the trace ids
        "finished": [(site, start, end, error) for site, _, start, end, error in calls.finished],
        "internal_errors": dict(health.internal_errors),
    }
    if messages:
        effects["records_all"] = records
    if rt.metrics is not None:
        rt.metrics._records.clear()
        for family in (rt.metrics.client_errors, rt.metrics.server_errors):
            family.children.clear()
    if rt.tracer is not None:
        rt.tracer._queue.clear()
    if rt.profiler is not None:
        rt.profiler._ring.clear()
    calls.finished.clear()
    return effects


def _started_call(rt: runtime.Runtime, site: ClientSite, monkeypatch: pytest.MonkeyPatch,
                  rf: Any = None) -> calls.Call:
    """A call in flight; `rf`: its torch profiler event (which its future ends, never the ending)."""
    monkeypatch.setattr(calls, "_time_ns", lambda: START_NS)
    call = calls.Call(rt, site)
    call.rf = rf
    call.id = calls.next_id()
    calls.in_flight[call.id] = call
    if rt.metrics is not None:
        rt.metrics._records.clear()  # the start is not the ending
    return call


RESULTS = {"value": lambda: {"a": 1}, "remote_error": lambda: RemoteException("boom", ValueError)}


@pytest.mark.parametrize("event", [False, True], ids=["", "torch_event"])
@pytest.mark.parametrize("callee_us", ["", "1234"], ids=["no_callee_time", "callee_time"])
@pytest.mark.parametrize("result", RESULTS)
def test_the_response_fast_path_ends_a_call_as_call_finish_does(
        world: runtime.Runtime, codec: str, monkeypatch: pytest.MonkeyPatch, callee_us: str, result: str,
        event: bool) -> None:
    """`event`: the call has torch's own profiler event (a call on a thread Kineto records), which its future
    ends; the ending then keeps none in the ring."""
    site = ClientSite(world, noop, "sync", "worker1")
    obj = RESULTS[result]()
    tensors = [torch.ones(4)]
    rf = object() if event else None
    monkeypatch.setattr(pickler, "_time_ns", lambda: END_NS)

    inline = _started_call(world, site, monkeypatch, rf)
    data = b"RESULT." + trailer.response_trailer(str(inline.id), int(callee_us) if callee_us else -1)
    assert pickler.wrap_deserialize(lambda self, d, t: obj)(None, data, tensors) is obj
    assert inline.id not in calls.in_flight
    fast = _effects(world)

    reference = _started_call(world, site, monkeypatch, rf)
    _, fields = trailer.split(data)  # the reference parser, and the reference ending
    assert fields is not None and int(fields[trailer.RESPONSE_CALL_ID]) == inline.id
    callee_ns = int(fields[trailer.RESPONSE_CALLEE_US]) * 1000 if len(fields) > trailer.RESPONSE_CALLEE_US else -1
    calls.in_flight.pop(reference.id)
    reference.finish(END_NS, calls.remote_error(obj), callee_ns)
    assert fast == _effects(world)

    ended = [world.metrics is not None, world.tracer is not None, world.profiler is not None and not event]
    assert [bool(fast["records"]), bool(fast["spans"]), bool(fast["profiler"])] == ended  # each was seen
    assert fast["finished"] == [(site, START_NS, END_NS, "ValueError" if result == "remote_error" else None)]
    assert not fast["internal_errors"]


def _udf(call_id: str, context: str) -> PythonUDF:
    """A request as the pickler hands it to `_run_function`: the caller's trailer fields attached."""
    udf = pickler._tuple_new(pickler._IncomingUDF, PythonUDF(noop, (), {}))
    udf.rpc_observe_fields = trailer.request_trailer(trailer.request_head("worker1", "sync"), int(call_id),
                                                     context)[:-trailer.OVERHEAD].decode().split(trailer.SEP)
    udf.rpc_observe_start = 0.0
    return udf


@pytest.mark.parametrize("result", RESULTS)
def test_the_plain_udf_ending_is_serving_finish(world: runtime.Runtime, codec: str, monkeypatch: pytest.MonkeyPatch,
                                                result: str) -> None:
    obj = RESULTS[result]()
    context = "traceparent=00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    clock = itertools.chain([START_NS], itertools.repeat(END_NS))
    monkeypatch.setattr(server, "_time_ns", lambda: next(clock))
    monkeypatch.setattr(pickler, "_time_ns", server._time_ns)  # the C Hook's clock (the codec fixture)
    udf = _udf("7", context)
    assert server.wrap_run_function(lambda python_udf: obj)(udf) is obj
    calls.take_pending_reply()  # the response's echo: not part of the ending
    fast = _effects(world)

    key = (noop, "worker1", "sync")
    site = world.server_sites[key]
    span = (world.tracer.start_server(site.span_name, site.attributes, udf.rpc_observe_fields[trailer.CONTEXT:],
                                      START_NS) if world.tracer is not None else None)
    tid = server._native_id() if world.profiler is not None else 0
    server.Serving(world, site, START_NS, span, tid).finish(*(calls.remote_error(obj) or (None, None)))
    assert fast == _effects(world)

    ended = [world.metrics is not None, world.tracer is not None, world.profiler is not None]
    assert [bool(fast["records"]), bool(fast["spans"]), bool(fast["profiler"])] == ended
    assert bool(fast["errors"].get("torch_rpc_server_errors_total")) == (result == "remote_error" and ended[0])
    assert not fast["internal_errors"]


def test_fold_split_folds_the_duration_as_fold_finished() -> None:
    """`fold_split` repeats `fold_finished` inline, then adds the split: the shared part agrees."""
    def cells() -> ClientCells:
        return ClientCells(*([0] * 21 for _ in range(7)), [None] * 20)

    sampled = tracing.SpanRecord("f", tracing.CLIENT, 1, 2, 0, False, True, {}, START_NS)
    for span in (None, sampled):
        for seconds, callee in ((0.004, 0.001), (0.0, 0.0), (-1e-9, 0.0), (70.0, 69.0), (0.001, 0.002)):
            finished, split = cells(), cells()
            fold_finished((fold_finished, finished, seconds, span))
            fold_split((fold_split, split, seconds, callee, span))
            assert (split.duration, split.in_flight, split.exemplars) == (
                finished.duration, finished.in_flight, finished.exemplars)
            assert (split.exemplars.count(None) == 20) is (span is None)
            assert sum(split.callee[:-1]) == sum(split.outside[:-1]) == 1
            assert split.callee[-1] + split.outside[-1] == pytest.approx(max(seconds, callee))


needs_core = pytest.mark.skipif(trailer.core is None, reason="the C core is not built here")
TENSOR_TABLES = {"tensors": lambda: [torch.ones(4), torch.zeros(1000, 10)[0]]}  # a small view of a big storage


def _serialize_both_ways(world: runtime.Runtime, monkeypatch: pytest.MonkeyPatch, obj: Any,
                         before: Any) -> list[tuple[Any, ...]]:
    """Pickles `obj` through the serialize wrapper with the Python fast paths, then with the C ones, each after
    `before()` (which sets up the thread's call or pending reply and returns what to compare it by), at the same
    perf_counter readings; returns per way: the message, what `before` gave, the records and the spans."""
    assert trailer.core is not None
    outcomes = []
    for core in (None, trailer.core):
        monkeypatch.setattr(pickler, "_core", core)  # wrap_serialize: the Python function, or the C Hook
        pickler.configure_core(time.time_ns, lambda: pickler._perf_counter())
        monkeypatch.setattr(pickler, "_perf_counter", iter([20.0, 20.25]).__next__)
        tensors = TENSOR_TABLES["tensors"]()
        seen = before()
        data, handed = pickler.wrap_serialize(lambda self, o, t=tensors: (b"PICKLE.", t))(None, obj)
        assert handed is tensors and data.startswith(b"PICKLE.")
        outcomes.append((data, seen, _effects(world, messages=True)))
    pickler.configure_core(time.time_ns, time.perf_counter)
    return outcomes


@needs_core
def test_the_request_fast_path_in_c_is_the_python_one(world: runtime.Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same trailer (its call id and context those of each way's own call), record and call table."""
    site = ClientSite(world, noop, "sync", "worker1")
    started: list[calls.Call] = []

    def before() -> None:
        call = calls.Call(world, site)
        _effects(world)  # the start is not the request
        started.append(call)
        calls.set_current_call(call)

    try:
        ways = _serialize_both_ways(world, monkeypatch, PythonUDF(noop, (), {}), before)
    finally:
        calls.set_current_call(None)
    views = []
    for (data, _, effects), call in zip(ways, started):
        size, fields = trailer.split(data)
        assert fields is not None and fields[trailer.CALL_ID] == str(call.id) and calls.in_flight[call.id] is call
        context = world.tracer.context_text(call.span) if world.tracer is not None else None
        assert fields[trailer.CONTEXT:] == ([context] if context else [])
        records = [r[:8] + (r[8] - len(data),) for r in effects.pop("records_all")]  # wire bytes, less the message
        views.append((data[:size], fields[:trailer.CALL_ID], records, effects))
    assert views[0] == views[1]
    assert bool(views[0][2]) is (world.metrics is not None)


@needs_core
@pytest.mark.parametrize(("echo", "request_start"), [("17", 19.5), ("17", 0.0), ("", 19.5)])
def test_the_response_fast_path_in_c_is_the_python_one(world: runtime.Runtime, monkeypatch: pytest.MonkeyPatch,
                                                       echo: str, request_start: float) -> None:
    """The same bytes (the echo and the callee's time), record, and the pending reply taken."""
    site = server.ServerSite(world, noop, "worker1", "sync")

    def before() -> None:
        calls.set_pending_reply(site, echo, request_start)

    python, c = _serialize_both_ways(world, monkeypatch, {"a": 1}, before)
    assert python == c and calls.take_pending_reply() is None
    data, _, effects = python
    assert data.endswith(trailer.MAGIC) is bool(echo)
    if echo:
        expected = 750_000 if request_start else -1  # (20.0 + 0.25 - 19.5) s in us
        assert trailer.parse(data) == (len(b"PICKLE."), 17, expected)
    assert bool(effects["records_all"]) is (world.metrics is not None)


@needs_core
def test_a_reply_that_is_none_of_ours_goes_the_general_path_either_way(world: runtime.Runtime,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """No call and no pending reply on this thread (an RRef fetch's reply): the C path leaves it to Python."""
    python, c = _serialize_both_ways(world, monkeypatch, {"a": 1}, lambda: None)
    assert python == c and python[0] == b"PICKLE."


@needs_core
def test_a_call_made_in_c_is_the_call_python_makes(world: runtime.Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    """`_core.new_call` (what the C `_invoke_rpc` makes per call) against `calls.Call`, the reference, at the same
    clock reading on the same thread inside a served UDF: the same slots, span and started record."""
    assert trailer.core is not None
    site = ClientSite(world, noop, "sync", "worker1")
    monkeypatch.setattr(calls, "_time_ns", lambda: START_NS)
    pickler.configure_core(lambda: START_NS, time.perf_counter)
    thread = pickler._thread_id()
    calls.serving[thread] = ("a served UDF", "9", START_NS - 5, 0)  # the call's parent
    try:
        made = []
        for make in (calls.Call, trailer.core.new_call):
            call = make(world, site)
            slots = {name: getattr(call, name, "unset") for name in calls.CALL_FIELDS}
            span = slots.pop("span")
            slots["span"] = _span(span) if span is not None else None
            made.append((type(call), slots, _effects(world, messages=True)))
        assert made[0] == made[1]
        assert made[0][1]["parent"] == calls.serving[thread] and made[0][1]["start_ns"] == START_NS
    finally:
        calls.serving.pop(thread, None)
        pickler.configure_core(time.time_ns, time.perf_counter)


@pytest.mark.parametrize("way", ["c", "python"])
def test_the_reply_a_thread_owes_is_its_own(way: str) -> None:
    """`calls.set_pending_reply` / `take_pending_reply` (a C thread local where the core is built) against their
    reference, the table by thread id: each thread takes only what it was set, once; a second set replaces the
    first, whose references are let go; a bad echo or start is refused by the C side."""
    if way == "c" and trailer.core is None:
        pytest.skip("the C core is not built here")
    put, take = ((trailer.core.set_pending_reply, trailer.core.take_pending_reply) if way == "c"  # type: ignore[union-attr]
                 else (calls._set_pending_reply, calls._take_pending_reply))
    first, mine, theirs = object(), object(), object()
    held = sys.getrefcount(first)
    put(first, "1", 2.5)  # type: ignore[arg-type]
    put(mine, "7", 19.5)  # type: ignore[arg-type]
    assert sys.getrefcount(first) == held
    seen: list[object] = []

    def other() -> None:
        seen.append(take())
        put(theirs, "", 0.0)  # type: ignore[arg-type]
        seen.append(take())
        seen.append(take())

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen == [None, (theirs, "", 0.0), None]
    assert take() == (mine, "7", 19.5) and take() is None
    if way == "c":
        with pytest.raises(TypeError):
            put(mine, 7, 1.0)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            put(mine, "7", "soon")  # type: ignore[arg-type]
        assert take() is None


@needs_core
def test_a_calls_fields_are_the_c_structs_and_read_as_the_python_slots() -> None:
    """Where the core is built, `calls.Call` keeps its fields in `_core.CallBase`: the same names, an object never
    set reads None, a number 0, each takes what the Python slot took (ints in range; any object), and a cycle
    through a call (a future whose callback is the call's method) is collected."""
    assert trailer.core is not None and issubclass(calls.Call, trailer.core.CallBase)
    bare = calls.Call.__new__(calls.Call)
    assert {name: getattr(bare, name) for name in calls.CALL_FIELDS} == {
        "runtime": None, "site": None, "start_ns": 0, "span": None, "rf": None, "tid": 0, "id": 0, "future": None,
        "thread": 0, "parent": None}
    assert not hasattr(bare, "__dict__")  # slots only, as the Python class
    for name, value in (("id", 2**63 - 1), ("start_ns", -5), ("tid", 7), ("thread", 2**64 - 1), ("span", "any"),
                        ("parent", ("a", "served", 1, 0))):
        setattr(bare, name, value)
        assert getattr(bare, name) == value
    with pytest.raises(OverflowError):
        bare.id = 2**63
    with pytest.raises(TypeError):
        bare.start_ns = "1"  # type: ignore[assignment]
    class Held:
        pass

    held = Held()
    gone = weakref.ref(held)
    cycle = calls.Call.__new__(calls.Call)
    cycle.future, cycle.parent = [cycle.on_done], held  # type: ignore[assignment]
    del held, cycle
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize("way", ["c", "python"])
def test_the_call_being_sent_is_the_threads_own(way: str) -> None:
    """`calls.current_call` (a C thread local where the core is built) against its threading.local reference: each
    thread sees only what it set, None when nothing is, and setting None lets the call go (no reference kept)."""
    if way == "c" and trailer.core is None:
        pytest.skip("the C core is not built here")
    get, put = ((trailer.core.current_call, trailer.core.set_current_call) if way == "c"  # type: ignore[union-attr]
                else (calls._current_call, calls._set_current_call))
    mine, theirs = object(), object()
    held = sys.getrefcount(mine)
    put(mine)
    seen: list[object] = []

    def other() -> None:
        seen.append(get())
        put(theirs)
        seen.append(get())
        put(None)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen == [None, theirs] and get() is mine
    put(None)
    assert get() is None and sys.getrefcount(mine) == held


@needs_core
@pytest.mark.parametrize("seed", range(5))
def test_the_c_ring_of_finished_calls_is_its_reference(seed: int) -> None:
    """`_core.FinishedCalls` against `calls.FinishedCalls` on the same random appends, resizes (0 included) and
    clears: the same calls in the same order, length and maxlen after every step, and no reference kept of a call
    that left."""
    assert trailer.core is not None
    rng = random.Random(seed)
    sites = [object() for _ in range(4)]
    unheld = [sys.getrefcount(site) for site in sites]
    rings = [calls.FinishedCalls(rng.randrange(0, 6)), trailer.core.FinishedCalls(0)]
    rings[1].resize(rings[0].maxlen)
    for _ in range(2_000):
        step = rng.random()
        if step < 0.8:
            item = (rng.choice(sites), rng.choice([0, 1, 2**63 - 1, rng.randrange(10**6)]),
                    rng.randrange(-2**63, 2**63), rng.randrange(2**62), rng.choice([None, "timeout", "é"]))
            for ring in rings:
                ring.append(item)
        elif step < 0.95:
            size = rng.randrange(0, 8)
            for ring in rings:
                ring.resize(size)
        else:
            for ring in rings:
                ring.clear()
        assert list(rings[0]) == list(rings[1]) and len(rings[0]) == len(rings[1])
        assert rings[0].maxlen == rings[1].maxlen
    for ring in rings:
        ring.clear()
    del item
    assert [sys.getrefcount(site) for site in sites] == unheld
    c_ring = rings[1]
    with pytest.raises(TypeError):
        c_ring.append(("site", 1, 2))  # type: ignore[arg-type]
    with pytest.raises(OverflowError):
        c_ring.append(("site", 2**64, 0, 0, None))
    with pytest.raises(ValueError):
        c_ring.resize(-1)


@needs_core
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("spans", [False, True], ids=["udfs", "spans"])
def test_the_c_serving_tables_are_their_reference(seed: int, spans: bool) -> None:
    """`_core.serving` (`_core.serving_spans`) against a dict, `calls.serving`'s (`Tracer.serving`'s) reference, on
    the same random sets, pops, deletes, gets and clears, keyed by this thread's id, other live threads' ids and
    made-up ones, the other table of the same slots set too: the same entries after every step, and no reference
    kept of an entry that left."""
    assert trailer.core is not None
    table, other = ((trailer.core.serving_spans, trailer.core.serving) if spans
                    else (trailer.core.serving, trailer.core.serving_spans))
    reference: dict[int, Any] = {}
    assert len(table) == 0 and len(other) == 0
    rng = random.Random(seed)
    sites = [object() for _ in range(3)]
    unheld = [sys.getrefcount(site) for site in sites]
    parked: list[int] = []
    release = threading.Event()

    def park() -> None:
        parked.append(threading.get_ident())
        release.wait()

    threads = [threading.Thread(target=park) for _ in range(2)]
    for thread in threads:
        thread.start()
    while len(parked) < 2:
        time.sleep(0.01)
    keys = [threading.get_ident(), *parked, 1, 2**64 - 1, rng.randrange(2**63)]
    try:
        for _ in range(2_000):
            step, key = rng.random(), rng.choice(keys)
            if step < 0.5:
                entry = (rng.choice(sites), rng.choice(["", "7", "é"]), rng.randrange(-2**63, 2**63),
                         rng.choice([0, 2**128 - 1]))
                table[key] = reference[key] = entry[0] if spans else entry
                if rng.random() < 0.3:  # the same slot's other value: never seen in this table
                    other[key] = entry if spans else entry[0]
            elif step < 0.7:
                assert table.pop(key, "none") == reference.pop(key, "none")
            elif step < 0.8 and key in reference:
                del table[key], reference[key]
            elif step < 0.98:
                assert table.get(key) == reference.get(key) and (key in table) == (key in reference)
            else:
                table.clear(), reference.clear()
                other.clear()
            assert dict(table.items()) == reference and len(table) == len(reference)
            assert sorted(table.values(), key=repr) == sorted(reference.values(), key=repr)
        with pytest.raises(KeyError):
            table[-1]  # noqa: B018  # not a thread id: never a key
        if not spans:
            with pytest.raises(TypeError):
                table[1] = ("site", "7", 0)
    finally:
        table.clear(), reference.clear()
        other.clear()
        release.set()
        for thread in threads:
            thread.join()
    del entry
    assert [sys.getrefcount(site) for site in sites] == unheld


@needs_core
def test_the_c_serving_table_keeps_a_slot_per_live_thread() -> None:
    """Each thread's entry is its own; an ended thread's entry stays readable, as in the dict, and its empty slot is
    taken again rather than a new one made: threads that come and go do not grow the table."""
    assert trailer.core is not None
    table = trailer.core.serving
    seen: list[object] = []

    def serve(tag: str, keep: bool) -> None:
        me = threading.get_ident()
        table[me] = (tag, "1", 5, 0)
        trailer.core.serving_spans[me] = tag  # type: ignore[union-attr]  # (the same slot)
        seen.append(table.get(me))
        del trailer.core.serving_spans[me]  # type: ignore[union-attr]
        if not keep:
            del table[me]

    kept = threading.Thread(target=serve, args=("kept", True))
    kept.start()
    kept.join()
    try:
        assert seen == [("kept", "1", 5, 0)] and table.get(kept.ident) == ("kept", "1", 5, 0)
        del table[kept.ident]  # (a later thread may get its id, and so its entry, as in the dict)
        for i in range(200):
            thread = threading.Thread(target=serve, args=(f"udf{i}", False))
            thread.start()
            thread.join()
        assert len(seen) == 201 and seen[-1] == ("udf199", "1", 5, 0) and len(table) == 0
        assert trailer.core.serving_slots() <= 8  # the 200 ended threads' slots taken again, not one each
    finally:
        table.clear()


@needs_core
def test_an_entry_set_for_a_thread_without_a_slot_is_its_parent_in_c(world: runtime.Runtime) -> None:
    """A value another thread set for a thread that has no slot of its own yet (as a test may, in the dict) is what
    that thread's C call reads as its parent, as `calls.Call` reads it from the table: the C readers look the thread
    up when such values exist instead of missing them."""
    assert trailer.core is not None
    site = ClientSite(world, noop, "sync", "worker1")
    entry = ("a served UDF", "9", START_NS - 5, 0)
    ready, go, parents = threading.Event(), threading.Event(), []

    def call_from_a_new_thread() -> None:
        ready.set()
        go.wait()
        parents.extend([trailer.core.new_call(world, site).parent, calls.Call(world, site).parent])  # type: ignore[union-attr]

    thread = threading.Thread(target=call_from_a_new_thread)
    thread.start()
    ready.wait()
    assert thread.ident is not None
    calls.serving[thread.ident] = entry  # set here, for the other thread: a slot it did not make
    try:
        go.set()
        thread.join()
    finally:
        calls.serving.pop(thread.ident, None)
    assert parents == [entry, entry]


@needs_core
def test_a_resized_flight_recorder_keeps_the_calls_the_c_core_ends(world: runtime.Runtime) -> None:
    """RPC_OBSERVE_RECORDER_SIZE resizes the one ring the C ending writes to (it once kept appending to a deque the
    recorder no longer read): the newest calls, as many as the size says."""
    assert trailer.core is not None
    site = ClientSite(world, noop, "sync", "worker1")
    hook = trailer.core.Hook(lambda self, d, t: {"a": 1}, trailer.core.DESERIALIZE)
    calls.finished.resize(3)
    try:
        ids = []
        for _ in range(5):
            call = calls.Call(world, site)
            call.id = calls.next_id()
            calls.in_flight[call.id] = call
            hook(None, b"RESULT." + trailer.response_trailer(str(call.id)), [])
            ids.append(call.id)
        assert [finished[1] for finished in calls.finished] == ids[-3:] and calls.finished.maxlen == 3
    finally:
        calls.finished.resize(1000)


@needs_core
def test_the_c_core_reads_the_time_modules_clocks_as_they_do(world: runtime.Runtime) -> None:
    """Configured with time.time_ns and time.perf_counter themselves, the C hot paths read those clocks directly
    (no call, no object): their readings fall between the time module's own, on each side of the hook."""
    assert trailer.core is not None
    pickler.configure_core(time.time_ns, time.perf_counter)  # the defaults, as at import
    site = ClientSite(world, noop, "sync", "worker1")
    call = calls.Call(world, site)
    call.id = calls.next_id()
    calls.in_flight[call.id] = call
    hook = trailer.core.Hook(lambda self, d, t: {"a": 1}, trailer.core.DESERIALIZE)
    before_ns = time.time_ns()
    hook(None, b"RESULT." + trailer.response_trailer(str(call.id)), [])
    after_ns = time.time_ns()
    [(_, _, start_ns, end_ns, _)] = calls.finished
    assert start_ns == call.start_ns and before_ns <= end_ns <= after_ns

    request = b"PICKLE." + trailer.request_trailer(trailer.request_head("worker1", "sync"), 3)
    hook = trailer.core.Hook(lambda self, d, t: PythonUDF(noop, (), {}), trailer.core.DESERIALIZE)
    before = time.perf_counter()
    udf = hook(None, request, [])
    after = time.perf_counter()
    kept = trailer.core.take_incoming()
    assert kept is not None and kept[0] is udf and before <= kept[2] <= after
    if world.metrics is not None:  # the unpickling's seconds, as measured on the same clock
        [message] = [r for r in world.metrics._records if r[0] is fold_message and r[1] is not site.response_cells]
        assert 0.0 <= message[6] <= after - before


@needs_core
def test_records_pushed_in_c_fold_as_the_tuples_python_makes(tmp_path: Path, codec: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The same calls ended and UDF requests taken by the C hot paths, once into the C core's `Records` (records
    pushed as they are) and once into a deque (the tuples made, as in Python), then drained (`_core.fold`, and for
    the deque also metrics.py's `fold_records`): the same cells, exemplars included."""
    from rpc_observe.telemetry.metrics import fold_records

    if codec == "python":
        pytest.skip("the C hot paths' records")
    cfg = config.load({"RPC_OBSERVE_DIR": str(tmp_path), "OTEL_TRACES_EXPORTER": "none",
                       "RPC_OBSERVE_PROFILER_EVENTS": "0", "RPC_OBSERVE_METRICS": "0"})
    states = []
    for queue, fold in (("records", trailer.core.fold), ("deque", trailer.core.fold), ("deque", fold_records)):
        clock, seconds = itertools.count(START_NS, 1_234_567), itertools.count(10.0, 0.000_125)  # the same each way
        monkeypatch.setattr(pickler, "_time_ns", clock.__next__)
        monkeypatch.setattr(calls, "_time_ns", clock.__next__)
        monkeypatch.setattr(pickler, "_perf_counter", seconds.__next__)
        monkeypatch.setattr(calls, "next_id", itertools.count(1).__next__)  # the same ids (their bytes are counted)
        rt = runtime.Runtime(cfg, "worker0", 0)
        rt.metrics, rt.tracer = Metrics("worker0", 100), tracing.Tracer(cfg, [])
        if queue == "records":
            rt.metrics.use_queue(trailer.core.Records())
        runtime.current = rt
        try:
            site = ClientSite(rt, noop, "sync", "worker1")
            for i in range(40):
                call = calls.Call(rt, site)
                call.id = calls.next_id()
                calls.in_flight[call.id] = call
                response = b"RESULT." + trailer.response_trailer(str(call.id), 1000 * i if i % 3 else -1)
                pickler.wrap_deserialize(lambda self, d, t: {"a": 1})(None, response, [torch.ones(i)])
                request = b"PICKLE." + trailer.request_trailer(trailer.request_head("worker1", "sync"), i)
                udf = pickler.wrap_deserialize(lambda self, d, t: PythonUDF(noop, (), {}))(None, request, [])
                server.wrap_run_function(lambda python_udf: None)(udf)
                calls.take_pending_reply()
            assert type(rt.metrics._records) is (trailer.core.Records if queue == "records" else collections.deque)
            assert len(rt.metrics._records) > 120
            rt.metrics.fold_records = fold
            assert rt.metrics.drain() is False
            states.append(_metric_state(rt.metrics))
        finally:
            runtime.current = None
            calls.in_flight.clear()
            calls.finished.clear()
            rt.close()
    assert states[0] == states[1] == states[2]
    assert "torch_rpc_client_callee_seconds" in states[0] and "Span" not in states[0]


def _metric_state(metrics: Metrics) -> str:
    """Every cell, and the exemplars by their spans' times (their ids are random)."""
    return repr([(f.declaration.name, sorted(f.children.items()),
                  sorted((k, [(s.start_ns, s.end_ns, sec) if s else None for s, sec in
                              [(e if e else (None, None)) for e in v]]) for k, v in (f.exemplars or {}).items()))
                 for f in metrics._families])


@needs_core
@pytest.mark.parametrize("result", RESULTS)
def test_a_request_unpickled_and_run_in_c_is_the_python_one(world: runtime.Runtime, monkeypatch: pytest.MonkeyPatch,
                                                            result: str) -> None:
    """A request unpickled, then its UDF run, by the C Hooks (which keep the caller's fields for the thread) and by
    the Python functions (which attach them to an `_IncomingUDF`), at the same clock readings: the same records,
    spans and profiler events, and the same pending reply (the echo, and the start the callee's time counts from)."""
    obj = RESULTS[result]()
    context = "traceparent=00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    request = b"PICKLE." + trailer.request_trailer(trailer.request_head("worker1", "sync"), 7, context)
    ways = []
    for core in (None, trailer.core):
        for module in (pickler, server):
            monkeypatch.setattr(module, "_core", core)
        clock = itertools.chain([START_NS], itertools.repeat(END_NS))
        monkeypatch.setattr(server, "_time_ns", clock.__next__)
        monkeypatch.setattr(pickler, "_time_ns", server._time_ns)
        monkeypatch.setattr(pickler, "_perf_counter", iter([20.0, 20.25]).__next__)
        pickler.configure_core(lambda: pickler._time_ns(), lambda: pickler._perf_counter())
        udf = pickler.wrap_deserialize(lambda self, d, t: PythonUDF(noop, (), {}))(None, request, [])
        assert server.wrap_run_function(lambda python_udf: obj)(udf) is obj
        pending = calls.take_pending_reply()
        ways.append((pending, _effects(world, messages=True)))
    pickler.configure_core(time.time_ns, time.perf_counter)
    assert ways[0] == ways[1]
    assert ways[0][0][1:] == ("7", 20.0) and trailer.core.take_incoming() is None
