"""Reading a run's span files for a report, with ``rpc-observe merge``'s readers: its choice of
the run and its verdict on every file (foreign, unreadable, cut), then two passes over the lines.

The first pass takes every stream at once, a line at a time in the order of their first span's
start, so a call's CLIENT and SERVER spans arrive close together (see :mod:`.aggregate`).  The
second reads whole only the lines that hold a span of the slowest calls' traces.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from rpc_observe.merge.files import collect_inputs, is_span_file, iter_lines
from rpc_observe.merge.inputs import judge_stream, load_inputs, select_run
from rpc_observe.merge.model import BadInput, Skipped, Span, SpanInput
from rpc_observe.merge.spanfile import SpanReader

from .aggregate import RunStats

ACCEPTED = ("a run directory (RPC_OBSERVE_DIR) or span files: the OTLP JSON lines written with RPC_OBSERVE=1 "
            "(spans/<worker>-<pid>.jsonl, rotated .jsonl.1 ...)")
_FIRST_START = re.compile(rb'"startTimeUnixNano":"?(\d+)')
MAX_TRACE_SPANS = 60  # spans kept of one slow call's trace


class NoSpans(Exception):
    """Nothing a report can be made of; ``str(exc)`` is the one line that says why."""


@dataclass
class RunFiles:
    """The run chosen and its span streams; ``skipped``: what merge would leave out, and why."""

    run_id: str | None
    streams: list[SpanInput]
    skipped: list[Skipped] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)


def find_run(paths: list[str]) -> RunFiles:
    """The span streams under ``paths``, of the run merge would choose; :class:`NoSpans` if none."""
    files, skipped = collect_inputs(paths)
    # Profiler traces, a merge's output, targets and dumps are no span files: only files named
    # like span files, or that sit in a spans/ directory, are read (and judged) here.
    candidates = [f for f in files if is_span_file(f) or f.parent.name == "spans"]
    ignored: list[str] = []
    _, streams = load_inputs(candidates, (), lambda note: ignored.append(note), skipped)
    if not streams:
        what = "; ".join(f"{s.file}: {s.reason}" for s in skipped[:3])
        where = ", ".join(paths)
        raise NoSpans(f"no span files in {where}" + (f" ({what})" if what else "") + f"; accepted: {ACCEPTED}")
    run_id, _ = select_run(None, [], streams, skipped)
    return RunFiles(run_id, streams, skipped, ignored)


def _keyed_lines(index: int, si: SpanInput) -> Iterator[tuple[int, int, int, Path, bytes]]:
    """(first span start, stream, line number, file, line) of a stream; an unreadable file is a problem."""
    for path in si.paths:
        n = 0
        try:
            for n, raw in enumerate(iter_lines(path), 1):
                m = _FIRST_START.search(raw)
                yield (int(m.group(1)) if m else 0), index, n, path, raw
        except BadInput as e:
            si.problems.append(f"{path.name} line {n + 1}: {e}")


def read_run(run: RunFiles, stats: RunStats) -> list[SpanInput]:
    """First pass: every span of the run into ``stats``; returns the streams that gave spans."""
    reader = SpanReader(stats.add_many, run.run_id)
    lines = heapq.merge(*(_keyed_lines(i, si) for i, si in enumerate(run.streams) if si.doc is None))
    for start_ns, index, n, path, raw in lines:
        si = run.streams[index]
        where = f"{path.name} line {n}" if len(si.paths) > 1 else f"line {n}"
        reader.read_line(si, raw, path, where)
        stats.advance(start_ns)
    for si in run.streams:
        if si.doc is not None:  # a whole-document span file
            reader.read(si)
    stats.finish()
    return [si for si in run.streams if judge_stream(si, run.run_id, run.skipped)]


def read_traces(streams: list[SpanInput], run_id: str | None, trace_ids: set[str]) -> dict[str, list[Span]]:
    """Second pass: the spans of ``trace_ids`` (at most ``MAX_TRACE_SPANS`` each, the first read)."""
    found: dict[str, list[Span]] = {t: [] for t in trace_ids}
    wanted = [t.encode() for t in trace_ids]

    def keep(spans: list[Span]) -> None:
        for sp in spans:
            held = found.get(sp.trace_id)
            if held is not None and len(held) < MAX_TRACE_SPANS:
                held.append(sp)

    reader = SpanReader(keep, run_id)
    for si in streams:
        if si.doc is not None:
            reader.read(si)
            continue
        scratch = SpanInput(paths=si.paths)  # its problems were told in the first pass
        for path in si.paths:
            try:
                for n, raw in enumerate(iter_lines(path), 1):
                    if any(t in raw for t in wanted):
                        reader.read_line(scratch, raw, path, f"line {n}")
            except BadInput:
                continue
    return found
