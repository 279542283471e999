"""Span streams read in worker processes, for a large run.

Reading is most of a merge's time and every stream reads alone, so a large
run's streams are read by ``jobs`` processes while this one takes in what
they read.  A worker applies the limits to its stream (what the run keeps of
a stream is a subset of what the stream keeps alone), so memory stays bounded
by ``--max-spans``.  Streams are taken in in their order, so the merge is the
same as one read in this process.  A pool that cannot start or dies reads the
rest here.
"""

from __future__ import annotations

import gc
import multiprocessing
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from .limits import Limits, SpanSink
from .model import Span, SpanInput
from .spanfile import SpanReader

# Below this much span input (about 300,000 spans), starting the processes costs more than they
# save: at 100,000 spans (80 MB) two readers took 1.45 s against 1.28 s in process (BENCHMARKS.md).
PARALLEL_MIN_BYTES = 256 << 20

_Result = tuple[SpanInput, list[tuple[Any, ...]], int, int]


def read_streams(span_inputs: list[SpanInput], run_id: str | None, sink: SpanSink, jobs: int) -> Iterator[SpanInput]:
    """Read every stream into ``sink``, in order; yields each once it is in."""
    done = 0
    if jobs > 1 and len(span_inputs) > 1 and _input_bytes(span_inputs) >= PARALLEL_MIN_BYTES:
        try:
            for si in _in_processes(span_inputs, run_id, sink, jobs):
                done += 1
                yield si
            return
        except (OSError, BrokenProcessPool):  # no processes here (or one was killed): read the rest here
            pass
    reader = SpanReader(sink.add_many, run_id)
    for si in span_inputs[done:]:
        reader.read(si)
        yield si


def _in_processes(span_inputs: list[SpanInput], run_id: str | None, sink: SpanSink, jobs: int) -> Iterator[SpanInput]:
    # spawn, not fork: merge() may be called in a process with threads (a finished training job).
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"), initializer=gc.disable) as pool:
        todo = iter(span_inputs)
        pending: deque[Future[_Result]] = deque()

        def submit() -> None:
            si = next(todo, None)
            if si is not None:
                pending.append(pool.submit(read_stream, si, run_id, sink.limits, sink.run_start_ns))

        for _ in range(jobs + 1):  # one ahead per process: a bound on the results held here
            submit()
        while pending:
            si, rows, out_of_window, over_limit = pending.popleft().result()
            submit()
            sink.add_many([Span(*row) for row in rows])
            sink.out_of_window += out_of_window
            sink.over_limit += over_limit
            yield si


def read_stream(si: SpanInput, run_id: str | None, limits: Limits, run_start_ns: int | None) -> _Result:
    """In a worker process: one stream read through its own sink; its spans as
    rows of :class:`Span`'s fields up to ``events`` (tuples pickle fast, and
    the spans of a call site keep sharing one ``attrs``)."""
    sink = SpanSink(limits, run_start_ns)
    SpanReader(sink.add_many, run_id).read(si)
    rows = [(s.trace_id, s.span_id, s.parent_id, s.name, s.kind, s.start_ns, s.end_ns, s.worker, s.attrs,
             s.status_code, s.status_message, s.events) for s in sink.spans.values()]
    return si, rows, sink.out_of_window, sink.over_limit


def _input_bytes(span_inputs: list[SpanInput]) -> int:
    total = 0
    for si in span_inputs:
        for path in si.paths:
            try:
                total += path.stat().st_size
            except OSError:
                pass
    return total
