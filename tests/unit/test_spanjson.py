"""The span file exporter's batch encoding in C (rpc_observe/telemetry/_spanjson.c) against the Python
`_lines` it stands in for, which stays the reference and the fallback: the same lines, byte for byte,
from the same records (the common ones, every kind the C code hands back, thousands of random ones),
split at the same places, and the same errors out of the same Python callbacks."""

from __future__ import annotations

import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from rpc_observe.telemetry import exporters
from rpc_observe.telemetry.exporters import OtlpJsonFileSink
from rpc_observe.telemetry.tracing import CLIENT, SERVER, SpanRecord

RESOURCE = {"service.name": "worker0", "process.pid": 4242}
SITES = [{"rpc.system": "torch_rpc", "rpc.method": f"f{i}", "torch.rpc.dst": "worker1", "n": i, "x": 0.5}
         for i in range(40)]
UNICODE = {"rpc.method": 'g "quoted"\n\u00e9\u4e2d', "ok": True}


def test_the_encoder_is_built_where_a_compiler_is() -> None:
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler here: the file exporter encodes in Python")
    assert exporters._native_lines() is not None, "telemetry/_spanjson.c is not built: python hatch_build.py"


needs_c = pytest.mark.skipif(exporters._native_lines() is None, reason="telemetry/_spanjson.c is not built here")


@pytest.fixture
def sinks(tmp_path: Path) -> Iterator[tuple[OtlpJsonFileSink, OtlpJsonFileSink]]:
    """(C, Python) sinks of the same resource."""
    pair = (OtlpJsonFileSink(str(tmp_path / "c.jsonl"), RESOURCE, native=True),
            OtlpJsonFileSink(str(tmp_path / "py.jsonl"), RESOURCE, native=False))
    yield pair
    for sink in pair:
        sink.shutdown()


def span(trace_id: object = 0x0AF7651916CD43DD8448EB211C80319C, span_id: object = 0xB7AD6B7169203331,
         parent_id: object = 0, start_ns: object = 1_700_000_000_000_000_001,
         end_ns: object = 1_700_000_000_900_000_000,
         name: str = "rpc_sync#f(worker0 -> worker1)", kind: int = CLIENT, attributes: dict | None = None,
         error: tuple[str, str] | None = None, cls: type = SpanRecord) -> SpanRecord:
    r = cls(name, kind, trace_id, span_id, parent_id, False, True, SITES[0] if attributes is None else attributes,
            start_ns)
    r.end_ns = end_ns
    if error is not None:
        r.error_type, r.error_message = error
    return r


def both(sinks: tuple[OtlpJsonFileSink, OtlpJsonFileSink], records: list, budget: int | None = None
         ) -> list[tuple[bytes, int]]:
    c, py = sinks
    if budget is not None:
        c._file_bytes = py._file_bytes = budget + len(py._head) + len(exporters._TAIL)
    got, expected = c._lines(records), py._lines(records)
    assert got == expected
    return got


class Derived(SpanRecord):
    __slots__ = ()


EDGES = [
    span(),  # a root
    span(parent_id=0x00F067AA0BA902B7, kind=SERVER),  # a child
    span(parent_id=None),  # no parent given at all: a root
    span(trace_id=0, span_id=0, start_ns=0, end_ns=0),  # all zeros: every digit printed
    span(trace_id=(1 << 128) - 1, span_id=(1 << 64) - 1, parent_id=(1 << 64) - 1),  # the largest ids
    span(trace_id=1 << 128),  # too big for 32 digits: Python prints 33
    span(span_id=1 << 64),
    span(parent_id=1 << 64),
    span(trace_id=-1),  # negative: Python's "-1" padded
    span(parent_id=-5),
    span(start_ns=-3, end_ns=-(1 << 63)),  # negative times, the smallest long long
    span(end_ns=1 << 63),  # past a long long
    span(end_ns=(1 << 63) - 1),
    span(trace_id=True, span_id=False, parent_id=True),  # bools are ints to %x, not to the C path
    span(start_ns=7.0),  # a float time: Python's %d
    span(name="é", attributes=UNICODE),  # non-ASCII site text
    span(error=("KeyError", "no key 'k'\nline 2")),  # an error: the dict encoding
    span(cls=Derived),  # a subclass: the Python path
]


@needs_c
@pytest.mark.parametrize("index", range(len(EDGES)))
def test_each_kind_of_record_gives_the_same_line(sinks: tuple[OtlpJsonFileSink, OtlpJsonFileSink],
                                                 index: int) -> None:
    ((line, count),) = both(sinks, [EDGES[index]])
    assert count == 1 and line.endswith(b"]}]}]}\n")


@needs_c
def test_a_batch_of_every_kind_and_of_more_sites_than_the_table_holds(
        sinks: tuple[OtlpJsonFileSink, OtlpJsonFileSink]) -> None:
    records = EDGES + [span(span_id=i, attributes=SITES[i % len(SITES)], name=f"n{i % 3}", kind=CLIENT + i % 2)
                       for i in range(200)]
    assert both(sinks, records)[0][1] == len(records)
    assert both(sinks, []) == []


@needs_c
@pytest.mark.parametrize("budget", [1, 200, 487, 1000, 5000])
def test_lines_split_where_the_python_code_splits_them(sinks: tuple[OtlpJsonFileSink, OtlpJsonFileSink],
                                                       budget: int) -> None:
    rng = random.Random(budget)
    records = [span(span_id=rng.getrandbits(64), parent_id=rng.choice([0, rng.getrandbits(64)]),
                    attributes=rng.choice(SITES[:3] + [UNICODE])) for _ in range(60)]
    lines = both(sinks, records, budget)
    assert sum(count for _, count in lines) == 60 and (budget > 5000 or len(lines) > 1)


