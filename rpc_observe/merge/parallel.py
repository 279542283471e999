"""Span streams read in several processes, for a large run.

Reading is most of a merge's time and every stream reads alone, so a large
run's streams are read by ``jobs`` processes, this one included: helper
processes take streams from the front, and this one, between taking in what
they read, reads streams from the back.  Every stream goes through its own
sink with the limits (what the run keeps of a stream is a subset of what the
stream keeps alone), so memory stays bounded by ``--max-spans``, and streams
are taken in in their order, so the merge is the same as one read in this
process alone.  A pool that cannot start or dies reads the rest here.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .limits import Limits, SpanSink
from .model import Span, SpanInput
from .spanfile import SpanReader

if TYPE_CHECKING:
    from concurrent.futures import Future

# Below this much span input (about 300,000 spans), starting the processes costs more than they
# save: at 100,000 spans (80 MB) two readers took 1.45 s against 1.28 s in process (BENCHMARKS.md).
PARALLEL_MIN_BYTES = 256 << 20

_Result = tuple[SpanInput, list[tuple[Any, ...]], int, int]


def read_streams(span_inputs: list[SpanInput], run_id: str | None, sink: SpanSink, jobs: int) -> Iterator[SpanInput]:
    """Read every stream into ``sink``, in order; yields each once it is in."""
    done = 0
    if jobs > 1 and len(span_inputs) > 1 and _input_bytes(span_inputs) >= PARALLEL_MIN_BYTES:
        from concurrent.futures.process import BrokenProcessPool  # 30 ms of imports: only when used

        try:
            for si in _in_processes(span_inputs, run_id, sink, jobs - 1):
                done += 1
                yield si
            return
        except (OSError, BrokenProcessPool):  # no processes here (or one was killed): read the rest here
            pass
    reader = SpanReader(sink.add_many, run_id)
    for si in span_inputs[done:]:
        reader.read(si)
        yield si


def _in_processes(span_inputs: list[SpanInput], run_id: str | None, sink: SpanSink,
                  helpers: int) -> Iterator[SpanInput]:
    import multiprocessing
    from concurrent.futures import Future, ProcessPoolExecutor

    # spawn, not fork: merge() may be called in a process with threads (a finished training job).
    with ProcessPoolExecutor(helpers, mp_context=multiprocessing.get_context("spawn"), initializer=gc.disable) as pool:
        # Per stream: its helper's future, or what this process read of it (its own sink).
        slots: list[Future[_Result] | SpanSink | None] = [None] * len(span_inputs)
        front, back = 0, len(span_inputs)  # streams[front:back] are not started yet
        # Streams read here but not yet taken in: with --max-spans, a bound on the memory held (each
        # holds up to that many spans); without it, every span read is kept to the end anyway.
        held = helpers + 1 if sink.limits.max_spans is not None else len(span_inputs)

        def submit() -> None:
            nonlocal front
            if front < back:
                slots[front] = pool.submit(read_stream, span_inputs[front], run_id, sink.limits, sink.run_start_ns)
                front += 1

        for _ in range(helpers + 1):  # one ahead per helper
            submit()
        for i, si in enumerate(span_inputs):
            slot = slots[i]
            while isinstance(slot, Future) and _busy(slot) and front < back and held > 0:
                back -= 1  # the helpers are busy: read one from the back here meanwhile
                slots[back] = _read_here(span_inputs[back], run_id, sink)
                held -= 1
            if isinstance(slot, Future):
                si, rows, out_of_window, over_limit = slot.result()  # the helper's si holds what it read
                slots[i] = None
                submit()
                sink.add_many([Span(*row) for row in rows])
            else:
                if slot is None:  # not started: read now
                    slot = _read_here(si, run_id, sink)
                else:
                    held += 1
                slots[i] = None
                sink.add_many(list(slot.spans.values()))
                out_of_window, over_limit = slot.out_of_window, slot.over_limit
            sink.out_of_window += out_of_window
            sink.over_limit += over_limit
            yield si


def _busy(job: Future[_Result]) -> bool:
    return not job.done()


def _read_here(si: SpanInput, run_id: str | None, sink: SpanSink) -> SpanSink:
    """One stream read in this process as a helper reads it: through its own sink."""
    own = SpanSink(sink.limits, sink.run_start_ns)
    SpanReader(own.add_many, run_id).read(si)
    return own


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
