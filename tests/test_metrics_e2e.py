"""Issue 3 end to end: real workers, real HTTP scrapes, a real Prometheus server."""

from __future__ import annotations

import socket

import pytest

from cluster import Cluster, samples, scrape, total
from prom import Prometheus, free_port

HIST = "torch_rpc_client_duration_seconds_count"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The `metrics` scenario, held while the test scrapes every worker and Prometheus does too."""
    path = tmp_path_factory.mktemp("metrics")
    cluster = Cluster(path, "metrics", env={"RPC_OBSERVE": "1"}, rank_env={1: {"RPC_OBSERVE_GIL_PROFILING": "1"}},
                      hold=True)
    try:
        expected = cluster.wait_ready()
        targets = cluster.targets()
        scraped = {w: samples(scrape(t)) for w, t in targets.items()}
        yield cluster, expected, scraped
    finally:
        cluster.wait()


@pytest.fixture(scope="module")
def prometheus(run, tmp_path_factory):
    cluster = run[0]
    server = Prometheus(tmp_path_factory.mktemp("prometheus"), str(cluster.out_dir / "targets" / "*.json"))
    yield server
    server.stop()


def test_client_counts_equal_the_calls_made(run):
    _, expected, scraped = run
    w0, calls = scraped["worker0"], expected["calls"]
    assert total(w0, HIST, method="add", mode="sync", dst="worker1") == calls["add_sync"]
    assert total(w0, HIST, method="add", mode="async", dst="worker2") == calls["add_async"]
    assert total(w0, HIST, method="add", mode="remote", dst="worker2") == calls["add_remote"]
    assert total(w0, HIST, method="echo") == calls["threads"] * calls["per_thread"]  # 16 concurrent threads
    assert total(w0, "torch_rpc_client_requests_total", method="echo") == calls["threads"] * calls["per_thread"]
    assert total(w0, "torch_rpc_client_errors_total", method="fail", exception="ValueError") == calls["fail"]
    assert total(w0, "torch_rpc_client_errors_total") == calls["fail"]
    assert total(w0, "torch_rpc_client_in_flight") == 0


def test_server_counts_equal_the_calls_served(run):
    _, expected, scraped = run
    calls = expected["calls"]
    w1, w2 = scraped["worker1"], scraped["worker2"]
    assert total(w1, "torch_rpc_server_duration_seconds_count", method="add", src="worker0") == calls["add_sync"]
    assert (
        total(w2, "torch_rpc_server_duration_seconds_count", method="add", src="worker0")
        == calls["add_async"] + calls["add_remote"]
    )
    assert (
        total(w1, "torch_rpc_server_errors_total", method="fail", src="worker0", exception="ValueError")
        == calls["fail"]
    )
    assert total(w1, "torch_rpc_server_duration_seconds_count", method="echo") == calls["threads"] * calls["per_thread"]


def test_serialized_bytes_and_tensors_match_the_real_pickles(run):
    _, expected, scraped = run
    w0, w1 = scraped["worker0"], scraped["worker1"]
    add_bytes, add_tensors = expected["add_request"]
    n_add = sum(expected["calls"][k] for k in ("add_sync", "add_async", "add_remote"))
    req = {"direction": "serialize", "message": "request", "method": "add"}
    assert total(w0, "torch_rpc_serialized_bytes_count", **req) == n_add
    assert total(w0, "torch_rpc_serialized_bytes_sum", **req) == n_add * add_bytes
    assert total(w0, "torch_rpc_serialized_tensors_sum", **req) == n_add * add_tensors
    many_bytes, many_tensors = expected["many_request"]
    many = {"direction": "serialize", "message": "request", "method": "view_size_many"}
    assert total(w0, "torch_rpc_serialized_bytes_sum", **many) == many_bytes
    assert total(w0, "torch_rpc_serialized_tensors_sum", **many) == many_tensors == 6
    assert total(w0, "torch_rpc_tensor_bytes_sum", **many) == 6 * 3 * 4
    # The callee sees the same pickle (the context trailer is not counted on either side).
    got = {"direction": "deserialize", "message": "request", "method": "add"}
    assert total(w1, "torch_rpc_serialized_bytes_sum", **got) == expected["calls"]["add_sync"] * add_bytes


def test_storage_bytes_are_what_really_travels(run):
    _, expected, scraped = run
    w0 = scraped["worker0"]
    labels = {"direction": "serialize", "message": "request", "method": "view_size"}
    # The callee measured the storage it received: torch cloned the small view, sent the big one whole.
    received_storage = sum(storage for _, storage in expected["received"])
    logical = sum(own for own, _ in expected["views"])
    assert expected["received"][0][1] < expected["views"][0][1]  # small view: cloned
    assert expected["received"][1][1] == expected["views"][1][1]  # large view: the whole storage
    assert total(w0, "torch_rpc_tensor_storage_bytes_sum", **labels) == received_storage
    assert total(w0, "torch_rpc_tensor_bytes_sum", **labels) == logical
    assert received_storage > logical  # the waste the dashboard shows


def test_responses_are_labelled_with_their_method(run):
    _, expected, scraped = run
    calls = expected["calls"]
    resp = {"direction": "deserialize", "message": "response", "method": "add"}
    assert (
        total(scraped["worker0"], "torch_rpc_serialized_bytes_count", **resp) == calls["add_sync"] + calls["add_async"]
    )
    sent = {"direction": "serialize", "message": "response", "method": "add"}
    assert total(scraped["worker1"], "torch_rpc_serialized_bytes_count", **sent) == calls["add_sync"]


def test_every_sample_carries_its_worker(run):
    for worker, parsed in run[2].items():
        assert parsed
        assert all(labels.get("worker") == worker for _, labels, _ in parsed)


def test_agent_saturation_gauges(run):
    for parsed in run[2].values():
        assert total(parsed, "torch_rpc_agent_threads") == 16
        assert 0 <= total(parsed, "torch_rpc_agent_idle_threads") <= 16
        assert {lab["side"] for n, lab, _ in parsed if n == "torch_rpc_agent_active_calls"} == {
            "client",
            "server",
            "async",
        }


def test_gil_wait_only_where_gil_profiling_was_switched_on(run):
    gil = "torch_rpc_agent_gil_wait_seconds"
    assert [n for n, _, _ in run[2]["worker1"] if n == gil] == [gil]
    assert [n for n, _, _ in run[2]["worker0"] if n == gil] == []


def test_latency_buckets_span_50us_to_60s(run):
    les = {lab["le"] for n, lab, _ in run[2]["worker0"] if n == "torch_rpc_client_duration_seconds_bucket"}
    assert "5e-05" in les and "60.0" in les and "+Inf" in les
    sizes = {lab["le"] for n, lab, _ in run[2]["worker0"] if n == "torch_rpc_serialized_bytes_bucket"}
    assert "64.0" in sizes and "4.294967296e+09" in sizes  # as prometheus_client writes bounds


def test_a_real_prometheus_discovers_and_scrapes_every_worker(run, prometheus):
    _, expected, _ = run
    calls = expected["calls"]
    assert prometheus.wait_for('count(up{job="rpc_observe"} == 1)', 3) == 3
    n_add = calls["add_sync"] + calls["add_async"] + calls["add_remote"]
    assert prometheus.wait_for('sum(torch_rpc_client_duration_seconds_count{method="add"})', n_add) == n_add
    assert prometheus.value('sum(torch_rpc_client_errors_total{exception="ValueError"})') == calls["fail"]
    assert (
        prometheus.value(
            'sum(torch_rpc_serialized_tensors_sum{direction="serialize",message="request",method="view_size_many"})'
        )
        == 6
    )
    add_bytes = expected["add_request"][0]
    assert (
        prometheus.value('sum(torch_rpc_serialized_bytes_sum{direction="serialize",message="request",method="add"})')
        == n_add * add_bytes
    )
    p99 = prometheus.value(
        'histogram_quantile(0.99, sum by (le) (torch_rpc_client_duration_seconds_bucket{method="echo"}))'
    )
    assert p99 is not None and 0 < p99 < 60
    idle = prometheus.query("torch_rpc_agent_idle_threads")
    assert sorted(r["metric"]["worker"] for r in idle) == ["worker0", "worker1", "worker2"]


def test_method_names_are_capped(tmp_path):
    cluster = Cluster(tmp_path, "metrics", env={"RPC_OBSERVE": "1", "RPC_OBSERVE_MAX_METHODS": "3"}, hold=True)
    parsed = cluster.scrape_held()[1]["worker0"]
    methods = {lab["method"] for n, lab, _ in parsed if n == HIST}
    assert "other" in methods and len(methods - {"other"}) <= 3


def test_metrics_port_base_plus_rank_fallback_and_bad_value(tmp_path):
    base = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + 1))
        taken.listen()
        env = {"RPC_OBSERVE": "1", "RPC_OBSERVE_METRICS_PORT": str(base)}
        cluster = Cluster(tmp_path, "marker", env=env, rank_env={2: {"RPC_OBSERVE_METRICS_PORT": "http"}}, hold=True)
        try:
            cluster.wait_ready()
            targets = cluster.targets()
            assert targets["worker0"] == f"127.0.0.1:{base}"
            assert targets["worker1"] != f"127.0.0.1:{base + 1}"  # taken: a free port instead
            for worker in ("worker1", "worker2"):  # the endpoint the target names really serves
                assert total(samples(scrape(targets[worker])), "torch_rpc_agent_threads") == 16
        finally:
            results = cluster.wait()
    assert results[0] == {"ok": True}
    assert "RPC_OBSERVE_METRICS_PORT" in cluster.log(1) and "not available" in cluster.log(1)
    assert "RPC_OBSERVE_METRICS_PORT='http' is not valid" in cluster.log(2)
