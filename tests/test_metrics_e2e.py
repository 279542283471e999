"""Issue 3 end to end: real workers, real HTTP scrapes, a real Prometheus server."""

from __future__ import annotations

import socket

import pytest

from cluster import Cluster, samples, scrape, total
from prom import Prometheus, free_port

HIST = "torch_rpc_client_duration_seconds_count"
REQUESTS = "torch_rpc_client_requests_total"


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
    for mode, dst in (("sync", "worker1"), ("async", "worker2"), ("remote", "worker2")):
        assert total(w0, HIST, method="add", mode=mode) == calls[f"add_{mode}"]  # no peer on a histogram
        assert total(w0, REQUESTS, method="add", mode=mode, dst=dst) == calls[f"add_{mode}"]  # on the counters
    assert not [lab for n, lab, _ in w0 if n.startswith("torch_rpc_client_duration") and "dst" in lab]
    assert total(w0, HIST, method="echo") == calls["threads"] * calls["per_thread"]  # 16 concurrent threads
    assert total(w0, "torch_rpc_client_requests_total", method="echo") == calls["threads"] * calls["per_thread"]
    assert total(w0, "torch_rpc_client_errors_total", method="fail", exception="ValueError") == calls["fail"]
    assert total(w0, "torch_rpc_client_errors_total") == calls["fail"]
    assert total(w0, "torch_rpc_client_in_flight") == 0


def test_server_counts_equal_the_calls_served(run):
    _, expected, scraped = run
    calls = expected["calls"]
    w1, w2 = scraped["worker1"], scraped["worker2"]
    assert total(w1, "torch_rpc_server_duration_seconds_count", method="add") == calls["add_sync"]
    served_by_w2 = total(w2, "torch_rpc_server_duration_seconds_count", method="add")
    assert served_by_w2 == calls["add_async"] + calls["add_remote"]
    assert total(w1, "torch_rpc_server_errors_total", method="fail", exception="ValueError") == calls["fail"]
    # The callee's series carry no caller: they do not grow with the number of peers.
    assert not [lab for w in (w1, w2) for n, lab, _ in w if n.startswith("torch_rpc_server") and "src" in lab]
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


def test_received_bytes_are_the_responses_that_came_from_each_peer(run):
    """Response pickle + trailer + storage bytes, per peer, for every response the caller matched to its call."""
    w0 = run[2]["worker0"]
    received = {lab["dst"]: v for n, lab, v in w0 if n == "torch_rpc_client_received_bytes_total"}
    assert received["worker1"] > received["worker2"] > 0  # worker1 served most calls (echo, views), worker2 async adds
    resp = {"direction": "deserialize", "message": "response"}
    methods = {lab["method"] for n, lab, _ in w0 if n == "torch_rpc_serialized_bytes_count"}
    matched = methods - {"unknown"}  # responses matched to their call (echoed), as the fast path counts them
    n = sum(total(w0, "torch_rpc_serialized_bytes_count", method=m, **resp) for m in matched)
    pickled = sum(total(w0, "torch_rpc_serialized_bytes_sum", method=m, **resp)
                  + total(w0, "torch_rpc_tensor_storage_bytes_sum", method=m, **resp) for m in matched)
    # each echoed response's trailer: 12 bytes + the call id's digits (1-3 here) + a comma and the callee's
    # microseconds (1-7 digits), where the callee timed the call
    trailers = sum(received.values()) - pickled
    assert n > 400 and 13 * n <= trailers <= 25 * n, (n, trailers)


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


def test_names_and_peers_are_capped_and_peers_can_go_on_histograms(tmp_path):
    env = {"RPC_OBSERVE": "1", "RPC_OBSERVE_MAX_METHODS": "3", "RPC_OBSERVE_MAX_PEERS": "1",
           "RPC_OBSERVE_PEER_LABELS": "histograms"}
    cluster = Cluster(tmp_path, "metrics", env=env, hold=True)
    expected, scraped = cluster.scrape_held()
    parsed = scraped["worker0"]
    methods = {lab["method"] for n, lab, _ in parsed if n == HIST}
    assert "other" in methods and len(methods - {"other"}) <= 3
    # One peer keeps its name (whichever worker0 called first, in init_rpc), the other is `other`.
    peers = {lab["dst"] for n, lab, _ in parsed if n == "torch_rpc_client_in_flight"}
    assert len(peers) == 2 and "other" in peers and peers <= {"worker1", "worker2", "other"}
    # histograms: the latency histograms carry the peer, as before series were bounded.
    assert {lab["dst"] for n, lab, _ in parsed if n == HIST} == peers
    served = scraped["worker1"]
    assert total(served, "torch_rpc_server_duration_seconds_count", src="worker0") > expected["calls"]["add_sync"]
    fails = expected["calls"]["fail"]
    assert total(served, "torch_rpc_server_errors_total", src="worker0", exception="ValueError") == fails


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
