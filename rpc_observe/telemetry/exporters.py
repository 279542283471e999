"""Where span records go: OTLP JSON lines in a file, or any OpenTelemetry SDK exporter.

`OTEL_TRACES_EXPORTER` picks them: `file` (the default: one OTLP/HTTP JSON export
request per line under `$RPC_OBSERVE_DIR/spans/`, rotated at RPC_OBSERVE_SPANS_FILE_BYTES
and capped at RPC_OBSERVE_SPANS_MAX_BYTES per process), `otlp` (OTLP to a collector,
configured by the standard `OTEL_EXPORTER_OTLP_*` variables), `console`, or `none`.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Iterable
from typing import Any

from .. import __version__
from ..config import RPC_OBSERVE_SPANS_MAX_BYTES, Config
from . import health
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


_TAIL = b"]}]}]}\n"
# The callee's own time for a call, in s, on CLIENT spans sent to OTLP and console exporters. The span
# files leave it out: there a call site's attributes are one piece of text that `rpc-observe merge`
# decodes once per site, and the same split is in the file as the callee's SERVER span.
CALLEE_DURATION = "torch.rpc.callee.duration"
# A successful span, with and without a parent; the call site's name, kind and attributes go in the last %s.
_SPAN_JSON = ('{"traceId":"%032x","spanId":"%016x","startTimeUnixNano":"%d","endTimeUnixNano":"%d"%s,'
              '"status":{"code":0}}')
_CHILD_SPAN_JSON = ('{"traceId":"%032x","spanId":"%016x","parentSpanId":"%016x","startTimeUnixNano":"%d",'
                    '"endTimeUnixNano":"%d"%s,"status":{"code":0}}')

# The lines of a batch in C (_spanjson.c, where built): (records, span_json, site_text, head, tail, budget) -> lines
LinesEncoder = Callable[[Iterable[SpanRecord], Callable, Callable, bytes, bytes, int], list[tuple[bytes, int]]]


@functools.cache
def _native_lines() -> LinesEncoder | None:
    """_spanjson.lines, handed the span templates above cut at their values; None where it is not built."""
    try:
        from . import _spanjson
    except ImportError:
        return None
    value = re.compile(r"%0(?:32|16)x|%d|%s")
    try:
        _spanjson.configure(SpanRecord, *(tuple(piece.encode() for piece in value.split(template))
                                          for template in (_SPAN_JSON, _CHILD_SPAN_JSON)))
    except (TypeError, ValueError):  # built from another version of this code: the Python encoding
        return None
    return _spanjson.lines


class OtlpJsonFileSink:
    """Writes each batch as OTLP/HTTP JSON `ExportTraceServiceRequest` lines, in rotated and capped files.

    `path` is the current file; rotated ones are `path.1` (the newest), `path.2`, ... as logrotate
    names them. A batch is split into lines of at most `file_bytes`, and a line that would take
    the current file past `file_bytes` goes to a new one, so no file outgrows it (but a single span
    bigger than it). Before a line would take all files past `max_bytes` (0: no cap), the oldest
    are deleted and their spans counted as dropped (`disk_cap`), so the total never exceeds the cap
    and the newest spans are kept. A write that fails (ENOSPC, EROFS, EIO) drops its spans
    (`disk_error`) with one warning; the next batch tries again. No OSError leaves this class.
    """

    def __init__(
        self, path: str, resource_attributes: dict, file_bytes: int = 64 << 20, max_bytes: int = 0,
        native: bool = False,
    ) -> None:
        """`native`: encode batches in C where built (RPC_OBSERVE_NO_EXTENSIONS=1 passes False)."""
        self.path = path
        self._native_lines = _native_lines() if native else None
        resource = json.dumps({"attributes": otlp_attributes(resource_attributes)}, separators=(",", ":"))
        scope = json.dumps(SCOPE, separators=(",", ":"))
        self._head = (
            '{"resourceSpans":[{"resource":%s,"scopeSpans":[{"scope":%s,"spans":[' % (resource, scope)
        ).encode()
        self._lock = threading.Lock()
        self._site_json: dict[tuple, tuple[dict, str]] = {}
        self._file_bytes = max(1, file_bytes)
        self._max_bytes = max_bytes
        self._size = 0  # bytes of the current file
        self._spans = 0  # spans of this process in the current file
        self._rotated: dict[int, list[int]] = {}  # N of path.N -> [bytes, spans]
        self._rotated_bytes = 0
        self._closed = False
        self._dirty = False  # a failed write left a partial line that truncate could not remove
        self._disk_warned = False
        self._cap_warned = False
        self._adopt_rotated()
        self._file: Any = None
        try:
            self._open()
        except OSError as e:  # retried with every batch
            self._disk_error(0, e)

    def _adopt_rotated(self) -> None:
        """Counts files an earlier process of the same name left (a reused pid, as PID 1 in containers)
        against the cap, oldest deleted first; their spans are not this process's, so not counted as dropped."""
        directory, base = os.path.split(self.path)
        try:
            names = os.listdir(directory or ".")
        except OSError:
            return
        for name in names:
            suffix = name[len(base) + 1:] if name.startswith(base + ".") else ""
            if suffix.isdigit() and suffix[0] != "0":
                try:
                    size = os.stat(os.path.join(directory, name)).st_size
                except OSError:
                    continue
                self._rotated[int(suffix)] = [size, 0]
                self._rotated_bytes += size

    def _open(self) -> None:
        # Unbuffered: a failed write leaves nothing in a buffer to be written again later.
        self._file = open(self.path, "ab", buffering=0)
        self._size = os.fstat(self._file.fileno()).st_size  # an earlier process's, or ours before an error

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
        if r.parent_id:
            return _CHILD_SPAN_JSON % (r.trace_id, r.span_id, r.parent_id, r.start_ns, r.end_ns, self._site(r))
        return _SPAN_JSON % (r.trace_id, r.span_id, r.start_ns, r.end_ns, self._site(r))

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

    def _lines(self, records: Iterable[SpanRecord]) -> list[tuple[bytes, int]]:
        """The batch as (line, spans) pairs, each line at most file_bytes unless one span alone is bigger."""
        budget = self._file_bytes - len(self._head) - len(_TAIL)
        if self._native_lines is not None:  # the same lines (tests/unit/test_spanjson.py), in a tenth of the time
            return self._native_lines(records, self._span_json, self._site, self._head, _TAIL, budget)
        # Formatted by hand: json.dumps of a dict per span cost the worker's GIL ~3x more.
        spans = [self._span_json(r).encode() for r in records]
        lines, start, size = [], 0, 0
        for i, span in enumerate(spans):
            if i > start and size + 1 + len(span) > budget:
                lines.append((self._head + b",".join(spans[start:i]) + _TAIL, i - start))
                start, size = i, 0
            size += len(span) + (i > start)
        if spans:
            lines.append((self._head + b",".join(spans[start:]) + _TAIL, len(spans) - start))
        return lines

    def export(self, records: Iterable[SpanRecord]) -> bool:
        """Writes the batch; False only after shutdown (the tracer counts those). Spans this sink
        drops itself (the cap, a disk error) are counted here, by reason."""
        lines = self._lines(records)
        with self._lock:
            if self._closed:  # shut down under a hung export
                return False
            for line, count in lines:
                self._write(line, count)
        return True

    def _write(self, line: bytes, count: int) -> None:
        try:
            if self._file is None:
                self._open()
            if self._size and self._size + len(line) > self._file_bytes:
                self._rotate()
            if self._max_bytes and not self._make_room(len(line), count):
                return
            if self._dirty:  # a partial line is at the end: this one starts on a line of its own
                line = b"\n" + line
            self._write_all(line)
            self._dirty = False
            self._size += len(line)
            self._spans += count
        except OSError as e:
            self._disk_error(count, e)

    def _write_all(self, line: bytes) -> None:
        view = memoryview(line)
        try:
            while view:
                view = view[self._file.write(view):]
        except OSError:
            if len(view) < len(line):  # a partial line: take it back, so that every line stays whole
                try:
                    self._file.truncate(self._size)
                except OSError:
                    self._dirty = True
                    self._size += len(line) - len(view)
            raise

    def _rotate(self) -> None:
        """current -> .1, .N -> .N+1 (oldest first, so nothing is overwritten), and a new current file."""
        file, self._file = self._file, None
        try:
            if file is not None:
                file.close()
        except OSError:
            pass
        for n in sorted(self._rotated, reverse=True):
            os.rename(f"{self.path}.{n}", f"{self.path}.{n + 1}")
            self._rotated[n + 1] = self._rotated.pop(n)  # kept in step with each rename: an error leaves it true
        os.rename(self.path, f"{self.path}.1")
        self._rotated[1] = [self._size, self._spans]
        self._rotated_bytes += self._size
        self._size = self._spans = 0
        self._dirty = False
        self._open()

    def _make_room(self, needed: int, count: int) -> bool:
        """Deletes the oldest files until `needed` more bytes fit under the cap; False: the line alone does not."""
        while self._size + self._rotated_bytes + needed > self._max_bytes:
            if not self._rotated:
                if not self._size:
                    self._cap_dropped(count, "a line bigger than the cap, not written")
                    return False
                self._rotate()
                continue
            oldest = max(self._rotated)
            path = f"{self.path}.{oldest}"
            try:
                os.remove(path)
            except FileNotFoundError:
                pass  # deleted by someone else: not ours to count
            size, spans = self._rotated.pop(oldest)
            self._rotated_bytes -= size
            self._cap_dropped(spans, f"deleted {path}")
        return True

    def _cap_dropped(self, spans: int, what: str) -> None:
        health.spans_lost(spans, "disk_cap")
        if not self._cap_warned:
            self._cap_warned = True
            _logger.warning(
                "rpc_observe: the span files of %s reached %s=%d: the oldest spans are dropped to keep the "
                'newest (%s: %d spans); they are counted in rpc_observe_spans_dropped_total{reason="disk_cap"}, '
                "without another warning",
                self.path,
                RPC_OBSERVE_SPANS_MAX_BYTES,
                self._max_bytes,
                what,
                spans,
            )

    def _disk_error(self, count: int, e: OSError) -> None:
        health.spans_lost(count, "disk_error")
        if not self._disk_warned:
            self._disk_warned = True
            code = errno.errorcode.get(e.errno or 0, str(e.errno))
            _logger.warning(
                "rpc_observe: cannot write span file %s (%s: %s): its spans are dropped and counted in "
                'rpc_observe_spans_dropped_total{reason="disk_error"}; every later batch tries again, '
                "without another warning; RPCs are unaffected",
                e.filename or self.path,
                code,
                e.strerror or e,
            )

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            if self._file is not None:
                try:
                    self._file.close()
                except OSError:
                    pass


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
        if record.callee_ns >= 0:  # a per-span value: here only, never in the span files (see CALLEE_DURATION)
            attributes = {**attributes, CALLEE_DURATION: record.callee_ns / 1e9}
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
                sinks.append(
                    OtlpJsonFileSink(path, resource_attributes, config.spans_file_bytes, config.spans_max_bytes,
                                     config.extensions)
                )
        elif name == "otlp":
            sinks.append(SdkExporterSink(_otlp_exporter(config), resource_attributes))
        elif name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            sinks.append(SdkExporterSink(ConsoleSpanExporter(), resource_attributes))
    return sinks
