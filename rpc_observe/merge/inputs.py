"""The inputs of ``rpc-observe merge``: loading the files, keeping one run,
streaming its spans through the limits, and telling which worker each
profiler trace belongs to.

Every file that cannot be used becomes a :class:`Skipped` with the reason, so
one bad file never stops the merge of the others.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .files import is_span_file, natural, read_text, span_streams, trace_stem
from .limits import Limits, SpanSink
from .model import BadInput, IgnoredInput, RunInputs, Skipped, SpanInput, TraceInput, json_error
from .otlp import to_int
from .parallel import read_streams
from .spanfile import earliest_start_ns, peek_run_id

# Kineto categories recorded by the profiled process itself (not by a GPU).
_CPU_CATS = {"cpu_op", "python_function", "user_annotation", "cpu_instant_event", "rpc_observe"}


def load_input(path: Path) -> TraceInput | SpanInput:
    """Parse one input file (a span file is only opened: it is read later, as
    a stream).  Raises :class:`BadInput` for unusable files and
    :class:`IgnoredInput` for rpc_observe's own non-input files."""
    if is_span_file(path):
        return SpanInput(paths=[path])
    text = read_text(path)
    if not text.strip():
        raise BadInput("empty file")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        first = text.lstrip()[:1]
        if first == "{" and '"resourceSpans"' in text[:4096] and "\n" in text.strip():
            return SpanInput(paths=[path])  # JSON-lines without .jsonl suffix
        raise BadInput(json_error(e, text)) from None
    if isinstance(doc, dict) and "rpc_observe_merge" in doc:
        raise IgnoredInput("output of a previous merge")
    if isinstance(doc, list) and doc and all(isinstance(e, dict) and "targets" in e for e in doc):
        raise IgnoredInput("Prometheus file_sd target, not a trace")
    if isinstance(doc, dict) and str(doc.get("schema", "")).startswith("rpc_observe.debug/"):
        raise IgnoredInput("flight recorder dump (read it with rpc-observe doctor)")
    if isinstance(doc, dict) and "traceEvents" in doc:
        return _scan_trace(path, doc)
    if isinstance(doc, dict) and "resourceSpans" in doc:
        return SpanInput(paths=[path], doc=doc)
    if isinstance(doc, list) and doc and all(isinstance(e, dict) and "ph" in e for e in doc[:10]):
        raise BadInput("Chrome trace array without baseTimeNanoseconds (no absolute time)")
    keys = ", ".join(sorted(doc)[:6]) if isinstance(doc, dict) else type(doc).__name__
    raise BadInput(f"not a torch.profiler trace or OTLP span file (found: {keys})")


def _scan_trace(path: Path, doc: dict[str, Any]) -> TraceInput:
    """What the merge needs to know of a profiler trace before converting it:
    its absolute time base, its first timestamp and its main process."""
    events = doc.get("traceEvents")
    if not isinstance(events, list):
        raise BadInput("'traceEvents' is not a list")
    base_ns = to_int(doc.get("baseTimeNanoseconds")) or 0
    if base_ns <= 0:
        raise BadInput("profiler trace without baseTimeNanoseconds (no absolute time)")
    ro, di = _dict(doc.get("rpc_observe")), _dict(doc.get("distributedInfo"))
    pid_hint = to_int(ro.get("pid"))
    min_ts: float | None = None
    cpu_pids: Counter = Counter()
    all_pids: Counter = Counter()
    for ev in events:
        if not isinstance(ev, dict):
            continue
        pid = ev.get("pid")
        if ev.get("ph") != "M":
            ts = ev.get("ts")
            if isinstance(ts, (int, float)) and (min_ts is None or ts < min_ts):
                min_ts = ts
        if type(pid) is int:
            all_pids[pid] += 1
            if ev.get("cat") in _CPU_CATS:
                cpu_pids[pid] += 1
    # The main process is the one rpc_observe named, else the one running most CPU ops
    # (GPU streams come as pseudo-processes of their own).
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
        rank=to_int(di.get("rank", ro.get("rank"))),
        min_ts=min_ts,
    )


