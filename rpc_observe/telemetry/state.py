"""Gauges of the RPC framework's own state (RRefs, distributed autograd, the oldest call and UDF), read at
scrape time, as `declarations.STATE_METRICS` declares them.

The source is given by the hooks (it reads torch); once RPC shuts down or the process
exits it is dropped, so that a scrape never touches torch while it tears down.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from . import health
from .declarations import BY_NAME
from .metrics import value_family

StateSource = Callable[[], list[tuple[str, float]]]  # () -> [(declared metric name, value)]


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
        for name, value in values:
            gauge = value_family(BY_NAME[name])  # declarations.STATE_METRICS
            gauge.add_metric((self.worker,), value)
            yield gauge
