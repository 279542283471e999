"""``rpc-observe report``: one self-contained HTML page of a run, to open offline in any browser.

Usage::

    rpc-observe report [RPC_OBSERVE_DIR | SPAN_FILE ...] [-o report.html]

It reads the run's span files (as ``rpc-observe merge`` chooses and judges them), and shows per
method the calls, errors, client and server latency, and how much of a call's time is spent
outside its server; the traffic between workers as heat maps; each worker's call rate, errors
and calls in flight over the run; the slowest calls as waterfalls across workers with their
trace ids; the clock offsets and the files left out; and, when ``debug/`` holds flight recorder
dumps, what ``rpc-observe doctor`` finds in them.  Bytes and tensors per message come from saved
/metrics scrapes (``metrics/*.prom``), when there are any.

Size: the page holds bounded tables whatever the run's length (at most 40 methods and 32 workers,
the rest as "(other)"; fixed latency buckets; 240 time bins a worker; the 12 slowest calls with up
to 60 spans each; 100 file names), so it stays under ``PAGE_BOUND_BYTES`` (0.6 MB; a run past every
limit makes 0.45 MB, the demo's run 0.13 MB, 51 kB of it the charting library).  Time: linear, two
streamed passes over the span files; memory: the calls in flight, not the run.
Exit status: 0 written, 2 bad input (one line on stderr).  Standard library only (no torch, no
OpenTelemetry); the page's charts are uPlot (MIT), inlined.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from .aggregate import MAX_METHODS, MAX_WORKERS, SLOWEST, RunStats
from .page import render
from .read import ACCEPTED, NoSpans, find_run, read_run, read_traces
from .scrapes import find_scrapes, read_scrapes
from .series import TIME_BINS
from .summary import bucket_labels, clock_json, doctor_json, methods_json, traffic_json, waterfall, worker_order

__all__ = ["main", "make_report", "render", "NoSpans", "PAGE_BOUND_BYTES"]
PROG = "rpc-observe report"
MAX_FILES_LISTED = 100  # of the span files read and of those left out: the page names this many
# What a page can weigh with every table at its limit (tests/unit/test_report_aggregate.py builds one).
PAGE_BOUND_BYTES = 600_000


def make_report(paths: list[str]) -> dict[str, Any]:
    """The report's data for the run under ``paths``; :class:`NoSpans` if there is none."""
    started = time.monotonic()
    run = find_run(paths)
    stats = RunStats()
    streams = read_run(run, stats)
    if not stats.spans:
        reasons = "; ".join(f"{Path(s.file).name}: {s.reason}" for s in run.skipped[:3])
        raise NoSpans(f"no RPC spans of a run in {', '.join(paths)}" + (f" ({reasons})" if reasons else "")
                      + f"; accepted: {ACCEPTED}")
    workers = worker_order(stats)
    clock = clock_json(stats, workers)
    slowest = stats.slowest_calls()
    traces = read_traces(streams, run.run_id, {t for _, t, _ in slowest})
    run_dirs = [Path(p) for p in paths if Path(p).is_dir()]
    scrapes = read_scrapes([f for d in run_dirs for f in find_scrapes(d)])
    bins = stats.bins
    return {
        "version": 1,
        "run_id": run.run_id,
        "inputs": paths,
        "generated_unix_s": round(time.time(), 3),
        "start_unix_ns": bins.origin_ns if bins else None,
        "duration_s": round((bins.end_ns - bins.origin_ns) / 1e9, 3) if bins else 0.0,
        "spans": stats.spans,
        "workers": workers,
        "worker_spans": stats.workers,
        "unpaired_spans": stats.unpaired,
        "limits": {"methods": MAX_METHODS, "workers": MAX_WORKERS, "time_bins": TIME_BINS, "slowest": SLOWEST},
        "buckets": bucket_labels(),
        "methods": methods_json(stats, scrapes),
        "traffic": traffic_json(stats, workers, scrapes),
        "timeline": bins.as_json(workers) if bins else None,
        "slowest": [waterfall(call, traces.get(call[1], []), clock["offsets_us"]) for call in slowest],
        "clock": clock,
        "files": {"span_files": [str(p) for si in streams for p in si.paths][:MAX_FILES_LISTED],
                  "span_file_count": sum(len(si.paths) for si in streams),
                  "skipped": [{"file": s.file, "reason": s.reason} for s in run.skipped][:MAX_FILES_LISTED],
                  "skipped_count": len(run.skipped),
                  "ignored": run.ignored, "scrapes": scrapes["files"], "scrape_problems": scrapes["problems"]},
        "doctor": doctor_json(run_dirs),
        "elapsed_s": round(time.monotonic() - started, 3),
    }


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description="Write one self-contained HTML page of a run (offline: "
                                                        "scripts, styles and data inline).")
    ap.add_argument("paths", nargs="*", metavar="PATH",
                    help=f"{ACCEPTED}; default $RPC_OBSERVE_DIR or ./rpc_observe_out")
    ap.add_argument("-o", "--output", default="report.html", help="the HTML file to write (default report.html)")
    ap.add_argument("-q", "--quiet", action="store_true", help="only report problems")
    return ap


def main(argv: list[str] | None = None) -> int:
    """The ``rpc-observe report`` command; returns its exit status (0 written, 2 bad input)."""
    args = _parser().parse_args(argv)
    paths = args.paths or [os.environ.get("RPC_OBSERVE_DIR") or "rpc_observe_out"]
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        print(f"{PROG}: no such file or directory: {', '.join(missing)}; accepted: {ACCEPTED}", file=sys.stderr)
        return 2
    try:
        data = make_report(paths)
    except NoSpans as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    out = Path(args.output)
    in_place = out.exists() and not out.is_file()  # a device or pipe (/dev/null) is written as it is
    tmp = out if in_place else out.with_name(out.name + ".tmp")
    try:
        tmp.write_text(render(data), encoding="utf-8")
        if not in_place:
            os.replace(tmp, out)
    except OSError as e:
        print(f"{PROG}: cannot write {out}: {e.strerror or e}; -o takes a file in a directory that exists",
              file=sys.stderr)
        return 2
    for s in data["files"]["skipped"]:
        print(f"{PROG}: left out {s['file']}: {s['reason']}", file=sys.stderr)
    if not args.quiet:
        print(f"{PROG}: wrote {out}: {data['spans']:,} spans of "
              f"{len(data['workers'])} worker(s), {len(data['methods'])} method(s), in {data['elapsed_s']:.1f} s",
              file=sys.stderr)
    return 0
