"""OTLP/HTTP JSON span files (what rpc_observe's file exporter writes: one
export batch a line) read into :class:`SpanInput` for ``rpc-observe merge``.

Reading is lenient the way a crashed worker needs: bad lines and malformed
spans are counted as problems and the rest is kept; only a file with nothing
usable is a :class:`BadInput`.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from ._merge_model import KIND_CLIENT, KIND_SERVER, BadInput, Span, SpanInput, json_error

_KIND_NAMES = {"SPAN_KIND_SERVER": KIND_SERVER, "SPAN_KIND_CLIENT": KIND_CLIENT}
_STATUS_NAMES = {"STATUS_CODE_UNSET": 0, "STATUS_CODE_OK": 1, "STATUS_CODE_ERROR": 2}


def spans_from_lines(path: Path, text: str) -> SpanInput:
    """A JSON-lines span file, one OTLP export batch a line."""
    batches: list[dict[str, Any]] = []
    problems: list[str] = []
    lines = text.splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            # Only the last line can be cut short by a killed worker.
            last = all(not rest.strip() for rest in lines[n:])
            problems.append(f"line {n}: " + (json_error(e, line) if last else f"invalid JSON ({e.msg})"))
            continue
        if not isinstance(obj, dict) or "resourceSpans" not in obj:
            problems.append(f"line {n}: not an OTLP export batch (no resourceSpans)")
            continue
        batches.append(obj)
    return spans_from_batches(path, batches, problems)


def spans_from_batches(path: Path, batches: list[dict], problems: list[str]) -> SpanInput:
    """The spans of parsed export batches; ``problems`` gathers what was dropped."""
    out = SpanInput(path=path, spans=[], run_ids=Counter(), pids={}, problems=problems)
    bad = 0
    for batch in batches:
        for rs in batch.get("resourceSpans") or []:
            if not isinstance(rs, dict):
                continue
            res = _attributes((rs.get("resource") or {}).get("attributes"))
            run_id = res.get("rpc_observe.run_id") or None
            pid = to_int(res.get("process.pid"))
            worker_res = res.get("torch.rpc.worker")
            for ss in (rs.get("scopeSpans") or rs.get("instrumentationLibrarySpans") or []):
                for raw in (ss or {}).get("spans") or []:
                    sp = _parse_span(raw, worker_res, pid, path)
                    if sp is None:
                        bad += 1
                        continue
                    # Carried in attrs until the run is chosen; dropped before output.
                    sp.attrs["_run_id"] = run_id
                    out.spans.append(sp)
                    if run_id is not None:
                        out.run_ids[str(run_id)] += 1
                    if pid is not None:
                        out.pids.setdefault(pid, set()).add(sp.worker)
    if bad:
        problems.append(f"{bad} malformed span(s) ignored")
    if not out.spans and problems:
        raise BadInput("; ".join(problems[:3]))
    return out


def _parse_span(raw: Any, worker_res: Any, pid: int | None, path: Path) -> Span | None:
    if not isinstance(raw, dict):
        return None
    try:
        trace_id = str(raw["traceId"]).lower()
        span_id = str(raw["spanId"]).lower()
        start, end = int(raw["startTimeUnixNano"]), int(raw["endTimeUnixNano"])
    except (KeyError, TypeError, ValueError):
        return None
    if not trace_id or not span_id or start <= 0:
        return None
    kind = _enum(raw.get("kind", 0), _KIND_NAMES)
    attrs = _attributes(raw.get("attributes"))
    status = raw.get("status") if isinstance(raw.get("status"), dict) else {}
    code = _enum(status.get("code", 0), _STATUS_NAMES)
    # Without the resource's worker name, the span's own route says whose it is.
    worker = worker_res or (attrs.get("torch.rpc.src") if kind == KIND_CLIENT else attrs.get("torch.rpc.dst"))
    worker = str(worker) if worker else (f"pid {pid}" if pid is not None else path.stem)
    events = []
    for ev in raw.get("events") or []:
        if isinstance(ev, dict):
            events.append({"name": ev.get("name", ""), **_attributes(ev.get("attributes"))})
    return Span(trace_id, span_id, str(raw.get("parentSpanId") or "").lower(),
                str(raw.get("name") or attrs.get("rpc.method") or "rpc"), kind,
                start, max(end, start), worker, attrs, code,
                str(status.get("message") or ""), events)


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
        return _attributes((v["kvlistValue"] or {}).get("values"))
    if "bytesValue" in v:
        return v["bytesValue"]
    return None


def _attributes(kvs: Any) -> dict[str, Any]:
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
