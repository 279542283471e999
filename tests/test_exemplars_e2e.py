"""Exemplars on real workers, kept by a real Prometheus (exemplar storage on, as in docker-compose.yml):
`/api/v1/query_exemplars` of the latency histograms gives trace ids, and each is a trace in the span
files with a span of the exemplar's method, on the exemplar's worker, of the right kind."""

from __future__ import annotations

import time

import pytest

from cluster import Cluster
from prom import Prometheus

SERVER, CLIENT = 2, 3


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("exemplars")
    cluster = Cluster(path, "metrics", env={"RPC_OBSERVE": "1"}, hold=True)
    server = None
    try:
        cluster.wait_ready()
        server = Prometheus(path / "prometheus", str(cluster.out_dir / "targets" / "*.json"))
        found: dict[str, list[dict]] = {}

        def count(side: str) -> int:
            return sum(len(series["exemplars"]) for series in found.get(side, []))

        deadline = time.monotonic() + 30  # until each side has several (a scrape or two, 1 s apart)
        while time.monotonic() < deadline and min(count("client"), count("server")) < 3:
            for side in ("client", "server"):
                found[side] = server.exemplars(f"torch_rpc_{side}_duration_seconds_bucket", time.time() - 600,
                                               time.time())
            time.sleep(0.5)
    finally:
        if server is not None:
            server.stop()
        cluster.release()
        cluster.wait()
    yield found, cluster.spans()


@pytest.mark.parametrize(("side", "kind"), [("client", CLIENT), ("server", SERVER)])
def test_latency_exemplars_lead_to_traces_of_their_method_in_the_span_files(run, side: str, kind: int) -> None:
    found, spans = run
    assert found.get(side), f"no {side} exemplar in Prometheus after 30 s"
    by_span = {(s["traceId"], s["spanId"]): s for s in spans}
    checked = 0
    for series in found[side]:
        labels = series["seriesLabels"]
        for exemplar in series["exemplars"]:
            ids = exemplar["labels"]
            span = by_span.get((ids["trace_id"], ids["span_id"]))
            assert span is not None, f"exemplar {ids} of {labels} is in no span file"
            assert (span["attrs"]["rpc.method"], span["worker"], span["kind"]) == (
                labels["method"], labels["worker"], kind)
            duration = (int(span["endTimeUnixNano"]) - int(span["startTimeUnixNano"])) / 1e9
            upper = float(labels["le"])
            assert float(exemplar["value"]) <= upper and (side == "server" or duration <= upper)
            checked += 1
    assert checked >= 3  # several methods and buckets
