"""Every metric rpc_observe exposes, declared once: name, kind, help, labels, buckets, unit.

`Metrics` (per-call metrics, the add-on's health, the agent's gauges) and `StateGauges`
(torch's state, the oldest call and UDF) build their families from these rows, in this
order; the dashboard check (`dashboards/generate.py --check`, tests/test_dashboards_live.py)
and tests/unit/test_declarations.py (the documented metric table) read them too. Adding a
metric is a row here, the code that measures it, and a row in the documented table
(CONTRIBUTING.md, "Adding a metric").

Nothing here runs per call: `Metrics` resolves its rows when it is built, and the hot paths
only ever touch the cells bound from them. Plain data, no import beyond the standard library,
so that tools (the dashboard generator) read it without prometheus_client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["counter", "gauge", "histogram"]

# 50 us .. 60 s, and 64 B .. 4 GiB (powers of 4).
LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0)
SIZE_BUCKETS = tuple(float(64 * 4**i) for i in range(14))
COUNT_BUCKETS = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 1024.0)
SERIALIZATION_BUCKETS = (1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1, 1.0, 10.0)
WORKER = "worker"  # the label every sample carries first: the process's RPC worker name


@dataclass(frozen=True)
class MetricDeclaration:
    """One metric as a scrape shows it. Fields added later have defaults, so the rows stay as they are."""

    name: str  # the Prometheus name as exposed: a counter's ends in _total
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()  # after `worker`, in their order in the families
    peer_labels: tuple[str, ...] = ()  # those of `labels` present only with RPC_OBSERVE_PEER_LABELS=histograms
    buckets: tuple[float, ...] | None = None  # upper bounds, histograms only (+Inf implied)
    unit: str = ""  # the unit the name ends with (seconds, bytes), as OpenMetrics asks; "" for counts
    exemplars: bool = False  # a sampled call's trace and span ids per bucket (docs/exemplars.md)
    otel_name: str = ""  # its OpenTelemetry semantic-convention name over OTLP (docs/otlp-metrics.md); "": none

    def label_names(self, peer_histograms: bool = False) -> tuple[str, ...]:
        """The family's label names: `worker`, then `labels` (the peer ones only with `peer_histograms`)."""
        return (WORKER,) + tuple(n for n in self.labels if peer_histograms or n not in self.peer_labels)

    def sample_names(self) -> tuple[str, ...]:
        """The names of this metric's samples in a scrape."""
        if self.kind == "histogram":
            return tuple(self.name + suffix for suffix in ("_bucket", "_sum", "_count"))
        return (self.name,)


def _histogram(name: str, help: str, labels: tuple[str, ...], buckets: tuple[float, ...], unit: str,
               peer_labels: tuple[str, ...] = (), exemplars: bool = False, otel_name: str = "") -> MetricDeclaration:
    return MetricDeclaration(name, "histogram", help, labels, peer_labels, buckets, unit, exemplars, otel_name)


_MESSAGE = ("direction", "message", "method")
_CLIENT_LATENCY = ("method", "mode", "dst")

# Measured per call (`Metrics`' families, in the order a scrape shows them).
CALL_METRICS = (
    _histogram("torch_rpc_serialized_bytes", "Pickled RPC payload size per message (tensors excluded).", _MESSAGE,
               SIZE_BUCKETS, "bytes"),
    _histogram("torch_rpc_serialized_tensors", "Tensors in the tensor table per message.", _MESSAGE, COUNT_BUCKETS, ""),
    _histogram("torch_rpc_tensor_bytes", "Logical tensor bytes (numel * element_size) per message.", _MESSAGE,
               SIZE_BUCKETS, "bytes"),
    _histogram("torch_rpc_tensor_storage_bytes", "Tensor storage bytes that travel per message.", _MESSAGE,
               SIZE_BUCKETS, "bytes"),
    _histogram("torch_rpc_serialization_seconds", "Time spent pickling or unpickling a message.", _MESSAGE,
               SERIALIZATION_BUCKETS, "seconds"),
    _histogram("torch_rpc_client_duration_seconds", "Client RPC duration until its future completes.",
               _CLIENT_LATENCY, LATENCY_BUCKETS, "seconds", ("dst",), exemplars=True,
               otel_name="rpc.client.call.duration"),
    _histogram("torch_rpc_client_callee_seconds",
               "The callee's own time for a call, as its response says: from unpickling the request to pickling "
               "the response.", _CLIENT_LATENCY, LATENCY_BUCKETS, "seconds", ("dst",)),
    _histogram("torch_rpc_client_outside_seconds",
               "A call's client duration minus the callee's own time: queueing in the callee's thread pool, "
               "(de)serialization, the wire (client = callee + outside).", _CLIENT_LATENCY, LATENCY_BUCKETS,
               "seconds", ("dst",)),
    _histogram("torch_rpc_server_duration_seconds", "Server-side run time of Python UDFs.", ("method", "src"),
               LATENCY_BUCKETS, "seconds", ("src",), exemplars=True, otel_name="rpc.server.call.duration"),
    MetricDeclaration("torch_rpc_client_requests_total", "counter", "Client RPCs started.", ("method", "mode", "dst")),
    MetricDeclaration("torch_rpc_client_errors_total", "counter", "Client RPCs that failed, by exception.",
                      ("method", "dst", "exception")),
    MetricDeclaration("torch_rpc_client_sent_bytes_total", "counter",
                      "Request bytes (pickle and tensor storage) sent to each peer.", ("dst",), unit="bytes"),
    MetricDeclaration("torch_rpc_client_received_bytes_total", "counter",
                      "Response bytes (pickle and tensor storage) received from each peer.", ("dst",), unit="bytes"),
    MetricDeclaration("torch_rpc_server_errors_total", "counter", "Python UDFs that raised, by exception.",
                      ("method", "src", "exception"), ("src",)),
    MetricDeclaration("torch_rpc_client_in_flight", "gauge", "Client RPCs started and not yet completed.", ("dst",)),
)

