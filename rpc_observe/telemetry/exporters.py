"""Where span records go: OTLP JSON lines in a file, or any OpenTelemetry SDK exporter.

`OTEL_TRACES_EXPORTER` picks them: `file` (the default: one OTLP/HTTP JSON export
request per line under `$RPC_OBSERVE_DIR/spans/`), `otlp` (OTLP to a collector,
configured by the standard `OTEL_EXPORTER_OTLP_*` variables), `console`, or `none`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable
from typing import Any

from .. import __version__
from ..config import Config
from .tracing import CLIENT, INTERNAL, SERVER, SpanRecord

_logger = logging.getLogger("rpc_observe")
SCOPE = {"name": "rpc_observe", "version": __version__}


def _any_value(value: Any) -> dict:
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    return {"stringValue": str(value)}


def otlp_attributes(attributes: dict) -> list[dict]:
    return [{"key": k, "value": _any_value(v)} for k, v in attributes.items()]


class OtlpJsonFileSink:
    """Writes each batch as one OTLP/HTTP JSON `ExportTraceServiceRequest` line."""

    def __init__(self, path: str, resource_attributes: dict):
        self.path = path
        resource = json.dumps({"attributes": otlp_attributes(resource_attributes)}, separators=(",", ":"))
        scope = json.dumps(SCOPE, separators=(",", ":"))
        self._head = '{"resourceSpans":[{"resource":%s,"scopeSpans":[{"scope":%s,"spans":[' % (resource, scope)
        self._lock = threading.Lock()
        self._site_json: dict[tuple, tuple[dict, str]] = {}
        self._file = open(path, "a", encoding="utf-8")

    def _site(self, record: SpanRecord) -> str:
        """The JSON of what a call site's spans share (name, kind, attributes), encoded once."""
        key = (id(record.attributes), record.name, record.kind)
        cached = self._site_json.get(key)
        if cached is None or cached[0] is not record.attributes:
            if len(self._site_json) > 10_000:
                self._site_json.clear()
            text = ',"name":%s,"kind":%d,"attributes":%s' % (
                json.dumps(record.name),
                record.kind,
                json.dumps(otlp_attributes(record.attributes), separators=(",", ":")),
            )
            cached = self._site_json[key] = (record.attributes, text)
        return cached[1]

    def _span_json(self, r: SpanRecord) -> str:
        if r.error_type is not None:
            return json.dumps(self._span(r), separators=(",", ":"))
        parent = ',"parentSpanId":"%016x"' % r.parent_id if r.parent_id else ""
        return (
            '{"traceId":"%032x","spanId":"%016x"%s,"startTimeUnixNano":"%d","endTimeUnixNano":"%d"%s,"status":{"code":0}}'
            % (r.trace_id, r.span_id, parent, r.start_ns, r.end_ns, self._site(r))
        )

    def _span(self, record: SpanRecord) -> dict:
        span = {
            "traceId": f"{record.trace_id:032x}",
            "spanId": f"{record.span_id:016x}",
            "name": record.name,
            "kind": record.kind,
            "startTimeUnixNano": str(record.start_ns),
            "endTimeUnixNano": str(record.end_ns),
            "attributes": otlp_attributes(record.attributes),
            "status": {"code": 0},
        }
        if record.parent_id:
            span["parentSpanId"] = f"{record.parent_id:016x}"
        if record.error_type is not None:
            span["attributes"] = span["attributes"] + [
                {"key": "error.type", "value": {"stringValue": record.error_type}}
            ]
            span["status"] = {"code": 2, "message": record.error_message}
            span["events"] = [
                {
                    "name": "exception",
                    "timeUnixNano": str(record.end_ns),
                    "attributes": otlp_attributes(
                        {"exception.type": record.error_type, "exception.message": record.error_message}
                    ),
                }
            ]
        return span

    def export(self, records: Iterable[SpanRecord]) -> bool:
        # Formatted by hand: json.dumps of a dict per span cost the worker's GIL ~3x more.
        line = self._head + ",".join(self._span_json(r) for r in records) + "]}]}]}\n"
        with self._lock:
            if self._file.closed:  # shut down under a hung export: counted as dropped
                return False
            self._file.write(line)
            self._file.flush()
        return True

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()


def _sdk_kind(kind: int) -> Any:
    from opentelemetry.trace import SpanKind

    return {INTERNAL: SpanKind.INTERNAL, SERVER: SpanKind.SERVER, CLIENT: SpanKind.CLIENT}[kind]


class SdkExporterSink:
    """Hands span records to an OpenTelemetry SDK `SpanExporter` as `ReadableSpan`s."""

    def __init__(self, exporter: Any, resource_attributes: dict):
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        self.exporter = exporter
        self._resource = Resource(resource_attributes)
        self._scope = InstrumentationScope(SCOPE["name"], SCOPE["version"])

    def _readable(self, record: SpanRecord) -> Any:
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.trace import SpanContext, Status, StatusCode, TraceFlags

        flags = TraceFlags(TraceFlags.SAMPLED)
        parent = (
            SpanContext(record.trace_id, record.parent_id, record.remote_parent, flags) if record.parent_id else None
        )
        attributes, status = record.attributes, Status(StatusCode.UNSET)
        events: tuple[Event, ...] = ()
        if record.error_type is not None:
            attributes = {**attributes, "error.type": record.error_type}
            status = Status(StatusCode.ERROR, record.error_message)
            events = (
                Event(
                    "exception",
                    {"exception.type": record.error_type, "exception.message": record.error_message},
                    record.end_ns,
                ),
            )
        return ReadableSpan(
            name=record.name,
            context=SpanContext(record.trace_id, record.span_id, False, flags),
            parent=parent,
            resource=self._resource,
            attributes=attributes,
            events=events,
            kind=_sdk_kind(record.kind),
            status=status,
            start_time=record.start_ns,
            end_time=record.end_ns,
            instrumentation_scope=self._scope,
        )

    def export(self, records: Iterable[SpanRecord]) -> bool:
        from opentelemetry.sdk.trace.export import SpanExportResult

        return self.exporter.export([self._readable(r) for r in records]) == SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.exporter.shutdown()


def _otlp_exporter(config: Config) -> Any:
    if config.otlp_protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            return OTLPSpanExporter()
        except ImportError:
            _logger.warning(
                "rpc_observe: OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs the package "
                "opentelemetry-exporter-otlp-proto-grpc; using http/protobuf"
            )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def build_sinks(config: Config, resource_attributes: dict, spans_dir: str | None, worker: str) -> list:
    """The sinks for OTEL_TRACES_EXPORTER; `spans_dir` None means the file sink is unavailable."""
    sinks: list = []
    for name in config.traces_exporters:
        if name == "file":
            if spans_dir is not None:
                path = os.path.join(spans_dir, f"{worker}-{os.getpid()}.jsonl")
                sinks.append(OtlpJsonFileSink(path, resource_attributes))
        elif name == "otlp":
            sinks.append(SdkExporterSink(_otlp_exporter(config), resource_attributes))
        elif name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            sinks.append(SdkExporterSink(ConsoleSpanExporter(), resource_attributes))
    return sinks
