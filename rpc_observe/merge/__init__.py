"""``rpc-observe merge``: merge per-process torch.profiler traces and RPC span
files into one Chrome-trace JSON (opens in Perfetto UI and chrome://tracing).

Inputs, any mix (files, or directories scanned recursively):

* torch.profiler Chrome traces (``export_chrome_trace`` /
  ``tensorboard_trace_handler`` output, ``.json`` or ``.json.gz``).  They must
  carry ``baseTimeNanoseconds``; event ``ts`` are microseconds relative to it.
  The worker is taken from the top-level ``rpc_observe.worker`` key, else from
  the trace's OS pid matching a span file's ``process.pid``, else the file name.
* span files (``spans/*.jsonl``): OTLP/HTTP JSON, one export batch per line;
  a worker's rotated files (``<worker>-<pid>.jsonl.1``, ``.jsonl.2``, ...:
  the larger the number, the older) are read with it as one stream.

Output: one process per worker (named after it), its profiler events and its
RPC spans (client slices on the caller, server slices on the callee, laid out
on "RPC client"/"RPC server" lanes) on one clock, with flow arrows client ->
server (request) and server -> client (reply).  Clock offsets are estimated
from the RPC pairs (see :mod:`rpc_observe.merge.clock`) and reported in the
top-level ``rpc_observe_merge`` key and on stderr.

The stages: :mod:`.inputs` loads the files (:mod:`.files` finds them,
:mod:`.spanfile` streams the span files through the limits of :mod:`.limits`,
in reader processes of :mod:`.parallel` for a large run), keeps one run and
names the workers; :mod:`.timeline` aligns the clocks and produces the merged
events (profiler events via :mod:`.kineto`, RPC slices and flows via
:mod:`.rpc`) as they are written.  This module runs them and writes the
result.  The package uses the Python standard library only; where it was
built, :mod:`.speedups` runs the two per-span loops (reading a span file's
line, encoding a lane's events) in C, with the same result.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import speedups
from .clock import ClockEstimate
from .files import collect_inputs
from .inputs import load_inputs, read_spans, resolve_workers, select_run
from .limits import Limits, TimeBound, cut_message, parse_bound
from .model import Skipped
from .timeline import build_timeline

__all__ = ["MergeResult", "Limits", "merge", "write_merged", "main"]
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


@contextmanager
def _gc_paused() -> Iterator[None]:
    """The merge makes millions of objects and no cycles: the cyclic GC would
    only rescan them, over and over (quadratic time on a large run)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def merge(
    paths: Sequence[str | os.PathLike],
    *,
    run_id: str | None = None,
    exclude: Iterable[str | os.PathLike] = (),
    log: Callable[[str], None] | None = None,
    limits: Limits | None = None,
    stream: bool = False,
    jobs: int = 1,
) -> MergeResult:
    """Load and merge the inputs; ``result.trace`` is the Chrome-trace dict
    (``None`` when nothing was usable).  ``log`` gets one line per note.
    ``limits`` say what to keep of a very large run; what they left out is in
    the summary's ``cut`` (None if nothing).  ``jobs`` > 1 reads a large run's
    span files in that many processes, this one included (the caller's main
    module must then be importable without side effects, as for :mod:`multiprocessing`).

    With ``stream``, ``trace["traceEvents"]`` is a one-shot iterator for
    :func:`write_merged`, and the summary is complete once it is written."""
    log = log or (lambda _m: None)
    with _gc_paused():
        files, skipped = collect_inputs(paths)
        traces, span_inputs = load_inputs(files, exclude, log, skipped)
        run_id, traces = select_run(run_id, traces, span_inputs, skipped)
        span_inputs, sink = read_spans(span_inputs, traces, run_id, limits or Limits(), skipped, jobs)
        run = resolve_workers(traces, span_inputs, sink)
        if run is None:
            return MergeResult(None, skipped, None, [])
        timeline = build_timeline(run, run_id, skipped, sink)
        events: Iterable[dict[str, Any] | str] = timeline.events
        if not stream:
            events = [e for item in events for e in ([item] if isinstance(item, dict) else json.loads(f"[{item}]"))]
    # Key order matters to Perfetto: displayTimeUnit first, and older Perfetto
    # versions stop reading at an unknown key, so ours comes after traceEvents.
    trace = {"displayTimeUnit": "ms", "traceEvents": events, "rpc_observe_merge": timeline.summary}
    return MergeResult(trace, skipped, timeline.clock, run.workers)


def write_merged(trace: dict[str, Any], path: str | os.PathLike, chunk: int = 20_000) -> None:
    """Write compact JSON (``.gz`` suffix: gzip), keys in dict order, via a
    temporary file renamed into place (a device or pipe, such as /dev/null,
    is written to as it is: renaming onto it would replace it).  ``traceEvents``
    may be any iterable of event dicts and strings of already encoded
    (comma-joined) events; it is taken as it is written, and the keys after it
    are encoded after it."""
    path = Path(path)
    in_place = path.exists() and not path.is_file()
    tmp = path if in_place else path.with_name(path.name + ".tmp")
    opener = gzip.open if path.name.endswith(".gz") else open
    sep = (",", ":")
    try:
        with _gc_paused(), opener(tmp, "wb") as raw, _BackgroundWriter(raw) as f:
            f.write("{")
            for n, (k, v) in enumerate(trace.items()):
                f.write(("," if n else "") + json.dumps(k) + ":")
                if k == "traceEvents":
                    _write_events(f, v or [], chunk)
                else:  # after the events: the summary is complete by now
                    f.write(json.dumps(trace[k], separators=sep))
            f.write("}\n")
    except BaseException:
        if not in_place:
            tmp.unlink(missing_ok=True)
        raise
    if not in_place:
        os.replace(tmp, path)