# The add-on's own health (telemetry.health), read at scrape time.
HEALTH_METRICS = (
    MetricDeclaration("rpc_observe_internal_errors_total", "counter", "Exceptions caught in rpc_observe's own code.",
                      ("where",)),
    MetricDeclaration("rpc_observe_spans_dropped_total", "counter",
                      "Spans dropped, by reason: queue_full, export_failed, timeout (shutdown flush), "
                      "disk_cap (deleted past RPC_OBSERVE_SPANS_MAX_BYTES), disk_error (span file not writable).",
                      ("reason",)),
    MetricDeclaration("rpc_observe_invalid_context_total", "counter",
                      "Malformed trace contexts received from peers (ignored)."),
    MetricDeclaration("rpc_observe_metric_exports_failed_total", "counter",
                      "OTLP metric exports that failed (OTEL_METRICS_EXPORTER=otlp)."),
)

# The RPC agent's debug info, read at scrape time.
AGENT_METRICS = (
    MetricDeclaration("torch_rpc_agent_threads", "gauge", "RPC agent thread pool size."),
    MetricDeclaration("torch_rpc_agent_idle_threads", "gauge", "Idle threads in the RPC agent's pool."),
    MetricDeclaration("torch_rpc_agent_gil_wait_seconds", "gauge",
                      "Average GIL wait time of the agent's threads (needs GIL profiling on).", unit="seconds"),
    MetricDeclaration("torch_rpc_agent_active_calls", "gauge", "Calls in progress in the RPC agent.", ("side",)),
)

# `StateGauges`: the flight recorder's ages and torch's RRef and distributed autograd state, read at scrape time.
STATE_METRICS = (
    MetricDeclaration("torch_rpc_client_oldest_call_age_seconds", "gauge",
                      "Age of the oldest client RPC this worker has in flight (0: none).", unit="seconds"),
    MetricDeclaration("torch_rpc_server_oldest_udf_age_seconds", "gauge",
                      "Age of the oldest Python UDF this worker is running (0: none).", unit="seconds"),
    MetricDeclaration("rpc_observe_hang_threshold_seconds", "gauge",
                      "The age at which this worker counts a call or UDF as stuck (RPC_OBSERVE_HANG_SECONDS; "
                      "30 when the watchdog is off): the stuck alerts compare the two ages with it.", unit="seconds"),
    MetricDeclaration("torch_rpc_rref_owners", "gauge", "OwnerRRefs this worker holds (a steady rise is a leak)."),
    MetricDeclaration("torch_rpc_rref_pending_users", "gauge", "UserRRefs waiting for their owner's confirmation."),
    MetricDeclaration("torch_rpc_rref_forks", "gauge", "RRef forks this worker still tracks."),
    MetricDeclaration("torch_rpc_rref_pending_futures", "gauge", "OwnerRRef values not yet set."),
    MetricDeclaration("torch_rpc_dist_autograd_contexts", "gauge",
                      "Live distributed autograd contexts (a steady rise is a leak)."),
    MetricDeclaration("torch_rpc_dist_autograd_backward_passes", "gauge", "Distributed backward passes in progress."),
)

METRICS = CALL_METRICS + HEALTH_METRICS + AGENT_METRICS + STATE_METRICS
BY_NAME = {m.name: m for m in METRICS}


def sample_names() -> set[str]:
    """Every sample name a scrape of rpc_observe can show (histograms' _bucket, _sum and _count)."""
    return {sample for m in METRICS for sample in m.sample_names()}
