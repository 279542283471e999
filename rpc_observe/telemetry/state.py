"""Gauges of the RPC framework's own state (RRefs, distributed autograd), read at scrape time.

The source is given by the hooks (it reads torch); once RPC shuts down or the process
exits it is dropped, so that a scrape never touches torch while it tears down.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from . import health

StateSource = Callable[[], list[tuple[str, str, float]]]  # () -> [(metric name, help, value)]


class StateGauges(Collector):
    def __init__(self, worker: str) -> None:
        self.worker = worker
        self.source: StateSource | None = None

    def collect(self) -> Iterator[Metric]:
        source = self.source
        if source is None:
            return
        try:
            values = source()
        except Exception:
            health.internal_error("torch_state")
            return
        for name, doc, value in values:
            gauge = GaugeMetricFamily(name, doc, labels=("worker",))
            gauge.add_metric((self.worker,), value)
            yield gauge
