"""The span sinks: OTLP/JSON lines in a file, and any OpenTelemetry SDK exporter.

OTLP/JSON is the proto3 JSON mapping with one deviation: "the traceId and spanId byte arrays
are represented as case-insensitive hex-encoded strings; they are not base64-encoded as is
defined in the standard Protobuf JSON Mapping" (opentelemetry-proto, docs/specification.md,
JSON Protobuf Encoding); enums are integers. protobuf's `json_format` implements the plain
mapping, so it reads a hex id as base64 (hex digits are valid base64) and silently gets 24
or 12 bytes of nothing: the file is parsed here after turning the ids into base64, as an
OTLP/JSON receiver does, and the raw parse is checked to be that wrong, so that a file
written with base64 ids (not OTLP/JSON) would fail these tests.
"""

from __future__ import annotations

import base64
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from rpc_observe import __version__
from rpc_observe.telemetry import health
from rpc_observe.telemetry.exporters import OtlpJsonFileSink, SdkExporterSink
from rpc_observe.telemetry.tracing import CLIENT, SERVER, SpanRecord

TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
RESOURCE = {"service.name": "worker0", "torch.rpc.worker": "worker0", "process.pid": 4242, "rpc_observe.run_id": "r1"}
CLIENT_ATTRS = {"rpc.system": "torch_rpc", "rpc.method": "f", "torch.rpc.dst": "worker1", "torch.rpc.internal": False,
                "answer": 42, "ratio": 0.5}
SERVER_ATTRS = {"rpc.system": "torch_rpc", "rpc.method": "f", "torch.rpc.src": "worker0", "torch.rpc.internal": True}


def record(name: str, kind: int, span_id: int, parent_id: int, attributes: dict, start_ns: int, end_ns: int,
           trace_id: int = TRACE_ID, error: tuple[str, str] | None = None, remote: bool = False) -> SpanRecord:
    r = SpanRecord(name, kind, trace_id, span_id, parent_id, remote, True, attributes, start_ns)
    r.end_ns = end_ns
    if error is not None:
        r.error_type, r.error_message = error
    return r


def batch() -> list[SpanRecord]:
    """A root client span, its server child (remote parent) and a failed client call under that."""
    return [
        record("rpc_sync#f(worker0 -> worker1)", CLIENT, 0xB7AD6B7169203331, 0, CLIENT_ATTRS,
               1_700_000_000_000_000_001, 1_700_000_000_900_000_000),
        record("rpc_sync#f(worker0 -> worker1)", SERVER, 0x00F067AA0BA902B7, 0xB7AD6B7169203331, SERVER_ATTRS,
               1_700_000_000_100_000_000, 1_700_000_000_800_000_000, remote=True),
        record('g "quoted"\n\u00e9', CLIENT, 0x1, 0x00F067AA0BA902B7, CLIENT_ATTRS,
               1_700_000_000_200_000_000, 1_700_000_000_300_000_000, error=("KeyError", "no key 'k'\nline 2")),
    ]


