"""OTLP/HTTP JSON spans (what rpc_observe's file exporter writes: one export
batch a line) decoded into :class:`Span` records for ``rpc-observe merge``.

Decoding is lenient the way a crashed worker needs: a malformed span is
``None`` (counted by the caller) and the rest is kept.  :mod:`.spanfile`
reads the exporter's own layout by text and comes here for everything else.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from .model import KIND_CLIENT, KIND_SERVER, Span

_KIND_NAMES = {"SPAN_KIND_SERVER": KIND_SERVER, "SPAN_KIND_CLIENT": KIND_CLIENT}
_STATUS_NAMES = {"STATUS_CODE_UNSET": 0, "STATUS_CODE_OK": 1, "STATUS_CODE_ERROR": 2}


class Resource(NamedTuple):
    """What the merge needs of a span batch's resource."""

    worker: str | None
    pid: int | None
    run_id: str | None


class Site(NamedTuple):
    """What the spans of one call site share: name, kind, attributes, and the
    worker their route names (the caller for a client, the callee for a server)."""

    name: str
    kind: int
    attrs: dict[str, Any]
    route_worker: str | None


def resource_of(rs: dict[str, Any]) -> Resource:
    """The :class:`Resource` of one ``resourceSpans`` entry."""
    res = attributes((rs.get("resource") or {}).get("attributes"))
    worker = res.get("torch.rpc.worker")
    run_id = res.get("rpc_observe.run_id")
    return Resource(str(worker) if worker else None, to_int(res.get("process.pid")),
                    str(run_id) if run_id else None)


def batch_spans(batch: dict[str, Any]) -> Iterator[tuple[Resource, list[Any]]]:
    """(resource, raw span list) for every scope of an export batch."""
    for rs in batch.get("resourceSpans") or []:
        if not isinstance(rs, dict):
            continue
        res = resource_of(rs)
        for ss in (rs.get("scopeSpans") or rs.get("instrumentationLibrarySpans") or []):
            raw = (ss or {}).get("spans") if isinstance(ss, dict) else None
            if raw:
                yield res, raw


def site_of(name: Any, kind: Any, attrs_kv: Any) -> Site:
    """Decode the call-site part of a span (its name, kind and attributes)."""
    kind = _enum(kind or 0, _KIND_NAMES)
    attrs = attributes(attrs_kv)
    route = attrs.get("torch.rpc.src") if kind == KIND_CLIENT else attrs.get("torch.rpc.dst")
    return Site(str(name or attrs.get("rpc.method") or "rpc"), kind, attrs, str(route) if route else None)


def parse_span(raw: Any, res: Resource, path: Path) -> Span | None:
    """One OTLP span dict as a :class:`Span`; None if malformed."""
    if not isinstance(raw, dict):
        return None
    try:
        trace_id = _id(raw["traceId"])
        span_id = _id(raw["spanId"])
        start, end = int(raw["startTimeUnixNano"]), int(raw["endTimeUnixNano"])
    except (KeyError, TypeError, ValueError):
        return None
    if not trace_id or not span_id or start <= 0:
        return None
    site = site_of(raw.get("name"), raw.get("kind"), raw.get("attributes"))
    status = raw.get("status")
    if not isinstance(status, dict):
        status = {}
    code = _enum(status.get("code", 0), _STATUS_NAMES)
    events = [{"name": ev.get("name", ""), **attributes(ev.get("attributes"))}
              for ev in raw.get("events") or [] if isinstance(ev, dict)]
    return Span(trace_id, span_id, _id(raw.get("parentSpanId") or ""), site.name, site.kind,
                start, max(end, start), span_worker(res, site, path), site.attrs, code,
                str(status.get("message") or ""), events or ())


def _id(v: Any) -> str:
    """A span or trace id as lower-case hex; anything else JSON-escaped, so
    that ids can be written out as they are."""
    s = str(v).lower()
    return s if s.isascii() and s.isalnum() else json.dumps(s)[1:-1]


def span_worker(res: Resource, site: Site, path: Path) -> str:
    """Whose span it is: the resource's worker, else the one its route names."""
    if res.worker:
        return res.worker
    if site.route_worker:
        return site.route_worker
    return f"pid {res.pid}" if res.pid is not None else path.stem


def _enum(value: Any, names: dict[str, int]) -> int:
    """An OTLP enum, sent as its number or (protojson) its name; 0 if unknown."""
    return names.get(value, 0) if isinstance(value, str) else to_int(value) or 0


def _any_value(v: Any) -> Any:
    if not isinstance(v, dict):
        return v
    if "stringValue" in v:
        return v["stringValue"]
    if "intValue" in v:
        return to_int(v["intValue"])
    if "doubleValue" in v:
        return v["doubleValue"]
    if "boolValue" in v:
        return v["boolValue"]
    if "arrayValue" in v:
        return [_any_value(x) for x in (v["arrayValue"] or {}).get("values") or []]
    if "kvlistValue" in v:
        return attributes((v["kvlistValue"] or {}).get("values"))
    if "bytesValue" in v:
        return v["bytesValue"]
    return None


def attributes(kvs: Any) -> dict[str, Any]:
    """An OTLP key/value list as a dict of plain values."""
    out: dict[str, Any] = {}
    for kv in kvs or []:
        if isinstance(kv, dict) and "key" in kv:
            out[str(kv["key"])] = _any_value(kv.get("value"))
    return out


def to_int(v: Any) -> int | None:
    """``v`` as an int, or None.  OTLP JSON sends 64-bit ints as strings."""
    if v is None or isinstance(v, bool):
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        try:
            return int(float(v))
        except (TypeError, ValueError):
            return None
