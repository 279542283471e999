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

The stages: :mod:`._merge_inputs` finds and reads the files (span files via
:mod:`._merge_otlp`), keeps one run and names the workers;
:mod:`._merge_timeline` aligns the clocks and builds the merged trace, the
RPC slices and flows coming from :mod:`._merge_rpc`.  This module runs them
and writes the result.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from ._clock import ClockEstimate
from ._merge_inputs import collect_inputs, load_input, load_inputs, resolve_workers, select_run
# The records and constants live with the stage that owns them; they stay
# importable from here, the public entry.
from ._merge_model import (  # noqa: F401
    KIND_CLIENT, KIND_SERVER, BadInput, IgnoredInput, Skipped, Span, SpanInput, TraceInput,
)
from ._merge_rpc import FLOW_CAT, LANE_TID_BASE, MARKER_US, SPAN_CAT  # noqa: F401
from ._merge_timeline import build_timeline

__all__ = [
    "Span", "TraceInput", "SpanInput", "Skipped", "MergeResult", "BadInput", "IgnoredInput",
    "collect_inputs", "load_input", "merge", "write_merged", "main",
]
PROG = "rpc-observe merge"


@dataclass
class MergeResult:
    """What :func:`merge` made of its inputs (``trace`` None: nothing usable)."""

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
    traces, span_inputs = load_inputs(files, exclude, log, skipped)
    run_id, traces, span_inputs = select_run(run_id, traces, span_inputs, skipped)
    run = resolve_workers(traces, span_inputs)
    if run is None:
        return MergeResult(None, skipped, None, [])
    trace, clock = build_timeline(run, run_id, skipped)
    return MergeResult(trace, skipped, clock, run.workers)


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
