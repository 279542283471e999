"""The inputs of ``rpc-observe merge``: finding and reading the files, keeping
one run, and telling which worker each profiler trace belongs to.

Every file that cannot be used becomes a :class:`Skipped` with the reason, so
one bad file never stops the merge of the others.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import zlib
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterable

from ._merge_model import (
    BadInput, IgnoredInput, RunInputs, Skipped, Span, SpanInput, TraceInput, json_error,
)
from ._merge_otlp import spans_from_batches, spans_from_lines, to_int

_SUFFIXES = (".json", ".json.gz", ".jsonl", ".jsonl.gz")
_SPAN_SUFFIXES = (".jsonl", ".jsonl.gz")
# Kineto categories recorded by the profiled process itself (not by a GPU).
_CPU_CATS = {"cpu_op", "python_function", "user_annotation", "cpu_instant_event", "rpc_observe"}


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


def load_input(path: Path) -> TraceInput | SpanInput:
    """Parse one input file.  Raises :class:`BadInput` for unusable files and
    :class:`IgnoredInput` for rpc_observe's own non-input files."""
    text = _read_text(path)
    if not text.strip():
        if path.name.endswith(_SPAN_SUFFIXES):  # a worker that exported no span
            return SpanInput(path=path, spans=[], run_ids=Counter(), pids={})
        raise BadInput("empty file")
    if path.name.endswith(_SPAN_SUFFIXES):
        return spans_from_lines(path, text)
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        first = text.lstrip()[:1]
        if first == "{" and '"resourceSpans"' in text[:4096] and "\n" in text.strip():
            return spans_from_lines(path, text)  # JSON-lines without .jsonl suffix
        raise BadInput(json_error(e, text)) from None
    if isinstance(doc, dict) and "rpc_observe_merge" in doc:
        raise IgnoredInput("output of a previous merge")
    if isinstance(doc, list) and doc and all(isinstance(e, dict) and "targets" in e for e in doc):
        raise IgnoredInput("Prometheus file_sd target, not a trace")
    if isinstance(doc, dict) and "traceEvents" in doc:
        return _scan_trace(path, doc)
    if isinstance(doc, dict) and "resourceSpans" in doc:
        return spans_from_batches(path, [doc], [])
    if isinstance(doc, list) and doc and all(isinstance(e, dict) and "ph" in e for e in doc[:10]):
        raise BadInput("Chrome trace array without baseTimeNanoseconds (no absolute time)")
    keys = ", ".join(sorted(doc)[:6]) if isinstance(doc, dict) else type(doc).__name__
    raise BadInput(f"not a torch.profiler trace or OTLP span file (found: {keys})")


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


def _scan_trace(path: Path, doc: dict[str, Any]) -> TraceInput:
    """What the merge needs to know of a profiler trace before converting it:
    its absolute time base, its first timestamp and its main process."""
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


def load_inputs(files: list[Path], exclude: Iterable[str | os.PathLike], log: Callable[[str], None],
                skipped: list[Skipped]) -> tuple[list[TraceInput], list[SpanInput]]:
    """Load every file not in ``exclude``; what cannot be used goes to ``skipped``."""
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
    return traces, span_inputs


def select_run(run_id: str | None, traces: list[TraceInput], span_inputs: list[SpanInput],
               skipped: list[Skipped]) -> tuple[str | None, list[TraceInput], list[SpanInput]]:
    """Keep the inputs of one run: ``run_id``, else the majority of the files
    (one vote per file); what is from another run goes to ``skipped``."""
    if run_id is None:
        votes: Counter = Counter(t.run_id for t in traces if t.run_id)
        votes.update(si.run_ids.most_common(1)[0][0] for si in span_inputs if si.run_ids)
        if votes:
            run_id = sorted(votes.items(), key=lambda kv: (-kv[1], kv[0]))[0][0]
    if run_id is None:
        return None, traces, span_inputs
    kept_traces = []
    for t in traces:
        if t.run_id and t.run_id != run_id:
            skipped.append(Skipped(str(t.path), f"from another run (run_id {t.run_id!r}, merging {run_id!r})"))
        else:
            kept_traces.append(t)
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
    return run_id, kept_traces, kept_inputs


def resolve_workers(traces: list[TraceInput], span_inputs: list[SpanInput]) -> RunInputs | None:
    """Deduplicate the spans and name each trace's worker; None if nothing is left."""
    spans: dict[tuple[str, str], Span] = {}
    pid_workers: dict[int, set[str]] = {}
    for si in span_inputs:
        for s in si.spans:
            s.attrs.pop("_run_id", None)
            spans.setdefault((s.trace_id, s.span_id), s)
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
            t.worker = _trace_stem(t.path)
        if t.rank is not None:
            ranks.setdefault(t.worker, t.rank)
    names = {s.worker for s in spans.values()} | {t.worker for t in traces}
    workers = sorted(names, key=lambda w: (ranks.get(w, 1 << 30), _natural(w)))
    return RunInputs(traces, span_inputs, spans, pid_workers, ranks, workers)


def _natural(s: str) -> list:
    """Sort key that puts ``worker2`` before ``worker10``."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def _trace_stem(path: Path) -> str:
    """``host_123.1700000000000.pt.trace.json.gz`` -> ``host_123`` (the
    tensorboard_trace_handler name without its per-export timestamp)."""
    name = path.name
    for suf in (".gz", ".json", ".pt.trace"):
        if name.endswith(suf):
            name = name[: -len(suf)]
    return re.sub(r"\.\d+$", "", name) or path.name
