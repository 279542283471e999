"""What ``rpc-observe merge`` keeps of a very large run: a time window
(``--since``/``--until``) and a cap on the spans (``--max-spans``).

The spans are streamed into a :class:`SpanSink`, which deduplicates them and
applies the limits as they come, so memory holds only what is kept.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass
from typing import Any

from .model import Span


@dataclass(frozen=True)
class TimeBound:
    """A ``--since``/``--until`` value: seconds after the run's first event,
    or (``absolute``) unix seconds."""

    seconds: float
    absolute: bool = False

    def to_ns(self, run_start_ns: int | None) -> int:
        """The bound on the workers' clocks, in unix ns."""
        if self.absolute:
            return round(self.seconds * 1e9)
        return (run_start_ns or 0) + round(self.seconds * 1e9)

    def __str__(self) -> str:
        return f"@{self.seconds:g}" if self.absolute else f"{self.seconds:g}s"


def parse_bound(text: str) -> TimeBound:
    """``12.5`` (seconds after the run's first event) or ``@1790000000.5``
    (unix seconds); for argparse, so a bad value raises ValueError."""
    text = text.strip()
    absolute = text.startswith("@")
    seconds = float(text[1:] if absolute else text)
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        raise ValueError(text)
    return TimeBound(seconds, absolute)


@dataclass(frozen=True)
class Limits:
    """What to keep; None: no limit."""

    since: TimeBound | None = None
    until: TimeBound | None = None
    max_spans: int | None = None

    @property
    def relative(self) -> bool:
        """Whether the window needs the run's first event to be known first."""
        return any(b is not None and not b.absolute for b in (self.since, self.until))


class SpanSink:
    """Deduplicates spans by (trace id, span id) and applies the limits:
    spans that do not overlap the window are dropped; past ``max_spans`` the
    oldest kept span (earliest start) makes room for a newer one."""

    def __init__(self, limits: Limits, run_start_ns: int | None) -> None:
        self.limits = limits
        self.spans: dict[tuple[str, str], Span] = {}
        self.lo_ns = limits.since.to_ns(run_start_ns) if limits.since else None
        self.hi_ns = limits.until.to_ns(run_start_ns) if limits.until else None
        self.run_start_ns = run_start_ns
        self.out_of_window = 0
        self.over_limit = 0
        self._heap: list[tuple[int, int, tuple[str, str]]] = []
        self._seq = 0
        self._unlimited = self.lo_ns is None and self.hi_ns is None and limits.max_spans is None

    def add_many(self, batch: list[Span]) -> None:
        """Keep those of ``batch`` that are new and within the limits."""
        if self._unlimited:  # the common case, without a test per span
            keep = self.spans.setdefault
            for s in batch:
                keep((s.trace_id, s.span_id), s)
        else:
            for s in batch:
                self.add(s)

    def add(self, s: Span) -> None:
        """Keep ``s`` if it is new and within the limits."""
        if (self.lo_ns is not None and s.end_ns < self.lo_ns) or (self.hi_ns is not None and s.start_ns > self.hi_ns):
            self.out_of_window += 1
            return
        key = (s.trace_id, s.span_id)
        if key in self.spans:
            return
        self.spans[key] = s
        cap = self.limits.max_spans
        if cap is None:
            return
        self._seq += 1
        if len(self._heap) < cap:
            heapq.heappush(self._heap, (s.start_ns, self._seq, key))
            return
        _, _, old = heapq.heappushpop(self._heap, (s.start_ns, self._seq, key))
        del self.spans[old]
        self.over_limit += 1

    def summary(self, profiler_events_cut: int = 0) -> dict[str, Any] | None:
        """The ``cut`` entry of the merge summary; None if nothing was left out."""
        if not (self.out_of_window or self.over_limit or profiler_events_cut):
            return None
        lim = self.limits
        return {
            "since": str(lim.since) if lim.since else None, "until": str(lim.until) if lim.until else None,
            "since_unix_ns": self.lo_ns, "until_unix_ns": self.hi_ns, "run_start_unix_ns": self.run_start_ns,
            "max_spans": lim.max_spans, "spans_kept": len(self.spans),
            "spans_outside_window": self.out_of_window, "spans_over_max": self.over_limit,
            "profiler_events_outside_window": profiler_events_cut,
        }


def cut_message(cut: dict[str, Any]) -> str:
    """The one line that says what a limit left out."""
    parts = []
    if cut["spans_outside_window"] or cut["profiler_events_outside_window"]:
        window = f"{_when(cut['since_unix_ns'], '-')} .. {_when(cut['until_unix_ns'], '+')}"
        what = f"{cut['spans_outside_window']:,} span(s)"
        if cut["profiler_events_outside_window"]:
            what += f" and {cut['profiler_events_outside_window']:,} profiler event(s)"
        parts.append(f"{what} outside --since/--until ({window})")
    if cut["spans_over_max"]:
        parts.append(f"{cut['spans_over_max']:,} older span(s) beyond --max-spans {cut['max_spans']:,}")
    return f"cut: left out {'; '.join(parts)}; kept {cut['spans_kept']:,} span(s)"


def _when(ns: int | None, open_end: str) -> str:
    if ns is None:
        return open_end + "inf"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ns / 1e9)) + f".{ns % 10**9 // 10**6:03d} UTC"