@pytest.fixture(params=[False, True], ids=["python", "c"])
def file_sink(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[OtlpJsonFileSink]:
    """The file sink, encoding in Python (the reference) and in C (telemetry/_spanjson.c) where built."""
    sink = OtlpJsonFileSink(str(tmp_path / "spans.jsonl"), RESOURCE, native=request.param)
    if request.param and sink._native_lines is None:
        sink.shutdown()
        pytest.skip("telemetry/_spanjson.c is not built here")
    yield sink
    if not sink._file.closed:
        sink.shutdown()


def otlp_json_to_proto_json(value: Any) -> Any:
    """OTLP/JSON -> protobuf's JSON mapping: hex traceId/spanId/parentSpanId become base64 (what receivers do)."""
    if isinstance(value, list):
        return [otlp_json_to_proto_json(v) for v in value]
    if isinstance(value, dict):
        return {k: (base64.b64encode(bytes.fromhex(v)).decode() if k in ("traceId", "spanId", "parentSpanId")
                    else otlp_json_to_proto_json(v)) for k, v in value.items()}
    return value


def parse_line(line: str) -> ExportTraceServiceRequest:
    return json_format.Parse(json.dumps(otlp_json_to_proto_json(json.loads(line))), ExportTraceServiceRequest())


def lines_of(sink: OtlpJsonFileSink) -> list[str]:
    return Path(sink.path).read_text(encoding="utf-8").splitlines(keepends=True)


def any_value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return {"string_value": value.string_value, "bool_value": value.bool_value, "int_value": value.int_value,
            "double_value": value.double_value}[kind]


def attributes(kvs: Any) -> dict[str, Any]:
    items = [(kv.key, any_value(kv.value)) for kv in kvs]
    assert len(items) == len(dict(items))  # no key twice
    return dict(items)


# -- OtlpJsonFileSink ------------------------------------------------------------------


def test_file_sink_writes_one_parseable_export_request_per_batch(file_sink: OtlpJsonFileSink) -> None:
    records = batch()
    assert file_sink.export(records) is True
    assert file_sink.export(records[:1]) is True
    lines = lines_of(file_sink)
    assert len(lines) == 2 and all(line.endswith("}\n") and line.count("\n") == 1 for line in lines)
    requests = [parse_line(line) for line in lines]
    assert [len(r.resource_spans[0].scope_spans[0].spans) for r in requests] == [3, 1]
    request = requests[0]
    assert len(request.resource_spans) == 1 and len(request.resource_spans[0].scope_spans) == 1
    assert attributes(request.resource_spans[0].resource.attributes) == RESOURCE
    scope = request.resource_spans[0].scope_spans[0].scope
    assert (scope.name, scope.version) == ("rpc_observe", __version__)


def test_file_sink_ids_are_otlp_json_hex(file_sink: OtlpJsonFileSink) -> None:
    file_sink.export(batch())
    line = lines_of(file_sink)[0]
    raw = json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"]
    assert [(s["traceId"], s["spanId"], s.get("parentSpanId")) for s in raw] == [
        ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331", None),
        ("0af7651916cd43dd8448eb211c80319c", "00f067aa0ba902b7", "b7ad6b7169203331"),
        ("0af7651916cd43dd8448eb211c80319c", "0000000000000001", "00f067aa0ba902b7"),
    ]
    spans = parse_line(line).resource_spans[0].scope_spans[0].spans
    trace, client, server, failed = (i.to_bytes(n, "big") for i, n in (
        (TRACE_ID, 16), (0xB7AD6B7169203331, 8), (0x00F067AA0BA902B7, 8), (1, 8)))
    assert [(s.trace_id, s.span_id, s.parent_span_id) for s in spans] == [
        (trace, client, b""), (trace, server, client), (trace, failed, server)]
    # protobuf's own JSON mapping accepts the line too, but reads the hex as base64: wrong ids, wrong sizes.
    plain = json_format.Parse(line, ExportTraceServiceRequest()).resource_spans[0].scope_spans[0].spans[0]
    assert plain.trace_id == base64.b64decode("0af7651916cd43dd8448eb211c80319c") and len(plain.trace_id) == 24
    assert len(plain.span_id) == 12


def test_file_sink_kind_times_attributes_and_status(file_sink: OtlpJsonFileSink) -> None:
    records = batch()
    file_sink.export(records)
    line = lines_of(file_sink)[0]
    raw = json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"]
    assert [s["kind"] for s in raw] == [3, 2, 3]  # OTLP/JSON: enums as integers
    assert [s["startTimeUnixNano"] for s in raw] == [str(r.start_ns) for r in records]  # 64-bit ints as strings
    spans = parse_line(line).resource_spans[0].scope_spans[0].spans
    client, server, failed = spans
    assert [s.kind for s in spans] == [Span.SPAN_KIND_CLIENT, Span.SPAN_KIND_SERVER, Span.SPAN_KIND_CLIENT]
    assert [s.name for s in spans] == [r.name for r in records]
    assert [(s.start_time_unix_nano, s.end_time_unix_nano) for s in spans] == [(r.start_ns, r.end_ns) for r in records]
    assert attributes(client.attributes) == CLIENT_ATTRS
    assert attributes(server.attributes) == SERVER_ATTRS
    assert [kv.value.WhichOneof("value") for kv in client.attributes] == [
        "string_value", "string_value", "string_value", "bool_value", "int_value", "double_value"]
    for span in (client, server):
        assert span.status.code == Status.STATUS_CODE_UNSET and span.status.message == "" and not span.events
    assert attributes(failed.attributes) == {**CLIENT_ATTRS, "error.type": "KeyError"}
    assert (failed.status.code, failed.status.message) == (Status.STATUS_CODE_ERROR, "no key 'k'\nline 2")
    assert len(failed.events) == 1
    event = failed.events[0]
    assert (event.name, event.time_unix_nano) == ("exception", records[2].end_ns)
    assert attributes(event.attributes) == {"exception.type": "KeyError", "exception.message": "no key 'k'\nline 2"}


def test_file_sink_fast_path_matches_the_reference_encoding(file_sink: OtlpJsonFileSink) -> None:
    """The hand-formatted JSON of a span without error is what the dict encoding (`_span`) gives."""
    for r in batch()[:2]:
        assert json.loads(file_sink._span_json(r)) == file_sink._span(r)
    # Two call sites in one batch, then a new attributes dict for a cached (name, kind): each its own attributes.
    other = {"rpc.method": "h"}
    recs = [record("a", CLIENT, 2, 0, CLIENT_ATTRS, 1, 2), record("a", CLIENT, 3, 0, other, 1, 2),
            record("a", CLIENT, 4, 0, CLIENT_ATTRS, 1, 2)]
    file_sink.export(recs)
    spans = parse_line(lines_of(file_sink)[0]).resource_spans[0].scope_spans[0].spans
    assert [attributes(s.attributes) for s in spans] == [CLIENT_ATTRS, other, CLIENT_ATTRS]


def test_file_sink_matches_the_sdk_otlp_encoder(file_sink: OtlpJsonFileSink) -> None:
    """The file says what the SDK's OTLP exporter would send for the same spans (ids, kind, status, events)."""
    records = batch()
    memory = InMemorySpanExporter()
    SdkExporterSink(memory, RESOURCE).export(records)
    sent = encode_spans(memory.get_finished_spans()).resource_spans[0].scope_spans[0].spans
    file_sink.export(records)
    written = parse_line(lines_of(file_sink)[0]).resource_spans[0].scope_spans[0].spans
    fields = ("trace_id", "span_id", "parent_span_id", "name", "kind", "start_time_unix_nano", "end_time_unix_nano")
    for ours, theirs in zip(written, sent, strict=True):
        assert [getattr(ours, f) for f in fields] == [getattr(theirs, f) for f in fields]
        assert attributes(ours.attributes) == attributes(theirs.attributes)
        assert (ours.status.code, ours.status.message) == (theirs.status.code, theirs.status.message)
        assert [(e.name, e.time_unix_nano, attributes(e.attributes)) for e in ours.events] == [
            (e.name, e.time_unix_nano, attributes(e.attributes)) for e in theirs.events]


def test_file_sink_appends_and_shutdown_closes(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    path.write_text("earlier line\n", encoding="utf-8")
    sink = OtlpJsonFileSink(str(path), {})
    sink.export(batch()[:1])
    sink.shutdown()
    assert sink._file.closed
    text = path.read_text(encoding="utf-8").splitlines()
    assert text[0] == "earlier line" and len(text) == 2
    assert parse_line(text[1]).resource_spans[0].resource.attributes == []
    assert sink.export(batch()[:1]) is False  # after shutdown (under a hung export): the tracer counts them dropped
    assert len(path.read_text(encoding="utf-8").splitlines()) == 2


def test_otlp_attribute_values() -> None:
    from rpc_observe.telemetry.exporters import otlp_attributes

    assert otlp_attributes({"b": True, "i": -3, "f": 1.5, "s": "x", "o": (1, 2)}) == [
        {"key": "b", "value": {"boolValue": True}}, {"key": "i", "value": {"intValue": "-3"}},
        {"key": "f", "value": {"doubleValue": 1.5}}, {"key": "s", "value": {"stringValue": "x"}},
        {"key": "o", "value": {"stringValue": "(1, 2)"}}]
    kv = json_format.Parse(json.dumps(otlp_attributes({"i": 2**62})[0]), KeyValue())
    assert kv.value.int_value == 2**62


# -- SdkExporterSink ------------------------------------------------------------------------


def test_sdk_sink_hands_readable_spans_to_the_exporter() -> None:
    memory = InMemorySpanExporter()
    sink = SdkExporterSink(memory, RESOURCE)
    records = batch()
    assert sink.export(records) is True
    spans = memory.get_finished_spans()
    assert len(spans) == 3 and all(isinstance(s, ReadableSpan) for s in spans)
    client, server, failed = spans
    assert [s.name for s in spans] == [r.name for r in records]
    assert [(s.context.trace_id, s.context.span_id) for s in spans] == [(TRACE_ID, r.span_id) for r in records]
    assert all(s.context.trace_flags.sampled and not s.context.is_remote for s in spans)
    assert client.parent is None
    assert (server.parent.trace_id, server.parent.span_id, server.parent.is_remote) == (
        TRACE_ID, 0xB7AD6B7169203331, True)
    assert (failed.parent.span_id, failed.parent.is_remote) == (0x00F067AA0BA902B7, False)
    assert [s.kind for s in spans] == [SpanKind.CLIENT, SpanKind.SERVER, SpanKind.CLIENT]
    assert [(s.start_time, s.end_time) for s in spans] == [(r.start_ns, r.end_ns) for r in records]
    assert dict(client.attributes) == CLIENT_ATTRS and dict(server.attributes) == SERVER_ATTRS
    assert client.status.status_code is StatusCode.UNSET and not client.events
    assert dict(failed.attributes) == {**CLIENT_ATTRS, "error.type": "KeyError"}
    assert (failed.status.status_code, failed.status.description) == (StatusCode.ERROR, "no key 'k'\nline 2")
    assert [(e.name, e.timestamp, dict(e.attributes)) for e in failed.events] == [
        ("exception", records[2].end_ns, {"exception.type": "KeyError", "exception.message": "no key 'k'\nline 2"})]
    assert dict(client.resource.attributes) == RESOURCE
    assert (client.instrumentation_scope.name, client.instrumentation_scope.version) == ("rpc_observe", __version__)
    assert CLIENT_ATTRS == {"rpc.system": "torch_rpc", "rpc.method": "f", "torch.rpc.dst": "worker1",
                            "torch.rpc.internal": False, "answer": 42, "ratio": 0.5}  # the shared dict is untouched


def test_sdk_sink_reports_failure_and_shuts_the_exporter_down() -> None:
    memory = InMemorySpanExporter()
    sink = SdkExporterSink(memory, {})
    sink.shutdown()
    assert memory._stopped is True
    assert sink.export(batch()) is False  # the exporter refuses after shutdown: the tracer counts them dropped
    assert memory.get_finished_spans() == ()


# -- OtlpJsonFileSink: rotation, the cap, disk errors -------------------------------------


def spans_of(path: Path) -> list[int]:
    """Span ids in a span file, in file order; every line must parse."""
    return [int(s["spanId"], 16) for line in path.read_text(encoding="utf-8").splitlines()
            for s in json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"]]


def files_of(sink: OtlpJsonFileSink) -> list[Path]:
    """The sink's files, oldest first: path.N (N largest first) ... path.1, then path."""
    base = Path(sink.path)
    rotated = sorted((int(p.name.rsplit(".", 1)[1]), p) for p in base.parent.glob(base.name + ".*"))
    return [p for _, p in reversed(rotated)] + ([base] if base.exists() else [])


def spans_in_files(sink: OtlpJsonFileSink) -> list[int]:
    return [span_id for path in files_of(sink) for span_id in spans_of(path)]


def numbered(start: int, n: int) -> list[SpanRecord]:
    """n spans of one call site with span ids start, start+1, ... (~550 bytes each, ~350 per line)."""
    return [record("rpc_sync#f(worker0 -> worker1)", CLIENT, i, 0, CLIENT_ATTRS, 1_700_000_000_000_000_000 + i,
                   1_700_000_000_000_000_500 + i) for i in range(start, start + n)]


def sink_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "rpc_observe" and r.levelno >= logging.WARNING]


def test_file_sink_rotates_by_size_logrotate_style(tmp_path: Path) -> None:
    path = tmp_path / "worker0-1.jsonl"
    sink = OtlpJsonFileSink(str(path), RESOURCE, file_bytes=2000, max_bytes=0)
    for batch_no in range(12):
        assert sink.export(numbered(batch_no * 3, 3)) is True
    sink.shutdown()
    files = files_of(sink)
    assert [p.name for p in files] == [f"worker0-1.jsonl.{n}" for n in range(len(files) - 1, 0, -1)] + [path.name]
    assert len(files) >= 4  # it did rotate, and nothing is deleted without a cap
    assert all(p.stat().st_size <= 2000 for p in files)
    assert spans_in_files(sink) == list(range(36))  # oldest file first: the export order; larger N is older
    assert spans_of(files[0])[0] == 0 and spans_of(path)[-1] == 35
    assert sum(health.spans_dropped.values()) == 0


def test_file_sink_splits_a_batch_into_lines_that_fit_a_file(tmp_path: Path) -> None:
    sink = OtlpJsonFileSink(str(tmp_path / "s.jsonl"), RESOURCE, file_bytes=4096, max_bytes=0)
    sink.export(numbered(0, 100))  # ~33 kB in one batch
    sink.shutdown()
    files = files_of(sink)
    assert len(files) > 8 and all(p.stat().st_size <= 4096 for p in files)
    lines = [line for p in files for line in p.read_text(encoding="utf-8").splitlines(keepends=True)]
    assert all(len(line.encode()) <= 4096 for line in lines)
    assert [len(parse_line(line).resource_spans[0].scope_spans[0].spans) for line in lines].count(0) == 0
    assert spans_in_files(sink) == list(range(100))


@pytest.mark.parametrize("file_bytes", [3000, 10_000])
def test_file_sink_cap_deletes_the_oldest_files_and_counts_their_spans(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, file_bytes: int) -> None:
    caplog.set_level(logging.WARNING, logger="rpc_observe")
    sink = OtlpJsonFileSink(str(tmp_path / "s.jsonl"), RESOURCE, file_bytes=file_bytes, max_bytes=10_000)
    exported = 0
    for batch_no in range(40):
        n = 1 + batch_no % 7  # batches of several sizes
        sink.export(numbered(exported, n))
        exported += n
        total = sum(p.stat().st_size for p in files_of(sink))
        assert total <= 10_000  # after every batch: no slack
        kept = spans_in_files(sink)
        assert health.spans_dropped["disk_cap"] == exported - len(kept)  # exact, from the per-file counts
        assert kept == list(range(exported - len(kept), exported))  # the newest, none missing in between
    sink.shutdown()
    assert health.spans_dropped["disk_cap"] > 0 and len(spans_in_files(sink)) >= 10
    names = [p.name for p in files_of(sink)]
    assert names == [f"s.jsonl.{n}" for n in range(len(names) - 1, 0, -1)] + ["s.jsonl"]  # numbers stay 1..N
    warned = sink_warnings(caplog)
    assert len(warned) == 1, warned
    assert "RPC_OBSERVE_SPANS_MAX_BYTES=10000" in warned[0] and 'reason="disk_cap"' in warned[0]
    assert str(tmp_path / "s.jsonl") in warned[0]


def test_file_sink_zero_is_no_cap(tmp_path: Path) -> None:
    sink = OtlpJsonFileSink(str(tmp_path / "s.jsonl"), RESOURCE, file_bytes=5000, max_bytes=0)
    for i in range(100):
        sink.export(numbered(i * 5, 5))
    sink.shutdown()
    assert spans_in_files(sink) == list(range(500))
    assert sum(p.stat().st_size for p in files_of(sink)) > 100_000
    assert sum(health.spans_dropped.values()) == 0


def test_file_sink_a_line_bigger_than_the_cap_is_dropped_as_disk_cap(tmp_path: Path) -> None:
    sink = OtlpJsonFileSink(str(tmp_path / "s.jsonl"), RESOURCE, file_bytes=200, max_bytes=200)
    sink.export(numbered(0, 2))  # each span alone is a line of ~600 bytes: none fits under the cap
    sink.shutdown()
    assert health.spans_dropped["disk_cap"] == 2 and spans_in_files(sink) == []


def test_file_sink_counts_files_left_by_an_earlier_process_but_not_their_spans(tmp_path: Path) -> None:
    path = tmp_path / "worker0-1.jsonl"  # PID 1 again, in a restarted container
    earlier = OtlpJsonFileSink(str(path), RESOURCE, file_bytes=3000, max_bytes=0)
    for i in range(10):
        earlier.export(numbered(1000 + i * 5, 5))
    earlier.shutdown()
    left = len(files_of(earlier))
    assert left >= 3
    sink = OtlpJsonFileSink(str(path), RESOURCE, file_bytes=3000, max_bytes=9000)
    for i in range(10):
        sink.export(numbered(i * 5, 5))
    sink.shutdown()
    assert sum(p.stat().st_size for p in files_of(sink)) <= 9000
    kept = spans_in_files(sink)
    assert kept == list(range(50 - len(kept), 50))  # the earlier process's files went first
    assert health.spans_dropped["disk_cap"] == 50 - len(kept)  # only this process's spans


class FullDisk:
    """A span file on a disk with `room` bytes left: writes fill it, then raise ENOSPC, as a real one does."""

    def __init__(self, real: Any, room: int) -> None:
        self.real, self.room = real, room

    def write(self, data: Any) -> int:
        if self.room <= 0:
            raise OSError(28, "No space left on device")
        n = min(len(data), self.room)
        self.room -= n
        return self.real.write(bytes(data[:n]))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def test_file_sink_full_disk_drops_counts_warns_once_and_recovers(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="rpc_observe")
    sink = OtlpJsonFileSink(str(tmp_path / "s.jsonl"), RESOURCE, file_bytes=1 << 20, max_bytes=1 << 30)
    sink.export(numbered(0, 3))
    sink._file = disk = FullDisk(sink._file, room=500)  # half of the next line fits, then the disk is full
    for i in range(1, 6):
        assert sink.export(numbered(i * 3, 3)) is True  # never raises, never False
    assert health.spans_dropped["disk_error"] == 15
    assert spans_in_files(sink) == [0, 1, 2]  # the partial line was taken back: every line parses
    disk.room = 1 << 20  # the disk frees up: the next batch is written
    sink.export(numbered(100, 2))
    sink.shutdown()
    assert spans_in_files(sink) == [0, 1, 2, 100, 101]
    assert health.spans_dropped["disk_error"] == 15 and health.internal_errors == {}
    warned = sink_warnings(caplog)
    assert len(warned) == 1, warned
    assert f"cannot write span file {tmp_path / 's.jsonl'} (ENOSPC: No space left on device)" in warned[0]
    assert 'reason="disk_error"' in warned[0]


def test_file_sink_partial_line_that_cannot_be_taken_back_stays_on_its_own_line(tmp_path: Path) -> None:
    sink = OtlpJsonFileSink(str(tmp_path / "s.jsonl"), RESOURCE, file_bytes=1 << 20, max_bytes=0)
    sink.export(numbered(0, 1))
    disk = FullDisk(sink._file, room=100)

    def truncate(size: int) -> int:
        raise OSError(5, "Input/output error")

    disk.truncate = truncate  # type: ignore[attr-defined]
    sink._file = disk
    sink.export(numbered(1, 3))
    disk.room = 1 << 20
    sink.export(numbered(4, 1))
    sink.shutdown()
    lines = Path(sink.path).read_text(encoding="utf-8").splitlines()
    assert len(lines) == 3 and len(lines[1]) == 100  # the garbage is a line of its own...
    assert [int(s["spanId"], 16) for i in (0, 2) for s in json.loads(lines[i])["resourceSpans"][0]["scopeSpans"][0][
        "spans"]] == [0, 4]  # ...and the lines around it are whole
    assert health.spans_dropped["disk_error"] == 3


@pytest.mark.parametrize("failing", ["rename", "remove"])
def test_file_sink_unwritable_directory_at_rotation_or_deletion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture,
                                                                failing: str) -> None:
    """The directory turns read-only (EROFS) while the job runs: rotation or the cap's deletion fails."""
    caplog.set_level(logging.WARNING, logger="rpc_observe")
    sink = OtlpJsonFileSink(str(tmp_path / "s.jsonl"), RESOURCE, file_bytes=3000, max_bytes=9000)
    exported = 0
    for _ in range(12):  # into the cap: files rotated, and the oldest deleted
        sink.export(numbered(exported, 4))
        exported += 4
    assert health.spans_dropped["disk_cap"] > 0
    real = getattr(os, failing)

    def read_only(*args: Any) -> None:
        raise OSError(30, "Read-only file system", args[0])

    monkeypatch.setattr(os, failing, read_only)
    for _ in range(6):
        sink.export(numbered(exported, 4))
        exported += 4
    assert health.spans_dropped["disk_error"] > 0
    assert sum(p.stat().st_size for p in files_of(sink)) <= 9000  # still under the cap
    monkeypatch.setattr(os, failing, real)  # writable again
    for _ in range(6):
        sink.export(numbered(exported, 4))
        exported += 4
    sink.shutdown()
    kept = spans_in_files(sink)
    assert kept[-4:] == list(range(exported - 4, exported))  # written again
    assert sum(p.stat().st_size for p in files_of(sink)) <= 9000
    assert health.spans_dropped["disk_cap"] + health.spans_dropped["disk_error"] == exported - len(kept)
    warned = [w for w in sink_warnings(caplog) if "cannot write span file" in w]
    assert len(warned) == 1 and "(EROFS: Read-only file system)" in warned[0]


def test_file_sink_that_cannot_even_open_its_file_counts_and_goes_on(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="rpc_observe")
    missing = tmp_path / "gone" / "s.jsonl"
    sink = OtlpJsonFileSink(str(missing), RESOURCE)  # no exception out of the constructor
    assert sink.export(numbered(0, 3)) is True
    missing.parent.mkdir()
    sink.export(numbered(3, 2))  # retried: the directory is back
    sink.shutdown()
    assert spans_of(missing) == [3, 4] and health.spans_dropped["disk_error"] == 3
    warned = sink_warnings(caplog)
    assert len(warned) == 1 and "(ENOENT: No such file or directory)" in warned[0]
