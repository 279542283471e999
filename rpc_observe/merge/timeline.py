"""The merged Chrome trace of ``rpc-observe merge``: every input put on one
clock, one process per worker holding its profiler events (re-homed from
their OS pids, :mod:`.kineto`) and its RPC slices (:mod:`.rpc`), and the
``rpc_observe_merge`` summary.

The events are produced as they are written: the summary is complete once
they have all been taken (it comes after them in the file).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .clock import ClockEstimate, estimate_offsets
from .encode import rpc_events
from .kineto import Window, convert_trace
from .limits import SpanSink
from .model import RunInputs, Skipped, Timebase
from .rpc import SpanIndex, index_spans


@dataclass
class Timeline:
    """The merged trace: its summary, and its events (an iterator to be taken
    once: dicts, or strings of comma-joined JSON-encoded events)."""

    summary: dict[str, Any]
    clock: ClockEstimate
    events: Iterator[dict[str, Any] | str]


def build_timeline(run: RunInputs, run_id: str | None, skipped: list[Skipped], sink: SpanSink) -> Timeline:
    """Align the clocks and lay the RPCs out; the events come as they are taken.
    Consumes the traces' loaded documents."""
    index = index_spans(run.spans)
    pairs = index.pairs
    clock, timebase = _align_clocks(run, index)
    off = clock.offsets_us
    workers = run.workers
    main_pid = {w: (i + 1) * 100 for i, w in enumerate(workers)}
    sort_base = {w: i * 100 for i, w in enumerate(workers)}
    os_pids: dict[str, set[int]] = {w: set() for w in workers}
    for t in run.traces:
        if t.main_pid is not None:
            os_pids[t.worker].add(t.main_pid)
    for pid, ws in run.pid_workers.items():
        for w in ws:
            os_pids.setdefault(w, set()).add(pid)

    meta_events: list[dict[str, Any]] = []
    for w in workers:
        labels = [f"rank {run.ranks[w]}"] if w in run.ranks else []
        labels += [f"os pid {p}" for p in sorted(os_pids[w])]
        if clock.bounds_us.get(w) is not None:
            labels.append(f"clock {off.get(w, 0.0):+.1f} us ± {clock.bounds_us[w]:.1f}")
        meta = [("process_name", {"name": w}), ("process_sort_index", {"sort_index": sort_base[w]})]
        if labels:
            meta.append(("process_labels", {"labels": ", ".join(labels)}))
        meta_events += [{"ph": "M", "name": name, "pid": main_pid[w], "tid": 0, "args": args}
                        for name, args in meta]

    summary = {
        "version": 1,
        "run_id": run_id,
        "origin_unix_ns": timebase.pivot_ns + round(timebase.origin_us * 1000),
        "reference_worker": clock.reference,
        "offsets_us": {w: round(off.get(w, 0.0), 3) for w in workers},
        "bounds_us": {w: None if (b := clock.bounds_us.get(w)) is None else round(b, 3) for w in workers},
        "unaligned": [w for w in workers if clock.bounds_us.get(w) is None],
        "inconsistent_pairs": [list(k) for k in clock.inconsistent_edges],
        "workers": {w: {"pid": main_pid[w], "rank": run.ranks.get(w), "os_pids": sorted(os_pids[w]),
                        "rpc_pairs": clock.pairs_per_worker.get(w, 0)} for w in workers},
        "inputs": {"traces": [str(t.path) for t in run.traces],
                   "span_files": [str(p) for si in run.span_inputs for p in si.paths]},
        "rpc": {"spans": len(run.spans), "pairs": len(pairs), "flows": 2 * len(pairs)},
        "skipped": [{"file": s.file, "reason": s.reason} for s in skipped],
        "cut": sink.summary(),  # completed once the profiler events are through
        "events": None,  # filled in once the events have been taken
    }

    def events() -> Iterator[dict[str, Any] | str]:
        count = len(meta_events)
        yield from meta_events
        # One id space for Kineto's flows of every trace and for the RPC flows.
        flow_ids: dict[tuple, int] = {}

        def flow_id(key: tuple) -> int:
            return flow_ids.setdefault(key, len(flow_ids) + 1)

        extra_pids: dict[tuple[str, Any], int] = {}
        cut = [0]
        windowed = sink.lo_ns is not None or sink.hi_ns is not None
        for fi, t in enumerate(run.traces):
            w = t.worker
            window = Window(t, sink.lo_ns, sink.hi_ns) if windowed else None
            for ev in convert_trace(t, fi, timebase.place_us(w, t.base_ns), main_pid[w], sort_base[w],
                                    extra_pids, flow_id, window, cut):
                count += 1
                yield ev
        summary["cut"] = sink.summary(cut[0])
        for text, n in rpc_events(index, workers, main_pid, timebase, len(flow_ids) + 1):
            count += n
            yield text
        summary["events"] = count

    return Timeline(summary, clock, events())


def _align_clocks(run: RunInputs, index: SpanIndex) -> tuple[ClockEstimate, Timebase]:
    """Estimate the clock offsets from the RPC pairs; the timebase's zero is
    the earliest event once corrected."""
    trace_starts = [t.base_ns + int((t.min_ts or 0) * 1000) for t in run.traces]
    first_ns = index.first_ns()
    timebase = Timebase(pivot_ns=min(list(first_ns.values()) + trace_starts))
    p = timebase.pivot_ns
    # A failed client (timeout, lost peer) may end before its server does: such a pair
    # says nothing about the clocks.
    clock = estimate_offsets(
        ((c.worker, s.worker, (c.start_ns - p) / 1000, (c.end_ns - p) / 1000, (s.start_ns - p) / 1000,
          (s.end_ns - p) / 1000) for c, s in index.pairs if c.status_code != 2),
        run.workers,
    )
    off = timebase.offsets_us = clock.offsets_us
    starts = {w: (ns - p) / 1000 for w, ns in first_ns.items()}
    for t in run.traces:  # the trace's first event, in float us (min_ts may be fractional)
        v = timebase.rel_us(t.base_ns) + (t.min_ts or 0.0)
        starts[t.worker] = min(starts.get(t.worker, v), v)
    timebase.origin_us = min(v + off.get(w, 0.0) for w, v in starts.items())
    return clock, timebase
