"""Span export: OTLP to a real HTTP receiver, and the standard sampler variables."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from cluster import Cluster


class _Receiver(BaseHTTPRequestHandler):
    """The OTLP/HTTP protobuf trace endpoint of a collector: POST /v1/traces."""

    spans: list = []

    def do_POST(self):  # noqa: N802 - http.server's API
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest.FromString(body)
        for resource_spans in request.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    type(self).spans.append((resource, span))
        payload = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200 if self.path == "/v1/traces" else 404)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def collector():
    _Receiver.spans = []
    server = HTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _Receiver.spans
    server.shutdown()


def test_otlp_exporter_sends_joined_spans_to_a_collector(tmp_path, collector):
    endpoint, received = collector
    env = {"RPC_OBSERVE": "1", "OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
           "OTEL_SERVICE_NAME": "trainer-job"}
    cluster = Cluster(tmp_path, "basic", env=env)
    cluster.wait()
    assert not list((cluster.out_dir / "spans").glob("*.jsonl"))  # only the configured exporter
    names = {(r["torch.rpc.worker"], s.kind, s.name) for r, s in received}
    assert ("worker0", 3, "rpc_sync#add(worker0 -> worker1)") in names  # SPAN_KIND_CLIENT = 3
    assert ("worker1", 2, "rpc_sync#add(worker0 -> worker1)") in names  # SPAN_KIND_SERVER = 2
    assert {r["service.name"] for r, _ in received} == {"trainer-job"}
    by_id = {s.span_id: s for _, s in received}
    servers = [s for _, s in received if s.kind == 2 and s.name == "rpc_sync#nested(worker1 -> worker2)"]
    assert servers and all(by_id[s.parent_span_id].kind == 3 for s in servers)
    failed = [s for _, s in received if s.name == "rpc_sync#fail(worker0 -> worker1)"]
    assert failed and all(s.status.code == 2 for s in failed)  # STATUS_CODE_ERROR


@pytest.mark.parametrize("sampler, arg, expect_spans", [("always_off", None, False), ("traceidratio", "0", False),
                                                        ("parentbased_always_on", None, True)])
def test_sampler_variables_are_honoured(tmp_path, sampler, arg, expect_spans):
    env = {"RPC_OBSERVE": "1", "OTEL_TRACES_SAMPLER": sampler}
    if arg is not None:
        env["OTEL_TRACES_SAMPLER_ARG"] = arg
    cluster = Cluster(tmp_path, "marker", env=env)
    assert cluster.wait()[0] == {"ok": True}
    user_spans = [s for s in cluster.spans() if s["attrs"]["rpc.method"] == "echo_kw"]
    # Unsampled callers propagate their decision: the callees record nothing either.
    assert bool(user_spans) is expect_spans
    if expect_spans:
        assert {s["kind"] for s in user_spans} == {2, 3}
