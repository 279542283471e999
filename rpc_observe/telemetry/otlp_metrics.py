"""OTLP metrics (`OTEL_METRICS_EXPORTER=otlp`): the same measurements as the scrape, pushed.

Every `OTEL_METRIC_EXPORT_INTERVAL` a thread of its own collects the registry exactly as a
scrape does (so both agree) and POSTs one OTLP/HTTP protobuf `ExportMetricsServiceRequest`
to `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT` (or `OTEL_EXPORTER_OTLP_ENDPOINT` + `/v1/metrics`),
with `_HEADERS` and `_TIMEOUT`. Cumulative temporality, as Prometheus counts. No RPC waits on
it: a collector that is down or slow costs one failed request per interval, counted in
`rpc_observe_metric_exports_failed_total` and said once.

Names: OpenTelemetry's RPC semantic conventions where one is declared (`rpc.client.call.duration`,
`rpc.server.call.duration`, in s, with `rpc.system.name` and `rpc.method`); elsewhere the
Prometheus name without `_total`, its declared unit in the unit field, its labels as attributes.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.metrics.v1 import metrics_pb2 as pb
from prometheus_client.metrics_core import Metric

from ..config import Config
from . import health
from .declarations import METRICS, MetricDeclaration

_logger = logging.getLogger("rpc_observe")
CUMULATIVE = pb.AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE
SCOPE = "rpc_observe"
# The declarations by the name of the family a collection yields (a counter's without _total).
_DECLARED: dict[str, MetricDeclaration] = {m.name.removesuffix("_total") if m.kind == "counter" else m.name: m
                                           for m in METRICS}
_OTLP_UNITS = {"seconds": "s", "bytes": "By", "": "1"}  # a declared unit as UCUM, which OTLP uses
_SEMCONV_ATTRIBUTES = {"method": "rpc.method"}  # the labels of a semantic-convention metric that it renames
_SYSTEM = KeyValue(key="rpc.system.name", value=AnyValue(string_value="torch_rpc"))


def _attributes(labels: dict[str, str], renamed: dict[str, str]) -> list[KeyValue]:
    return [KeyValue(key=renamed.get(k, k), value=AnyValue(string_value=v)) for k, v in labels.items()]


def _exemplar(sample: Any, now_ns: int) -> list[pb.Exemplar]:
    found = sample.exemplar
    if found is None:
        return []
    labels = found.labels
    try:
        trace_id, span_id = bytes.fromhex(labels.get("trace_id", "")), bytes.fromhex(labels.get("span_id", ""))
    except ValueError:
        return []
    when = int(found.timestamp * 1e9) if found.timestamp else now_ns
    return [pb.Exemplar(as_double=found.value, time_unix_nano=when, trace_id=trace_id, span_id=span_id)]


def encode(families: Iterable[Metric], resource: list[KeyValue], start_ns: int, now_ns: int) -> bytes:
    """The families of one collection as an ExportMetricsServiceRequest."""
    metrics: list[pb.Metric] = []
    for family in families:
        declared = _DECLARED.get(family.name)
        unit = _OTLP_UNITS.get(declared.unit, "1") if declared is not None else "1"
        if declared is not None and declared.otel_name:
            name, renamed, extra = declared.otel_name, _SEMCONV_ATTRIBUTES, [_SYSTEM]
        else:
            name, renamed, extra = family.name, {}, []
        metric = pb.Metric(name=name, description=family.documentation, unit=unit)
        if family.type == "histogram":
            points: dict[tuple, dict[str, Any]] = {}
            for sample in family.samples:
                labels = {k: v for k, v in sample.labels.items() if k != "le"}
                point = points.setdefault(tuple(labels.items()), {"labels": labels, "buckets": [], "exemplars": []})
                if sample.name.endswith("_bucket"):
                    point["buckets"].append((float(sample.labels["le"]), sample.value))
                    point["exemplars"] += _exemplar(sample, now_ns)
                elif sample.name.endswith("_sum"):
                    point["sum"] = sample.value
                elif sample.name.endswith("_count"):
                    point["count"] = sample.value
            data_points = []
            for point in points.values():
                cumulative = sorted(point["buckets"])
                bounds = [le for le, _ in cumulative if not math.isinf(le)]
                counts = [int(c - (cumulative[i - 1][1] if i else 0)) for i, (_, c) in enumerate(cumulative)]
                data_points.append(pb.HistogramDataPoint(
                    attributes=extra + _attributes(point["labels"], renamed), start_time_unix_nano=start_ns,
                    time_unix_nano=now_ns, count=int(point.get("count", 0)), sum=point.get("sum", 0.0),
                    bucket_counts=counts, explicit_bounds=bounds, exemplars=point["exemplars"]))
            metric.histogram.CopyFrom(pb.Histogram(data_points=data_points, aggregation_temporality=CUMULATIVE))
        else:
            numbers = [pb.NumberDataPoint(attributes=extra + _attributes(s.labels, renamed),
                                          start_time_unix_nano=start_ns, time_unix_nano=now_ns, as_double=s.value)
                       for s in family.samples if not s.name.endswith("_created")]
            if family.type == "counter":
                metric.sum.CopyFrom(pb.Sum(data_points=numbers, aggregation_temporality=CUMULATIVE, is_monotonic=True))
            else:
                metric.gauge.CopyFrom(pb.Gauge(data_points=numbers))
        metrics.append(metric)
    request = ExportMetricsServiceRequest()
    resource_metrics = request.resource_metrics.add()
    resource_metrics.resource.attributes.extend(resource)
    resource_metrics.scope_metrics.add(scope=InstrumentationScope(name=SCOPE), metrics=metrics)
    return request.SerializeToString()


def resource_attributes(attributes: dict[str, Any]) -> list[KeyValue]:
    values = []
    for key, value in attributes.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            values.append(KeyValue(key=key, value=AnyValue(string_value=str(value))))
        elif isinstance(value, int):
            values.append(KeyValue(key=key, value=AnyValue(int_value=value)))
        else:
            values.append(KeyValue(key=key, value=AnyValue(double_value=value)))
    return values


class OtlpMetricsPusher:
    """Pushes `collect()` every interval from a daemon thread; `shutdown` pushes once more, bounded."""

    def __init__(self, config: Config, collect: Callable[[], Iterable[Metric]], resource: dict[str, Any]) -> None:
        self._config = config
        self._collect = collect
        self._resource = resource_attributes(resource)
        self._start_ns = time.time_ns()
        self._stop = threading.Event()
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="rpc_observe-otlp-metrics", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._config.metric_export_interval_s):
            self.push()

    def push(self, timeout_s: float | None = None) -> bool:
        """One export; False (counted, said once) if it failed."""
        config = self._config
        timeout_s = config.otlp_metrics_timeout_s if timeout_s is None else timeout_s
        try:
            body = encode(self._collect(), self._resource, self._start_ns, time.time_ns())
            request = urllib.request.Request(config.otlp_metrics_endpoint, data=body, method="POST",
                                             headers={**dict(config.otlp_metrics_headers),
                                                      "Content-Type": "application/x-protobuf"})
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                response.read()
            return True
        except Exception as e:  # down, slow, refused, or a bug of ours: the job goes on
            health.metric_export_failed()
            if not self._warned:
                self._warned = True
                _logger.warning("rpc_observe: OTLP metrics export to %s failed (%s); counted in "
                                "rpc_observe_metric_exports_failed_total, retried every %.0f s, said once",
                                config.otlp_metrics_endpoint, getattr(e, "reason", None) or e,
                                config.metric_export_interval_s)
            return False

    def shutdown(self) -> None:
        """The last measurements, within OTEL_BSP_EXPORT_TIMEOUT at most, as the spans' flush: exit never waits long."""
        self._stop.set()
        wait = min(self._config.otlp_metrics_timeout_s, self._config.bsp_export_timeout_s)
        self._thread.join(wait)
        self.push(wait)