@needs_c
def test_lines_split_at_the_exact_byte(sinks: tuple[OtlpJsonFileSink, OtlpJsonFileSink]) -> None:
    """Budgets of exactly two and three spans and a comma each, and one byte less."""
    records = [span(span_id=i, attributes=SITES[i % 2]) for i in range(1, 10)]
    sizes = [len(sinks[1]._span_json(r).encode()) for r in records]
    for exact, spans_per_line in ((sizes[0] + 1 + sizes[1], 2), (sizes[0] + sizes[1] + sizes[2] + 2, 3)):
        assert both(sinks, records, exact)[0][1] == spans_per_line
        assert both(sinks, records, exact - 1)[0][1] == spans_per_line - 1


@needs_c
def test_random_records_give_the_same_lines(sinks: tuple[OtlpJsonFileSink, OtlpJsonFileSink]) -> None:
    """3,000 records with ids and times drawn around every boundary the C code checks."""
    rng = random.Random(23)

    def number(bits: int) -> object:
        return rng.choice([0, 1, rng.getrandbits(bits), (1 << bits) - 1, 1 << bits, -rng.getrandbits(8),
                           rng.getrandbits(bits + 8), None if bits == 64 else 0, True])

    records = []
    for _ in range(3000):
        error = rng.choice([None] * 9 + [("TimeoutError", "t\u00e9")])
        records.append(span(number(128), number(64), number(64), number(63), number(63),
                            rng.choice(["a", "é", 'q"\\']), rng.choice([CLIENT, SERVER]),
                            rng.choice(SITES[:20] + [UNICODE]), error, rng.choice([SpanRecord] * 5 + [Derived])))
    refused = []
    for r in records:
        try:
            sinks[1]._lines([r])
        except (TypeError, ValueError) as e:  # a value Python's %-format refuses (None as an id)
            refused.append((r, type(e)))
    for r, error in refused:  # the same error from C
        with pytest.raises(error):
            sinks[0]._lines([r])
    refused_ids = {id(r) for r, _ in refused}
    taken = [r for r in records if id(r) not in refused_ids]
    assert len(refused) > 50 and len(taken) > 2500
    for start in range(0, len(taken), 512):
        chunk = taken[start:start + 512]
        assert sinks[0]._lines(chunk) == sinks[1]._lines(chunk)


@needs_c
def test_errors_of_the_callbacks_come_out_as_they_are(sinks: tuple[OtlpJsonFileSink, OtlpJsonFileSink]) -> None:
    c, _ = sinks
    lines = exporters._native_lines()
    assert lines is not None
    records = [span(), span(error=("E", "m"))]

    def refuse(record: SpanRecord) -> str:
        raise LookupError("site")

    with pytest.raises(LookupError, match="site"):
        lines(records, c._span_json, refuse, c._head, exporters._TAIL, 1000)
    with pytest.raises(LookupError, match="site"):
        lines(records, refuse, c._site, c._head, exporters._TAIL, 1000)
    with pytest.raises(TypeError, match="must return a str"):
        lines(records, c._span_json, lambda r: b"bytes", c._head, exporters._TAIL, 1000)
    with pytest.raises(UnicodeEncodeError):  # as str.encode() in the Python code
        lines(records, c._span_json, lambda r: "\udc80", c._head, exporters._TAIL, 1000)
    with pytest.raises(TypeError):
        lines(records, c._span_json, c._site, "head", exporters._TAIL, 1000)
    with pytest.raises(TypeError):
        lines(42, c._span_json, c._site, c._head, exporters._TAIL, 1000)


@needs_c
def test_a_record_with_unset_slots_and_a_batch_emptied_under_it(sinks: tuple[OtlpJsonFileSink, OtlpJsonFileSink]
                                                                ) -> None:
    """Records made without __init__ (slots never set) go to the Python path and raise as it does; a callback
    that empties the batch it is called for ends the batch there, without reading freed records."""
    c, py = sinks
    bare = SpanRecord.__new__(SpanRecord)
    bare.error_type = None  # set (no error), but nothing else is
    for record in (SpanRecord.__new__(SpanRecord), bare):
        with pytest.raises(AttributeError):
            py._lines([record])
        with pytest.raises(AttributeError):
            c._lines([record])
    lines = exporters._native_lines()
    assert lines is not None
    batch = [span(error=("E", "m")), span(span_id=2), span(span_id=3)]
    first = c._span_json(batch[0])

    def emptying(record: SpanRecord) -> str:
        batch.clear()  # the records are freed but for the one the C code holds
        return c._span_json(record)

    assert lines(batch, emptying, c._site, c._head, exporters._TAIL, 10_000) == [
        (c._head + first.encode() + exporters._TAIL, 1)]


def test_the_exporter_encodes_in_c_only_where_asked(tmp_path: Path) -> None:
    """RPC_OBSERVE_NO_EXTENSIONS=1 gives config.extensions False, which build_sinks passes on."""
    from rpc_observe.config import load
    from rpc_observe.telemetry.exporters import build_sinks

    for env, native in (({"RPC_OBSERVE_NO_EXTENSIONS": "1"}, False), ({}, exporters._native_lines() is not None)):
        config = load({"RPC_OBSERVE": "1", "OTEL_TRACES_EXPORTER": "file", **env})
        (sink,) = build_sinks(config, RESOURCE, str(tmp_path), "w0")
        assert (sink._native_lines is not None) is native
        sink.shutdown()