def _dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def load_inputs(files: list[Path], exclude: Iterable[str | os.PathLike], log: Callable[[str], None],
                skipped: list[Skipped]) -> tuple[list[TraceInput], list[SpanInput]]:
    """Load every file not in ``exclude`` (a worker's rotated span files as one
    stream); what cannot be used goes to ``skipped``."""
    excluded = {Path(p).resolve() for p in exclude}
    files = [f for f in files if f.resolve() not in excluded]
    traces: list[TraceInput] = []
    span_inputs = [SpanInput(paths=paths) for paths in span_streams(f for f in files if is_span_file(f))]
    for f in files:
        if is_span_file(f):
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
    for si in span_inputs:
        si.run_id = peek_run_id(si)
    return traces, span_inputs


def select_run(run_id: str | None, traces: list[TraceInput], span_inputs: list[SpanInput],
               skipped: list[Skipped]) -> tuple[str | None, list[TraceInput]]:
    """Choose the run: ``run_id``, else the majority of the inputs (one vote per
    trace and per span stream); traces of another run go to ``skipped`` (the
    spans of another run are left out as the streams are read)."""
    if run_id is None:
        votes: Counter = Counter(t.run_id for t in traces if t.run_id)
        votes.update(si.run_id for si in span_inputs if si.run_id)
        if votes:
            run_id = sorted(votes.items(), key=lambda kv: (-kv[1], kv[0]))[0][0]
    if run_id is None:
        return None, traces
    kept = []
    for t in traces:
        if t.run_id and t.run_id != run_id:
            skipped.append(Skipped(str(t.path), f"from another run (run_id {t.run_id!r}, merging {run_id!r})"))
        else:
            kept.append(t)
    return run_id, kept


def read_spans(span_inputs: list[SpanInput], traces: list[TraceInput], run_id: str | None, limits: Limits,
               skipped: list[Skipped], jobs: int = 1) -> tuple[list[SpanInput], SpanSink]:
    """Stream the run's spans into a :class:`SpanSink` (a large run's in ``jobs``
    processes); returns the streams that gave something, and the sink."""
    run_start = None
    if limits.relative:  # a window relative to the run's first event: find it first
        starts = [earliest_start_ns(si) for si in span_inputs]
        starts += [t.base_ns + int((t.min_ts or 0) * 1000) for t in traces]
        run_start = min((s for s in starts if s is not None), default=None)
    sink = SpanSink(limits, run_start)
    kept = [si for si in read_streams(span_inputs, run_id, sink, jobs) if judge_stream(si, run_id, skipped)]
    return kept, sink


def judge_stream(si: SpanInput, run_id: str | None, skipped: list[Skipped]) -> bool:
    """Once ``si`` is read: whether it gave spans of the run; what it left out goes to ``skipped``."""
    # run_ids counts the spans read per run id (None: spans without one, always merged)
    others = {r: n for r, n in si.run_ids.items() if r not in (None, run_id)} if run_id else {}
    mine = sum(si.run_ids.values()) - sum(others.values())
    if not mine and others:
        names = ", ".join(repr(r) for r in others)
        skipped.append(Skipped(str(si.path), f"from another run (run_id {names}, merging {run_id!r})"))
        return False
    if not mine and si.problems:
        skipped.append(Skipped(str(si.path), "; ".join(si.problems[:3])))
        return False
    if others:
        skipped.append(Skipped(str(si.path), f"{sum(others.values())} span(s) from another run dropped"))
    if si.problems:
        skipped.append(Skipped(str(si.path), "partially read: " + "; ".join(si.problems[:3])))
    return True


def resolve_workers(traces: list[TraceInput], span_inputs: list[SpanInput], sink: SpanSink) -> RunInputs | None:
    """Name each trace's worker and order the workers; None if nothing is left."""
    spans = sink.spans
    pid_workers: dict[int, set[str]] = {}
    for si in span_inputs:
        for pid, ws in si.pids.items():
            pid_workers.setdefault(pid, set()).update(ws)
    if not traces and not spans:
        return None
    ranks: dict[str, int] = {}
    for t in traces:
        # An untagged trace is claimed by the one worker whose spans share its OS pid.
        if t.worker_hint:
            t.worker = t.worker_hint
        elif t.pid_hint is not None and len(pid_workers.get(t.pid_hint, ())) == 1:
            t.worker = next(iter(pid_workers[t.pid_hint]))
        else:
            t.worker = trace_stem(t.path)
        if t.rank is not None:
            ranks.setdefault(t.worker, t.rank)
    names = {s.worker for s in spans.values()} | {t.worker for t in traces}
    workers = sorted(names, key=lambda w: (ranks.get(w, 1 << 30), natural(w)))
    return RunInputs(traces, span_inputs, spans, pid_workers, ranks, workers)
