"""The fixed-size summaries a report keeps of any number of spans: a latency histogram
with fixed buckets, and time bins that double their width instead of growing in number."""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

# Bucket upper bounds in ns, 1-2-5 steps from 10 us to 100 s, and one for anything longer.
BOUNDS_NS: list[int] = [m * 10**e for e in range(4, 11) for m in (1, 2, 5)] + [10**11]
TIME_BINS = 240  # bins of the timeline: the page holds this many points a worker, whatever the run's length
FIRST_BIN_NS = 10_000_000  # 10 ms, doubled as the run turns out longer


class Latency:
    """Durations in fixed buckets (``BOUNDS_NS`` and one overflow), with the exact count, sum and max."""

    __slots__ = ("counts", "count", "sum_ns", "max_ns")

    def __init__(self) -> None:
        self.counts = [0] * (len(BOUNDS_NS) + 1)
        self.count = 0
        self.sum_ns = 0
        self.max_ns = 0

    def add(self, ns: int) -> None:
        self.counts[bisect_left(BOUNDS_NS, ns)] += 1
        self.count += 1
        self.sum_ns += ns
        if ns > self.max_ns:
            self.max_ns = ns

    def merge(self, other: Latency) -> None:
        self.counts = [a + b for a, b in zip(self.counts, other.counts)]
        self.count += other.count
        self.sum_ns += other.sum_ns
        self.max_ns = max(self.max_ns, other.max_ns)

    def quantile_ns(self, q: float) -> float | None:
        """Interpolated within its bucket, as Prometheus' histogram_quantile does (capped at the max)."""
        if not self.count:
            return None
        rank, below, lower = q * self.count, 0, 0
        for i, n in enumerate(self.counts):
            if n and below + n >= rank:
                upper = BOUNDS_NS[i] if i < len(BOUNDS_NS) else self.max_ns
                return min(lower + (upper - lower) * (rank - below) / n, float(self.max_ns))
            below += n
            lower = BOUNDS_NS[i] if i < len(BOUNDS_NS) else lower
        return float(self.max_ns)

    def as_json(self) -> dict[str, Any]:
        ms = lambda ns: None if ns is None else round(ns / 1e6, 4)  # noqa: E731
        mean = self.sum_ns / self.count if self.count else None
        return {"count": self.count, "counts": self.counts, "mean_ms": ms(mean),
                "p50_ms": ms(self.quantile_ns(0.5)), "p90_ms": ms(self.quantile_ns(0.9)),
                "p99_ms": ms(self.quantile_ns(0.99)), "max_ms": ms(self.max_ns if self.count else None)}


class TimeBins:
    """Per worker, over the run: calls started, failed calls, and busy time (the time-weighted
    number of calls in flight).  ``TIME_BINS`` bins from the first span's start; a span past the
    last bin doubles the width (pairs of bins add up), so the size never grows."""

    def __init__(self, origin_ns: int) -> None:
        self.origin_ns = origin_ns
        self.width_ns = FIRST_BIN_NS
        self.calls: dict[str, list[int]] = {}
        self.errors: dict[str, list[int]] = {}
        self.busy_ns: dict[str, list[int]] = {}
        self.end_ns = origin_ns

    def _series(self, worker: str) -> tuple[list[int], list[int], list[int]]:
        if worker not in self.calls:
            for table in (self.calls, self.errors, self.busy_ns):
                table[worker] = [0] * TIME_BINS
        return self.calls[worker], self.errors[worker], self.busy_ns[worker]

    def _coarsen(self) -> None:
        self.width_ns *= 2
        half = TIME_BINS // 2
        for table in (self.calls, self.errors, self.busy_ns):
            for worker, a in table.items():
                table[worker] = [a[2 * i] + a[2 * i + 1] for i in range(half)] + [0] * (TIME_BINS - half)

    def add(self, worker: str, start_ns: int, end_ns: int, failed: bool) -> None:
        start = max(start_ns - self.origin_ns, 0)
        end = max(end_ns - self.origin_ns, start)
        while end >= TIME_BINS * self.width_ns:
            self._coarsen()
        self.end_ns = max(self.end_ns, end_ns)
        calls, errors, busy = self._series(worker)
        width = self.width_ns
        first = start // width
        calls[first] += 1
        if failed:
            errors[first] += 1
        last = end // width
        if first == last:
            busy[first] += end - start
            return
        busy[first] += (first + 1) * width - start
        for b in range(first + 1, last):
            busy[b] += width
        busy[last] += end - last * width

    def as_json(self, workers: list[str]) -> dict[str, Any]:
        """Seconds from the origin per bin; calls and errors a second; mean calls in flight."""
        used = max(1, min(TIME_BINS, -(-(self.end_ns - self.origin_ns) // self.width_ns)))
        rate = 1e9 / self.width_ns
        shown = [w for w in workers if w in self.calls]
        return {
            "bin_s": self.width_ns / 1e9,
            "t_s": [round(i * self.width_ns / 1e9, 4) for i in range(used)],
            "workers": shown,
            "calls_per_s": {w: [round(v * rate, 3) for v in self.calls[w][:used]] for w in shown},
            "errors_per_s": {w: [round(v * rate, 3) for v in self.errors[w][:used]] for w in shown},
            "in_flight": {w: [round(v / self.width_ns, 3) for v in self.busy_ns[w][:used]] for w in shown},
        }