class _BackgroundWriter:
    """Text written through a thread: the write (and gzip's deflate) run without
    the GIL, so on a second core they overlap the encoding of the next events."""

    _QUEUED = 8  # chunks of megabytes: the memory it may hold

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._queue: queue.Queue[bytes | None] = queue.Queue(self._QUEUED)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rpc-observe-merge-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (data := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._raw.write(data)
                except BaseException as e:  # raised in the encoding thread, at its next write or at close
                    self._error = e

    def write(self, text: str) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put(text.encode("utf-8"))

    def __enter__(self) -> _BackgroundWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self._queue.put(None)
        self._thread.join()
        if self._error is not None and exc[0] is None:
            raise self._error


def _write_events(f: Any, events: Iterable[dict[str, Any] | str], chunk: int) -> None:
    """A JSON array of the events: dicts encoded ``chunk`` at a time, strings as
    they are (each written on its own: a chunk is megabytes, not to be copied)."""
    sep = (",", ":")
    f.write("[")
    first, batch = True, []
    for item in events:
        if isinstance(item, dict):
            batch.append(item)
            if len(batch) < chunk:
                continue
            item, batch = json.dumps(batch, separators=sep)[1:-1], []
        elif batch:  # dicts gathered before this encoded chunk go first
            f.write("" if first else ",")
            f.write(json.dumps(batch, separators=sep)[1:-1])
            first, batch = False, []
        if item:
            f.write("" if first else ",")
            f.write(item)
            first = False
    if batch:
        f.write("" if first else ",")
        f.write(json.dumps(batch, separators=sep)[1:-1])
    f.write("]")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=PROG,
        description="Merge per-worker torch.profiler traces and RPC span files into one "
                    "Chrome-trace JSON (Perfetto UI / chrome://tracing), clocks aligned.")
    ap.add_argument("paths", nargs="*", metavar="PATH",
                    help="trace/span files or directories (recursive; a worker's rotated span files "
                         "<worker>-<pid>.jsonl.1, .2, ... are read with its .jsonl, oldest first); "
                         "default $RPC_OBSERVE_DIR or ./rpc_observe_out")
    ap.add_argument("-o", "--output", default="merged.json",
                    help="output file (default merged.json; .gz suffix compresses)")
    ap.add_argument("--run-id", default=None,
                    help="merge only this run (default: the majority run id of the inputs)")
    window = ("keep only spans and profiler events that overlap the window; T is seconds after the "
              "run's first span or profiler event (e.g. 120.5, as Perfetto shows the full merge), "
              "or @UNIX_SECONDS (e.g. @1790000000.25); on each worker's own clock")
    ap.add_argument("--since", type=_bound, metavar="T", help="start of the window: " + window)
    ap.add_argument("--until", type=_bound, metavar="T", help="end of the window (see --since)")
    ap.add_argument("--max-spans", type=_at_least_one("spans"), metavar="N",
                    help="keep at most N spans: the newest (latest start), the older ones are left out; "
                         "memory stays bounded by N")
    ap.add_argument("-j", "--jobs", type=_at_least_one("processes"), metavar="N", default=_default_jobs(),
                    help="processes that read a large run's span files, this one included "
                         "(default: 1 where the merge's C loops are built, else the CPUs, at most 4)")
    ap.add_argument("-q", "--quiet", action="store_true", help="only report problems and cuts")
    return ap


def _bound(text: str) -> TimeBound:
    try:
        return parse_bound(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: seconds after the run's first event (120.5) or @unix seconds (@1790000000.25)") from None


def _default_jobs() -> int:
    if speedups.C is not None:  # reading in C is faster than taking in what helpers read
        return 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(4, cpus))


def _at_least_one(what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = 0
        if n < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: a number of {what}, at least 1")
        return n

    return parse


def main(argv: list[str] | None = None) -> int:
    """The ``rpc-observe merge`` command; returns its exit status."""
    args = _parser().parse_args(argv)
    paths = args.paths or [os.environ.get("RPC_OBSERVE_DIR") or "rpc_observe_out"]

    def say(msg: str) -> None:
        print(f"{PROG}: {msg}", file=sys.stderr)

    if (bad := speedups.bad_switch()) is not None:
        say(bad)
    limits = Limits(args.since, args.until, args.max_spans)
    result = merge(paths, run_id=args.run_id, exclude=[args.output], log=None if args.quiet else say,
                   limits=limits, stream=True, jobs=args.jobs)
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
    if summ["cut"]:
        say(cut_message(summ["cut"]))
    if not args.quiet:
        say(f"wrote {args.output}: {len(result.workers)} worker(s), {summ['rpc']['spans']} span(s), "
            f"{summ['rpc']['flows']} RPC flow(s), {summ['events']} events")
    return result.status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
