"""The merged Chrome trace of ``rpc-observe merge``: every input put on one
clock, one process per worker holding its profiler events (re-homed from
their OS pids) and its RPC slices (:mod:`rpc_observe._merge_rpc`), and the
``rpc_observe_merge`` summary."""

from __future__ import annotations

from typing import Any, Callable

from ._clock import ClockEstimate, RpcPair, estimate_offsets
from ._merge_model import RunInputs, Skipped, Span, Timebase, TraceInput
from ._merge_rpc import draw_rpcs, rpc_pairs

# Kineto's per-process metadata, replaced by the worker's own.
_PROCESS_META = ("process_name", "process_labels", "process_sort_index")


def build_timeline(run: RunInputs, run_id: str | None,
                   skipped: list[Skipped]) -> tuple[dict[str, Any], ClockEstimate]:
    """The merged Chrome-trace dict and the clock estimate it was aligned with.
    Consumes the traces' loaded documents."""
    pairs = rpc_pairs(run.spans)
    clock, timebase = _align_clocks(run, pairs)
    off = clock.offsets_us
    workers = run.workers
    out_events: list[dict[str, Any]] = []
    main_pid = {w: (i + 1) * 100 for i, w in enumerate(workers)}
    sort_base = {w: i * 100 for i, w in enumerate(workers)}
    os_pids: dict[str, set[int]] = {w: set() for w in workers}
    extra_pids: dict[tuple[str, Any], int] = {}
    # One id space for Kineto's flows of every trace and for the RPC flows.
    flow_ids: dict[tuple, int] = {}

    def flow_id(key: tuple) -> int:
        return flow_ids.setdefault(key, len(flow_ids) + 1)

    for fi, t in enumerate(run.traces):
        w = t.worker
        if t.main_pid is not None:
            os_pids[w].add(t.main_pid)
        shift = timebase.place_us(w, t.base_ns)
        _convert_trace(t, fi, shift, main_pid[w], sort_base[w], extra_pids, flow_id, out_events)

    for pid, ws in run.pid_workers.items():
        for w in ws:
            os_pids.setdefault(w, set()).add(pid)
    n_flows = draw_rpcs(run.spans, pairs, workers, main_pid, timebase, flow_id, out_events)

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
        "bounds_us": {w: (None if clock.bounds_us.get(w) is None else round(clock.bounds_us[w], 3))
                      for w in workers},
        "unaligned": [w for w in workers if clock.bounds_us.get(w) is None],
        "inconsistent_pairs": [list(k) for k in clock.inconsistent_edges],
        "workers": {w: {"pid": main_pid[w], "rank": run.ranks.get(w), "os_pids": sorted(os_pids[w]),
                        "rpc_pairs": clock.pairs_per_worker.get(w, 0)} for w in workers},
        "inputs": {"traces": [str(t.path) for t in run.traces],
                   "span_files": [str(si.path) for si in run.span_inputs]},
        "rpc": {"spans": len(run.spans), "pairs": len(pairs), "flows": n_flows},
        "skipped": [{"file": s.file, "reason": s.reason} for s in skipped],
    }
    # Key order matters to Perfetto: displayTimeUnit first, and older Perfetto
    # versions stop reading at an unknown key, so ours comes after traceEvents.
    trace = {"displayTimeUnit": "ms", "traceEvents": meta_events + out_events,
             "rpc_observe_merge": summary}
    return trace, clock


def _align_clocks(run: RunInputs, pairs: list[tuple[Span, Span]]) -> tuple[ClockEstimate, Timebase]:
    """Estimate the clock offsets from the RPC pairs; the timebase's zero is
    the earliest event once corrected."""
    timebase = Timebase(pivot_ns=min(
        [s.start_ns for s in run.spans.values()]
        + [t.base_ns + int((t.min_ts or 0) * 1000) for t in run.traces]))
    rel = timebase.rel_us
    # A failed client (timeout, lost peer) may end before its server does: such a pair
    # says nothing about the clocks.
    clock = estimate_offsets(
        [RpcPair(c.worker, s.worker, rel(c.start_ns), rel(c.end_ns), rel(s.start_ns), rel(s.end_ns))
         for c, s in pairs if c.status_code != 2],
        run.workers,
    )
    off = timebase.offsets_us = clock.offsets_us
    worker_min: dict[str, float] = {}
    starts = [(s.worker, rel(s.start_ns)) for s in run.spans.values()] + [
        (t.worker, rel(t.base_ns) + (t.min_ts or 0.0)) for t in run.traces]
    for w, v in starts:
        worker_min[w] = min(worker_min.get(w, v), v)
    timebase.origin_us = min(v + off.get(w, 0.0) for w, v in worker_min.items())
    return clock, timebase


def _convert_trace(t: TraceInput, fi: int, shift: float, pid_main: int, sort_base: int,
                   extra_pids: dict[tuple[str, Any], int], flow_id: Callable[[tuple], int],
                   out: list[dict[str, Any]]) -> None:
    """Re-home one profiler trace's events: pids, clock shift, flow ids.

    The main process's events move to the worker's process; other pids (GPU
    streams, forked helpers) get processes numbered right after it."""
    w = t.worker
    events = t.data.get("traceEvents") or []
    t.data = {}  # let the loaded document go once converted
    for ev in events:
        if not isinstance(ev, dict):
            continue
        ph = ev.get("ph")
        pid = ev.get("pid")
        is_main = type(pid) is not int or pid == t.main_pid
        if ph == "M" and ev.get("name") in _PROCESS_META:
            if is_main:
                continue  # replaced by the worker's own metadata
            new = ev["pid"] = _extra_pid(extra_pids, w, pid, pid_main)
            args = ev.get("args") if isinstance(ev.get("args"), dict) else {}
            if ev["name"] == "process_name":
                ev["args"] = {"name": f"{w} {args.get('name', pid)}"}
            elif ev["name"] == "process_sort_index":
                ev["args"] = {"sort_index": sort_base + new - pid_main}
            out.append(ev)
            continue
        ev["pid"] = pid_main if is_main else _extra_pid(extra_pids, w, pid, pid_main)
        ts = ev.get("ts")
        if isinstance(ts, (int, float)) and not isinstance(ts, bool):
            ev["ts"] = round(ts + shift, 3)
        elif isinstance(ts, str):
            try:
                ev["ts"] = round(float(ts) + shift, 3)
            except ValueError:
                pass
        # Kineto numbers its flows per trace: made unique across the merged traces.
        if ph in ("s", "t", "f") and "id" in ev:
            ev["id"] = flow_id(("p", fi, ev.get("cat"), ev.get("name"), str(ev["id"])))
        if "bind_id" in ev:
            ev["bind_id"] = flow_id(("b", fi, str(ev["bind_id"])))
        out.append(ev)


def _extra_pid(extra_pids: dict[tuple[str, Any], int], worker: str, pid: Any, pid_main: int) -> int:
    """The merged pid of ``worker``'s non-main process ``pid`` (allocated on first sight)."""
    new = extra_pids.get((worker, pid))
    if new is None:
        new = extra_pids[(worker, pid)] = pid_main + 1 + sum(1 for k in extra_pids if k[0] == worker)
    return new
