"""``rpc-observe merge``: merge per-process torch.profiler traces and RPC span
files into one Chrome-trace JSON (opens in Perfetto UI and chrome://tracing).

Inputs, any mix (files, or directories scanned recursively):

* torch.profiler Chrome traces (``export_chrome_trace`` /
  ``tensorboard_trace_handler`` output, ``.json`` or ``.json.gz``).  They must
  carry ``baseTimeNanoseconds``; event ``ts`` are microseconds relative to it.
  The worker is taken from the top-level ``rpc_observe.worker`` key, else from
  the trace's OS pid matching a span file's ``process.pid``, else the file name.
* span files (``spans/*.jsonl``): OTLP/HTTP JSON, one export batch per line.

Output: one process per worker (named after it), its profiler events and its
RPC spans (client slices on the caller, server slices on the callee, laid out
on "RPC client"/"RPC server" lanes) on one clock, with flow arrows client ->
server (request) and server -> client (reply).  Clock offsets are estimated
from the RPC pairs (see :mod:`rpc_observe._clock`) and reported in the
top-level ``rpc_observe_merge`` key and on stderr.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from ._clock import ClockEstimate, RpcPair, estimate_offsets

__all__ = [
    "Span", "TraceInput", "SpanInput", "Skipped", "MergeResult", "BadInput", "IgnoredInput",
    "collect_inputs", "load_input", "merge", "write_merged", "main",
]

PROG = "rpc-observe merge"
SPAN_CAT = "rpc_observe.span"
FLOW_CAT = "rpc_observe.flow"
KIND_SERVER, KIND_CLIENT = 2, 3
_KIND_NAMES = {"SPAN_KIND_SERVER": KIND_SERVER, "SPAN_KIND_CLIENT": KIND_CLIENT}
_STATUS_NAMES = {"STATUS_CODE_UNSET": 0, "STATUS_CODE_OK": 1, "STATUS_CODE_ERROR": 2}
LANE_TID_BASE = 1_000_000_000  # above any Linux tid (pid_max <= 2**22)
MARKER_US = 1.0  # send/receive marker slices that flows bind to
_CPU_CATS = {"cpu_op", "python_function", "user_annotation", "cpu_instant_event", "rpc_observe"}


class BadInput(Exception):
    """An input file that cannot be used; ``str(exc)`` is the reason."""


class IgnoredInput(Exception):
    """A file rpc_observe itself writes that is not merge input (a previous
    merge's output, a Prometheus file_sd target); ``str(exc)`` says which."""


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: int
    start_ns: int
    end_ns: int
    worker: str
    attrs: dict[str, Any]
    status_code: int = 0
    status_message: str = ""
    events: list[dict[str, Any]] = field(default_factory=list)
    source: str = ""


@dataclass
class TraceInput:
    path: Path
    data: dict[str, Any]
    base_ns: int
    worker_hint: str | None
    pid_hint: int | None
    main_pid: int | None
    run_id: str | None
    rank: int | None
    min_ts: float | None
    worker: str = ""


@dataclass
class SpanInput:
    path: Path
    spans: list[Span]
    run_ids: Counter
    pids: dict[int, set[str]]
    problems: list[str] = field(default_factory=list)


@dataclass
class Skipped:
    file: str
    reason: str


@dataclass
class MergeResult:
    trace: dict[str, Any] | None
    skipped: list[Skipped]
    clock: ClockEstimate | None
    workers: list[str]

    @property
    def status(self) -> int:
        """CLI exit status: 0 all merged, 2 something skipped, 1 nothing usable."""
        if self.trace is None:
            return 1
        return 2 if self.skipped else 0


# ----------------------------------------------------------------- inputs ---

_SUFFIXES = (".json", ".json.gz", ".jsonl", ".jsonl.gz")


def collect_inputs(paths: Iterable[str | os.PathLike]) -> tuple[list[Path], list[Skipped]]:
    """Expand files and directories (recursively) into input files."""
    files: list[Path] = []
    missing: list[Skipped] = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(sorted(
                f for f in p.rglob("*")
                if f.is_file() and f.name.endswith(_SUFFIXES) and not f.name.startswith(".")
            ))
        elif p.is_file():
            files.append(p)
        else:
            missing.append(Skipped(str(p), "no such file or directory"))
    return list(dict.fromkeys(files)), missing


def _read_text(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            raw = f.read()
        if raw[:2] == b"\x1f\x8b":
            try:
                raw = gzip.decompress(raw)
            except (EOFError, OSError, zlib.error) as e:
                raise BadInput(f"truncated or corrupt gzip ({e})") from None
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadInput("not UTF-8 text") from None
    except OSError as e:
        raise BadInput(f"cannot read ({e.strerror or e})") from None


def _json_error(e: json.JSONDecodeError, text: str) -> str:
    if e.pos >= len(text.rstrip()) or e.msg.startswith("Unterminated string"):
        return f"truncated JSON (document ends after {len(text.encode())} bytes)"
    return f"invalid JSON ({e.msg} at line {e.lineno} column {e.colno})"


def load_input(path: Path) -> TraceInput | SpanInput:
    """Parse one input file.  Raises :class:`BadInput` for unusable files and
    :class:`IgnoredInput` for rpc_observe's own non-input files."""
    text = _read_text(path)
    if not text.strip():
        if path.name.endswith((".jsonl", ".jsonl.gz")):  # a worker that exported no span
            return SpanInput(path=path, spans=[], run_ids=Counter(), pids={})
        raise BadInput("empty file")
    if not path.name.endswith((".jsonl", ".jsonl.gz")):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            first = text.lstrip()[:1]
            if first == "{" and '"resourceSpans"' in text[:4096] and "\n" in text.strip():
                return _load_spans(path, text)  # JSON-lines without .jsonl suffix
            raise BadInput(_json_error(e, text)) from None
        if isinstance(doc, dict) and "rpc_observe_merge" in doc:
            raise IgnoredInput("output of a previous merge")
        if isinstance(doc, list) and doc and all(isinstance(e, dict) and "targets" in e for e in doc):
            raise IgnoredInput("Prometheus file_sd target, not a trace")
        if isinstance(doc, dict) and "traceEvents" in doc:
            return _load_trace(path, doc)
        if isinstance(doc, dict) and "resourceSpans" in doc:
            return _spans_from_batches(path, [doc], [])
        if isinstance(doc, list) and doc and all(isinstance(e, dict) and "ph" in e for e in doc[:10]):
            raise BadInput("Chrome trace array without baseTimeNanoseconds (no absolute time)")
        keys = ", ".join(sorted(doc)[:6]) if isinstance(doc, dict) else type(doc).__name__
        raise BadInput(f"not a torch.profiler trace or OTLP span file (found: {keys})")
    return _load_spans(path, text)


def _load_trace(path: Path, doc: dict[str, Any]) -> TraceInput:
    events = doc.get("traceEvents")
    if not isinstance(events, list):
        raise BadInput("'traceEvents' is not a list")
    base = doc.get("baseTimeNanoseconds")
    try:
        base_ns = int(base) if not isinstance(base, bool) else 0
    except (TypeError, ValueError):
        base_ns = 0
    if base_ns <= 0:
        raise BadInput("profiler trace without baseTimeNanoseconds (no absolute time)")
    ro = doc.get("rpc_observe") if isinstance(doc.get("rpc_observe"), dict) else {}
    di = doc.get("distributedInfo") if isinstance(doc.get("distributedInfo"), dict) else {}
    pid_hint = _to_int(ro.get("pid"))
    min_ts: float | None = None
    cpu_pids: Counter = Counter()
    all_pids: Counter = Counter()
    for ev in events:
        if not isinstance(ev, dict):
            continue
        pid = ev.get("pid")
        ph = ev.get("ph")
        if ph != "M":
            ts = ev.get("ts")
            if isinstance(ts, (int, float)) and (min_ts is None or ts < min_ts):
                min_ts = ts
        if type(pid) is int:
            all_pids[pid] += 1
            if ev.get("cat") in _CPU_CATS:
                cpu_pids[pid] += 1
    if pid_hint is not None and pid_hint in all_pids:
        main_pid: int | None = pid_hint
    else:
        main_pid = (cpu_pids or all_pids).most_common(1)[0][0] if all_pids else None
    worker = ro.get("worker")
    return TraceInput(
        path=path, data=doc, base_ns=base_ns,
        worker_hint=str(worker) if worker else None,
        pid_hint=pid_hint if pid_hint is not None else main_pid,
        main_pid=main_pid,
        run_id=str(ro["run_id"]) if ro.get("run_id") else None,
        rank=_to_int(di.get("rank", ro.get("rank"))),
        min_ts=min_ts,
    )


def _load_spans(path: Path, text: str) -> SpanInput:
    batches: list[dict[str, Any]] = []
    problems: list[str] = []
    lines = text.splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            last = all(not rest.strip() for rest in lines[n:])
            problems.append(f"line {n}: " + (_json_error(e, line) if last else f"invalid JSON ({e.msg})"))
            continue
        if not isinstance(obj, dict) or "resourceSpans" not in obj:
            problems.append(f"line {n}: not an OTLP export batch (no resourceSpans)")
            continue
        batches.append(obj)
    return _spans_from_batches(path, batches, problems)


def _spans_from_batches(path: Path, batches: list[dict], problems: list[str]) -> SpanInput:
    out = SpanInput(path=path, spans=[], run_ids=Counter(), pids={}, problems=problems)
    bad = 0
    for batch in batches:
        for rs in batch.get("resourceSpans") or []:
            if not isinstance(rs, dict):
                continue
            res = _attrs((rs.get("resource") or {}).get("attributes"))
            run_id = res.get("rpc_observe.run_id") or None
            pid = _to_int(res.get("process.pid"))
            worker_res = res.get("torch.rpc.worker")
            for ss in (rs.get("scopeSpans") or rs.get("instrumentationLibrarySpans") or []):
                for raw in (ss or {}).get("spans") or []:
                    sp = _parse_span(raw, worker_res, pid, str(path))
                    if sp is None:
                        bad += 1
                        continue
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


def _parse_span(raw: Any, worker_res: Any, pid: int | None, source: str) -> Span | None:
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
    kind = raw.get("kind", 0)
    kind = _KIND_NAMES.get(kind, 0) if isinstance(kind, str) else _to_int(kind) or 0
    attrs = _attrs(raw.get("attributes"))
    status = raw.get("status") if isinstance(raw.get("status"), dict) else {}
    code = status.get("code", 0)
    code = _STATUS_NAMES.get(code, 0) if isinstance(code, str) else _to_int(code) or 0
    worker = worker_res or (attrs.get("torch.rpc.src") if kind == KIND_CLIENT else attrs.get("torch.rpc.dst"))
    worker = str(worker) if worker else (f"pid {pid}" if pid is not None else Path(source).stem)
    events = []
    for ev in raw.get("events") or []:
        if isinstance(ev, dict):
            events.append({"name": ev.get("name", ""), **_attrs(ev.get("attributes"))})
    return Span(trace_id, span_id, str(raw.get("parentSpanId") or "").lower(),
                str(raw.get("name") or attrs.get("rpc.method") or "rpc"), kind,
                start, max(end, start), worker, attrs, code,
                str(status.get("message") or ""), events, source)


def _any_value(v: Any) -> Any:
    if not isinstance(v, dict):
        return v
    if "stringValue" in v:
        return v["stringValue"]
    if "intValue" in v:
        return _to_int(v["intValue"])
    if "doubleValue" in v:
        return v["doubleValue"]
    if "boolValue" in v:
        return v["boolValue"]
    if "arrayValue" in v:
        return [_any_value(x) for x in (v["arrayValue"] or {}).get("values") or []]
    if "kvlistValue" in v:
        return _attrs((v["kvlistValue"] or {}).get("values"))
    if "bytesValue" in v:
        return v["bytesValue"]
    return None


def _attrs(kvs: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in kvs or []:
        if isinstance(kv, dict) and "key" in kv:
            out[str(kv["key"])] = _any_value(kv.get("value"))
    return out


def _to_int(v: Any) -> int | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        try:
            return int(float(v))
        except (TypeError, ValueError):
            return None


def _natural(s: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def _trace_stem(path: Path) -> str:
    """``host_123.1700000000000.pt.trace.json.gz`` -> ``host_123`` (the
    tensorboard_trace_handler name without its per-export timestamp)."""
    name = path.name
    for suf in (".gz", ".json", ".pt.trace"):
        if name.endswith(suf):
            name = name[: -len(suf)]
    return re.sub(r"\.\d+$", "", name) or path.name


# ------------------------------------------------------------------ merge ---

def merge(
    paths: Sequence[str | os.PathLike],
    *,
    run_id: str | None = None,
    exclude: Iterable[str | os.PathLike] = (),
    log: Callable[[str], None] | None = None,
) -> MergeResult:
    """Load and merge the inputs; ``result.trace`` is the Chrome-trace dict
    (``None`` when nothing was usable).  ``log`` gets one line per note."""
    log = log or (lambda _m: None)
    files, skipped = collect_inputs(paths)
    excluded = {Path(p).resolve() for p in exclude}
    traces: list[TraceInput] = []
    span_inputs: list[SpanInput] = []
    for f in files:
        if f.resolve() in excluded:
            continue
        try:
            loaded = load_input(f)
        except BadInput as e:
            skipped.append(Skipped(str(f), str(e)))
            continue
        except IgnoredInput as e:
            log(f"ignored {f}: {e}")
            continue
        if isinstance(loaded, TraceInput):
            traces.append(loaded)
        else:
            span_inputs.append(loaded)
            if loaded.problems:
                skipped.append(Skipped(str(f), "partially read: " + "; ".join(loaded.problems[:3])))

    # ---- run id: majority vote, one vote per file
    if run_id is None:
        votes: Counter = Counter(t.run_id for t in traces if t.run_id)
        votes.update(si.run_ids.most_common(1)[0][0] for si in span_inputs if si.run_ids)
        if votes:
            run_id = sorted(votes.items(), key=lambda kv: (-kv[1], kv[0]))[0][0]
    if run_id is not None:
        kept_traces = []
        for t in traces:
            if t.run_id and t.run_id != run_id:
                skipped.append(Skipped(str(t.path), f"from another run (run_id {t.run_id!r}, merging {run_id!r})"))
            else:
                kept_traces.append(t)
        traces = kept_traces
        kept_inputs = []
        for si in span_inputs:
            good = [s for s in si.spans if s.attrs.get("_run_id") in (None, run_id)]
            if not good and si.spans:
                others = ", ".join(repr(r) for r in si.run_ids)
                skipped.append(Skipped(str(si.path), f"from another run (run_id {others}, merging {run_id!r})"))
                continue
            if len(good) < len(si.spans):
                skipped.append(Skipped(str(si.path), f"{len(si.spans) - len(good)} span(s) from another run dropped"))
            si.spans = good
            kept_inputs.append(si)
        span_inputs = kept_inputs

    # ---- spans: dedupe, worker identities
    spans: dict[tuple[str, str], Span] = {}
    pid_workers: dict[int, set[str]] = {}
    for si in span_inputs:
        for s in si.spans:
            s.attrs.pop("_run_id", None)
            spans.setdefault((s.trace_id, s.span_id), s)
        for pid, ws in si.pids.items():
            pid_workers.setdefault(pid, set()).update(ws)
    if not traces and not spans:
        return MergeResult(None, skipped, None, [])
    ranks: dict[str, int] = {}
    for t in traces:
        if t.worker_hint:
            t.worker = t.worker_hint
        elif t.pid_hint is not None and len(pid_workers.get(t.pid_hint, ())) == 1:
            t.worker = next(iter(pid_workers[t.pid_hint]))
        else:
            t.worker = _trace_stem(t.path)
        if t.rank is not None:
            ranks.setdefault(t.worker, t.rank)
    names = {s.worker for s in spans.values()} | {t.worker for t in traces}
    workers = sorted(names, key=lambda w: (ranks.get(w, 1 << 30), _natural(w)))

    # ---- pairs and clock offsets
    all_times = [s.start_ns for s in spans.values()] + [
        t.base_ns + int((t.min_ts or 0) * 1000) for t in traces]
    pivot_ns = min(all_times)

    def rel(ns: int) -> float:
        return (ns - pivot_ns) / 1000.0

    pairs: list[tuple[Span, Span]] = []
    for s in spans.values():
        if s.kind == KIND_SERVER and s.parent_id:
            c = spans.get((s.trace_id, s.parent_id))
            if c is not None and c.kind == KIND_CLIENT:
                pairs.append((c, s))
    # A failed client (timeout, lost peer) may end before its server does: such a pair
    # says nothing about the clocks.
    clock = estimate_offsets(
        [RpcPair(c.worker, s.worker, rel(c.start_ns), rel(c.end_ns), rel(s.start_ns), rel(s.end_ns))
         for c, s in pairs if c.status_code != 2],
        workers,
    )
    off = clock.offsets_us
    worker_min: dict[str, float] = {}
    for s in spans.values():
        v = rel(s.start_ns)
        worker_min[s.worker] = min(worker_min.get(s.worker, v), v)
    for t in traces:
        v = rel(t.base_ns) + (t.min_ts or 0.0)
        worker_min[t.worker] = min(worker_min.get(t.worker, v), v)
    origin = min(v + off.get(w, 0.0) for w, v in worker_min.items())

    # ---- output
    out_events: list[dict[str, Any]] = []
    main_pid = {w: (i + 1) * 100 for i, w in enumerate(workers)}
    sort_base = {w: i * 100 for i, w in enumerate(workers)}
    os_pids: dict[str, set[int]] = {w: set() for w in workers}
    extra_pids: dict[tuple[str, Any], int] = {}
    flow_ids: dict[tuple, int] = {}

    def flow_id(key: tuple) -> int:
        return flow_ids.setdefault(key, len(flow_ids) + 1)

    for fi, t in enumerate(traces):
        w = t.worker
        if t.main_pid is not None:
            os_pids[w].add(t.main_pid)
        shift = rel(t.base_ns) + off.get(w, 0.0) - origin
        _convert_trace(t, fi, shift, main_pid[w], sort_base[w], extra_pids, flow_id, out_events)

    for pid, ws in pid_workers.items():
        for w in ws:
            os_pids.setdefault(w, set()).add(pid)
    n_flows = _emit_spans(spans, pairs, workers, main_pid, off, origin, rel, flow_id, out_events)

    meta_events: list[dict[str, Any]] = []
    for i, w in enumerate(workers):
        labels = [f"rank {ranks[w]}"] if w in ranks else []
        labels += [f"os pid {p}" for p in sorted(os_pids[w])]
        if clock.bounds_us.get(w) is not None:
            labels.append(f"clock {off.get(w, 0.0):+.1f} us ± {clock.bounds_us[w]:.1f}")
        pid = main_pid[w]
        meta_events += [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": w}},
            {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": sort_base[w]}},
        ]
        if labels:
            meta_events.append({"ph": "M", "name": "process_labels", "pid": pid, "tid": 0,
                                "args": {"labels": ", ".join(labels)}})

    origin_ns = pivot_ns + round(origin * 1000)
    summary = {
        "version": 1,
        "run_id": run_id,
        "origin_unix_ns": origin_ns,
        "reference_worker": clock.reference,
        "offsets_us": {w: round(off.get(w, 0.0), 3) for w in workers},
        "bounds_us": {w: (None if clock.bounds_us.get(w) is None else round(clock.bounds_us[w], 3))
                      for w in workers},
        "unaligned": [w for w in workers if clock.bounds_us.get(w) is None],
        "inconsistent_pairs": [list(k) for k in clock.inconsistent_edges],
        "workers": {w: {"pid": main_pid[w], "rank": ranks.get(w), "os_pids": sorted(os_pids[w]),
                        "rpc_pairs": clock.pairs_per_worker.get(w, 0)} for w in workers},
        "inputs": {"traces": [str(t.path) for t in traces],
                   "span_files": [str(si.path) for si in span_inputs]},
        "rpc": {"spans": len(spans), "pairs": len(pairs), "flows": n_flows},
        "skipped": [{"file": s.file, "reason": s.reason} for s in skipped],
    }
    # Key order matters to Perfetto: displayTimeUnit first, and older Perfetto
    # versions stop reading at an unknown key, so ours comes after traceEvents.
    trace = {"displayTimeUnit": "ms", "traceEvents": meta_events + out_events,
             "rpc_observe_merge": summary}
    return MergeResult(trace, skipped, clock, workers)


def _convert_trace(t: TraceInput, fi: int, shift: float, pid_main: int, sort_base: int,
                   extra_pids: dict, flow_id: Callable[[tuple], int], out: list) -> None:
    """Re-home one profiler trace's events: pids, clock shift, flow ids."""
    w = t.worker
    events = t.data.get("traceEvents") or []
    t.data = {}  # let the loaded document go once converted
    for ev in events:
        if not isinstance(ev, dict):
            continue
        ph = ev.get("ph")
        pid = ev.get("pid")
        is_main = type(pid) is not int or pid == t.main_pid
        if ph == "M" and ev.get("name") in ("process_name", "process_labels", "process_sort_index"):
            if is_main:
                continue  # replaced by the worker's own metadata
            new = extra_pids.get((w, pid))
            if new is None:
                new = extra_pids[(w, pid)] = pid_main + 1 + sum(1 for k in extra_pids if k[0] == w)
            ev["pid"] = new
            args = ev.get("args") if isinstance(ev.get("args"), dict) else {}
            if ev["name"] == "process_name":
                ev["args"] = {"name": f"{w} {args.get('name', pid)}"}
            elif ev["name"] == "process_sort_index":
                ev["args"] = {"sort_index": sort_base + new - pid_main}
            out.append(ev)
            continue
        if is_main:
            ev["pid"] = pid_main
        else:
            new = extra_pids.get((w, pid))
            if new is None:
                new = extra_pids[(w, pid)] = pid_main + 1 + sum(1 for k in extra_pids if k[0] == w)
            ev["pid"] = new
        ts = ev.get("ts")
        if isinstance(ts, (int, float)) and not isinstance(ts, bool):
            ev["ts"] = round(ts + shift, 3)
        elif isinstance(ts, str):
            try:
                ev["ts"] = round(float(ts) + shift, 3)
            except ValueError:
                pass
        if ph in ("s", "t", "f") and "id" in ev:
            ev["id"] = flow_id(("p", fi, ev.get("cat"), ev.get("name"), str(ev["id"])))
        if "bind_id" in ev:
            ev["bind_id"] = flow_id(("b", fi, str(ev["bind_id"])))
        out.append(ev)


def _lanes(items: list[Span]) -> dict[int, int]:
    """Greedy interval partitioning: id(span) -> lane, no overlap in a lane."""
    ends: list[int] = []
    lanes: dict[int, int] = {}
    for s in sorted(items, key=lambda s: (s.start_ns, -s.end_ns)):
        for i, e in enumerate(ends):
            if e <= s.start_ns:
                ends[i] = s.end_ns
                lanes[id(s)] = i
                break
        else:
            lanes[id(s)] = len(ends)
            ends.append(s.end_ns)
    return lanes


def _emit_spans(spans: dict, pairs: list, workers: list[str], main_pid: dict, off: dict,
                origin: float, rel: Callable[[int], float], flow_id: Callable, out: list) -> int:
    placed: dict[int, tuple[int, int, float, float]] = {}  # id(span) -> pid, tid, ts, dur
    lane_names: dict[tuple[int, int], str] = {}
    groups: dict[tuple[str, int], list[Span]] = {}
    for s in spans.values():
        groups.setdefault((s.worker, s.kind), []).append(s)
    for wi, w in enumerate(workers):
        for role, kind, label in ((0, KIND_CLIENT, "RPC client"), (1, KIND_SERVER, "RPC server")):
            mine = groups.get((w, kind), [])
            lanes = _lanes(mine)
            for s in mine:
                tid = LANE_TID_BASE + wi * 10_000 + role * 5_000 + lanes[id(s)]
                lane_names[(main_pid[w], tid)] = f"{label} #{lanes[id(s)]}"
                ts = rel(s.start_ns) + off.get(w, 0.0) - origin
                placed[id(s)] = (main_pid[w], tid, ts, (s.end_ns - s.start_ns) / 1000.0)
    for (pid, tid), name in sorted(lane_names.items()):
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
        out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                    "args": {"sort_index": -100_000 + tid % 10_000}})

    for s in spans.values():
        p = placed.get(id(s))
        if p is None:  # neither client nor server (internal span): not drawn
            continue
        pid, tid, ts, dur = p
        kind = "client" if s.kind == KIND_CLIENT else "server"
        args: dict[str, Any] = {"trace_id": s.trace_id, "span_id": s.span_id, "kind": kind}
        if s.parent_id:
            args["parent_span_id"] = s.parent_id
        for key, name in (("rpc.method", "method"), ("torch.rpc.src", "src"),
                          ("torch.rpc.dst", "dst"), ("torch.rpc.exec_mode", "exec_mode")):
            if key in s.attrs:
                args[name] = s.attrs[key]
        args["status"] = {0: "UNSET", 1: "OK", 2: "ERROR"}.get(s.status_code, str(s.status_code))
        args["clock_offset_us"] = round(off.get(s.worker, 0.0), 3)
        args["attributes"] = s.attrs
        ev = {"ph": "X", "cat": SPAN_CAT, "name": s.name, "pid": pid, "tid": tid,
              "ts": round(ts, 3), "dur": round(dur, 3), "args": args}
        if s.status_code == 2:
            ev["cname"] = "terrible"
            exc = [e for e in s.events if e.get("name") == "exception"]
            args["error"] = s.status_message or (exc[0].get("exception.message", "") if exc else "") or "error"
            if exc:
                args["exception"] = exc[0]
        out.append(ev)

    n_flows = 0
    for c, s in pairs:
        pc, ps = placed.get(id(c)), placed.get(id(s))
        if pc is None or ps is None:
            continue
        c_send, c_recv = _markers(pc, "rpc send", "rpc reply received", c, out)
        s_recv, s_send = _markers(ps, "rpc receive", "rpc reply sent", s, out)
        for name, (fp, ft, fts), (tp, tt, tts) in (
            ("rpc request", c_send, s_recv), ("rpc reply", s_send, c_recv)
        ):
            fid = flow_id(("rpc", c.trace_id, c.span_id, name))
            out.append({"ph": "s", "cat": FLOW_CAT, "name": name, "id": fid, "pid": fp, "tid": ft, "ts": fts})
            out.append({"ph": "f", "bp": "e", "cat": FLOW_CAT, "name": name, "id": fid,
                        "pid": tp, "tid": tt, "ts": tts})
            n_flows += 1
    return n_flows


def _markers(p: tuple, first: str, last: str, s: Span, out: list) -> tuple[tuple, tuple]:
    """Add short marker slices just inside both ends of a span slice (Perfetto
    draws an arrow from the end of its source slice to the start of its target,
    so binding to markers makes arrows point the right way) and return the
    (pid, tid, ts) binding points for a flow at the start and at the end."""
    pid, tid, ts, dur = p
    if dur < MARKER_US:  # too short for markers: bind to the slice itself
        mid = round(ts + dur / 2, 3)
        return (pid, tid, mid), (pid, tid, mid)
    m = min(MARKER_US, dur / 8)
    a0, a1 = ts + m, ts + 2 * m
    b0, b1 = ts + dur - 2 * m, ts + dur - m
    for name, t0 in ((first, a0), (last, b0)):
        out.append({"ph": "X", "cat": SPAN_CAT, "name": name, "pid": pid, "tid": tid,
                    "ts": round(t0, 3), "dur": round(m, 3), "args": {"span_id": s.span_id}})
    return (pid, tid, round((a0 + a1) / 2, 3)), (pid, tid, round((b0 + b1) / 2, 3))


# ----------------------------------------------------------------- output ---

def write_merged(trace: dict[str, Any], path: str | os.PathLike, chunk: int = 20_000) -> None:
    """Write compact JSON (``.gz`` suffix: gzip), keys in dict order, events
    encoded in chunks, via a temporary file renamed into place."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    opener = gzip.open if path.name.endswith(".gz") else open
    sep = (",", ":")
    events = trace.get("traceEvents") or []
    with opener(tmp, "wt", encoding="utf-8") as f:
        f.write("{")
        for n, (k, v) in enumerate(trace.items()):
            f.write(("," if n else "") + json.dumps(k) + ":")
            if k != "traceEvents":
                f.write(json.dumps(v, separators=sep))
                continue
            f.write("[")
            for i in range(0, len(events), chunk):
                f.write(("," if i else "") + json.dumps(events[i:i + chunk], separators=sep)[1:-1])
            f.write("]")
        f.write("}\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog=PROG,
        description="Merge per-worker torch.profiler traces and RPC span files into one "
                    "Chrome-trace JSON (Perfetto UI / chrome://tracing), clocks aligned.")
    ap.add_argument("paths", nargs="*", metavar="PATH",
                    help="trace/span files or directories (recursive); default $RPC_OBSERVE_DIR "
                         "or ./rpc_observe_out")
    ap.add_argument("-o", "--output", default="merged.json",
                    help="output file (default merged.json; .gz suffix compresses)")
    ap.add_argument("--run-id", default=None,
                    help="merge only this run (default: the majority run id of the inputs)")
    ap.add_argument("-q", "--quiet", action="store_true", help="only report problems")
    args = ap.parse_args(argv)
    paths = args.paths or [os.environ.get("RPC_OBSERVE_DIR") or "rpc_observe_out"]

    def say(msg: str) -> None:
        print(f"{PROG}: {msg}", file=sys.stderr)

    result = merge(paths, run_id=args.run_id, exclude=[args.output],
                   log=None if args.quiet else say)
    for s in result.skipped:
        say(f"skipped {s.file}: {s.reason}")
    if result.trace is None:
        say("nothing usable to merge in " + ", ".join(map(str, paths)))
        return 1
    summ = result.trace["rpc_observe_merge"]
    if not args.quiet:
        for w in result.workers:
            b = summ["bounds_us"][w]
            tail = ("reference clock" if w == summ["reference_worker"] else
                    "no RPC path to the reference: wall clock trusted" if b is None else
                    f"± {b:.1f} us")
            say(f"clock offset {w}: {summ['offsets_us'][w]:+.1f} us ({tail})")
        for a, b in summ["inconsistent_pairs"]:
            say(f"warning: RPC timings between {a} and {b} are inconsistent (clock drift?)")
    write_merged(result.trace, args.output)
    if not args.quiet:
        say(f"wrote {args.output}: {len(result.workers)} worker(s), {summ['rpc']['spans']} span(s), "
            f"{summ['rpc']['flows']} RPC flow(s), {len(result.trace['traceEvents'])} events")
    return result.status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
