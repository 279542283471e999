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


@pytest.fixture
def file_sink(tmp_path: Path) -> Iterator[OtlpJsonFileSink]:
    sink = OtlpJsonFileSink(str(tmp_path / "spans.jsonl"), RESOURCE)
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
