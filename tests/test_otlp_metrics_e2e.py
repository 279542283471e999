"""OTLP metrics (OTEL_METRICS_EXPORTER=otlp) on real workers, received by a real OTLP/HTTP receiver in the
test and decoded with opentelemetry-proto: the names, units and counts match a scrape of the same run."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)

from cluster import Cluster, samples, scrape, total
from prom import free_port


class Receiver:
    """An OTLP/HTTP metrics receiver on 127.0.0.1: keeps every request it is sent, with its headers."""

    def __init__(self) -> None:
        self.requests: list[tuple[float, dict[str, str], ExportMetricsServiceRequest]] = []
        received = self.requests

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportMetricsServiceRequest()
                request.ParseFromString(body)
                received.append((time.monotonic(), {k.lower(): v for k, v in self.headers.items()}, request))
                reply = ExportMetricsServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/metrics" else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def last_from(self, worker: str, after: float) -> ExportMetricsServiceRequest | None:
        for when, _, request in reversed(self.requests):
            resource = {a.key: a.value.string_value for a in request.resource_metrics[0].resource.attributes}
            if when > after and resource.get("torch.rpc.worker") == worker:
                return request
        return None


def metrics_of(request: ExportMetricsServiceRequest) -> dict[str, object]:
    return {m.name: m for rm in request.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}


def attrs(point: object) -> dict[str, str]:
    return {a.key: a.value.string_value for a in point.attributes}  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    receiver = Receiver()
    env = {"RPC_OBSERVE": "1", "OTEL_METRICS_EXPORTER": "prometheus,otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
           "OTEL_METRIC_EXPORT_INTERVAL": "300", "OTEL_EXPORTER_OTLP_METRICS_HEADERS": "x-tenant=rpc%20test"}
    cluster = Cluster(tmp_path_factory.mktemp("otlp_metrics"), "metrics", env=env, hold=True)
    try:
        expected = cluster.wait_ready()
        scraped_at = time.monotonic()
        scraped = {w: samples(scrape(t)) for w, t in cluster.targets().items()}
        deadline = time.monotonic() + 10
        pushed = {}
        while time.monotonic() < deadline and len(pushed) < 3:
            pushed = {w: r for w in scraped if (r := receiver.last_from(w, scraped_at)) is not None}
            time.sleep(0.1)
        yield expected, scraped, pushed, receiver
    finally:
        cluster.wait()
        receiver.server.shutdown()


def test_latency_is_pushed_under_the_rpc_semantic_convention_names_with_the_scrapes_counts(run) -> None:
    expected, scraped, pushed, _ = run
    assert set(pushed) == {"worker0", "worker1", "worker2"}
    for worker, name, prom in (("worker0", "rpc.client.call.duration", "torch_rpc_client_duration_seconds"),
                               ("worker1", "rpc.server.call.duration", "torch_rpc_server_duration_seconds")):
        metric = metrics_of(pushed[worker])[name]
        assert metric.unit == "s" and metric.WhichOneof("data") == "histogram"
        by_method: dict[str, int] = {}
        for point in metric.histogram.data_points:
            labels = attrs(point)
            assert labels["rpc.system.name"] == "torch_rpc" and "method" not in labels
            assert sum(point.bucket_counts) == point.count
            assert len(point.bucket_counts) == len(point.explicit_bounds) + 1
            by_method[labels["rpc.method"]] = by_method.get(labels["rpc.method"], 0) + point.count
        for method in ("add", "echo", "fail"):
            assert by_method[method] == total(scraped[worker], f"{prom}_count", method=method) > 0, (worker, method)
    calls = expected["calls"]
    client = metrics_of(pushed["worker0"])["rpc.client.call.duration"]
    exemplars = [e for p in client.histogram.data_points for e in p.exemplars]  # sampled calls: all, by default
    assert exemplars and all(len(e.trace_id) == 16 and len(e.span_id) == 8 and e.as_double > 0 for e in exemplars)
    echo = sum(p.count for p in client.histogram.data_points if attrs(p)["rpc.method"] == "echo")
    assert echo == calls["threads"] * calls["per_thread"]


def test_the_other_metrics_keep_their_names_with_units_and_temporality(run) -> None:
    _, scraped, pushed, _ = run
    metrics = metrics_of(pushed["worker0"])
    requests = metrics["torch_rpc_client_requests"]
    assert requests.sum.is_monotonic and requests.sum.aggregation_temporality == 2  # cumulative
    pushed_adds = sum(p.as_double for p in requests.sum.data_points if attrs(p)["method"] == "add")
    assert pushed_adds == total(scraped["worker0"], "torch_rpc_client_requests_total", method="add") > 0
    assert (metrics["torch_rpc_serialized_bytes"].unit, requests.unit) == ("By", "1")  # the declared units
    assert metrics["torch_rpc_client_in_flight"].WhichOneof("data") == "gauge"


def test_the_exporter_sends_the_configured_headers_and_resource(run) -> None:
    _, _, _, receiver = run
    _, headers, request = receiver.requests[-1]
    assert headers["x-tenant"] == "rpc test" and headers["content-type"] == "application/x-protobuf"
    resource = {a.key: a.value.string_value for a in request.resource_metrics[0].resource.attributes}
    assert resource["service.name"] == resource["torch.rpc.worker"]


def test_a_collector_that_is_down_costs_the_job_nothing(tmp_path: Path) -> None:
    env = {"RPC_OBSERVE": "1", "OTEL_METRICS_EXPORTER": "otlp", "OTEL_METRIC_EXPORT_INTERVAL": "200",
           "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": f"http://127.0.0.1:{free_port()}/v1/metrics"}
    cluster = Cluster(tmp_path, "metrics", env=env, hold=True)
    try:
        expected = cluster.wait_ready()
        time.sleep(0.5)  # a few failed pushes
        parsed = samples(scrape(cluster.targets()["worker0"]))
    finally:
        results = cluster.wait()
    assert results[0]["calls"] == expected["calls"]
    assert total(parsed, "rpc_observe_metric_exports_failed_total") >= 1
    log = cluster.log(0)
    assert log.count("OTLP metrics export to") == 1, log
