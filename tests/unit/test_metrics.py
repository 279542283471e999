"""The Metrics collector, its HTTP endpoint and its file_sd target, in the style of
prometheus/client_python's tests: a fresh CollectorRegistry per test, real servers on port 0.

Records are built exactly as the hot paths build them (the layout comment in
telemetry/metrics.py; hooks/calls.py, hooks/pickler.py and hooks/server.py), and every
value is read back from the text exposition, parsed by prometheus_client's own parser.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rpc_observe import config
from rpc_observe.telemetry import exposition, health
from rpc_observe.telemetry.metrics import (
    LATENCY_BUCKETS,
    SIZE_BUCKETS,
    Metrics,
    fold_finished,
    fold_message,
    fold_served,
    fold_started,
)

W = "worker0"
LATENCY_LE = ["5e-05", "0.0001", "0.00025", "0.0005", "0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1",
              "0.25", "0.5", "1.0", "2.5", "5.0", "10.0", "30.0", "60.0", "+Inf"]
SIZE_LE = ["64.0", "256.0", "1024.0", "4096.0", "16384.0", "65536.0", "262144.0", "1.048576e+06", "4.194304e+06",
           "1.6777216e+07", "6.7108864e+07", "2.68435456e+08", "1.073741824e+09", "4.294967296e+09", "+Inf"]
COUNT_LE = ["0.0", "1.0", "2.0", "4.0", "8.0", "16.0", "32.0", "64.0", "128.0", "256.0", "1024.0", "+Inf"]
SERIALIZATION_LE = ["1e-06", "5e-06", "1e-05", "2.5e-05", "5e-05", "0.0001", "0.00025", "0.0005", "0.001", "0.0025",
                    "0.01", "0.1", "1.0", "10.0", "+Inf"]
Samples = list[tuple[str, dict[str, str], float]]


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def metrics(registry: CollectorRegistry) -> Metrics:
    m = Metrics(W, max_names=3)
    registry.register(m)
    return m


@pytest.fixture(autouse=True)
def no_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)


def parse(text: str) -> tuple[dict[str, str], Samples]:
    """({family name: type}, [(sample name, labels, value)]) of a text exposition."""
    families = list(text_string_to_metric_families(text))
    return ({f.name: f.type for f in families},
            [(s.name, dict(s.labels), s.value) for f in families for s in f.samples])


def scrape(registry: CollectorRegistry) -> Samples:
    return parse(generate_latest(registry).decode())[1]


def value(samples: Samples, name: str, **labels: str) -> float:
    """The one sample called `name` whose labels include `labels`."""
    found = [v for n, ls, v in samples if n == name and labels.items() <= ls.items()]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def buckets(samples: Samples, name: str, **labels: str) -> list[tuple[str, float]]:
    """[(le, cumulative count)] of one histogram child, in exposition order."""
    return [(ls["le"], v) for n, ls, v in samples if n == name + "_bucket" and labels.items() <= ls.items()]


def cumulative(les: list[str], counts: dict[str, int]) -> list[tuple[str, float]]:
    total, out = 0, []
    for le in les:
        total += counts.get(le, 0)
        out.append((le, float(total)))
    return out


# -- records, folded --------------------------------------------------------------------


def test_client_call_records(registry: CollectorRegistry, metrics: Metrics) -> None:
    cells = metrics.client_cells("f", "sync", "worker1")
    for _ in range(3):
        metrics.record((fold_started, cells))  # as ClientSite.started
    assert cells.requests == [0] and cells.in_flight == [0]  # nothing folded before a drain or a scrape
    samples = scrape(registry)
    assert value(samples, "torch_rpc_client_requests_total", worker=W, method="f", mode="sync", dst="worker1") == 3
    assert value(samples, "torch_rpc_client_in_flight", worker=W, dst="worker1") == 3
    for seconds in (0.0007, 0.001, 100.0):  # as Call.finish; 0.001 is a bound: `le` includes it
        metrics.record((fold_finished, cells, seconds, None))
    samples = scrape(registry)
    hist = "torch_rpc_client_duration_seconds"
    labels = {"worker": W, "method": "f", "mode": "sync"}  # no peer on a histogram, by default
    assert buckets(samples, hist, **labels) == cumulative(LATENCY_LE, {"0.001": 2, "+Inf": 1})
    assert value(samples, hist + "_count", **labels) == 3
    assert value(samples, hist + "_sum", **labels) == pytest.approx(100.0017, abs=1e-12)
    assert all("dst" not in ls for n, ls, _ in samples if n.startswith(hist))
    assert value(samples, "torch_rpc_client_in_flight", worker=W, dst="worker1") == 0
    assert value(samples, "torch_rpc_client_requests_total", **labels, dst="worker1") == 3  # cumulative


def test_message_records(registry: CollectorRegistry, metrics: Metrics) -> None:
    client = metrics.client_cells("f", "sync", "worker1")
    request = metrics.message_cells("serialize", "request", "f")
    response = metrics.message_cells("deserialize", "response", "f")
    # As pickler.wrap_serialize builds a request's: pickle bytes, tensors, logical and storage bytes, seconds,
    # the destination's sent-bytes cell and what goes on the wire (pickle + trailer + storage).
    metrics.record((fold_message, request, 100, 2, 4096, 8192, 3e-6, client.sent_bytes, 100 + 30 + 8192))
    metrics.record((fold_message, request, 64, 0, 0, 0, 0.02, client.sent_bytes, 64 + 30))
    # A response the caller unpickles: the destination's received-bytes cell and what came in (pickle + storage).
    metrics.record((fold_message, response, 5_000_000, 1, 2**32, 2**33, 20.0, client.received_bytes,
                    5_000_000 + 12 + 2**33))
    metrics.record((fold_message, response, 10, 0, 0, 0, 0.0, None, 0))  # an unmatched response: no peer to count
    samples = scrape(registry)
    req = {"worker": W, "direction": "serialize", "message": "request", "method": "f"}
    resp = {"worker": W, "direction": "deserialize", "message": "response", "method": "f"}
    assert buckets(samples, "torch_rpc_serialized_bytes", **req) == cumulative(SIZE_LE, {"64.0": 1, "256.0": 1})
    assert buckets(samples, "torch_rpc_serialized_tensors", **req) == cumulative(COUNT_LE, {"0.0": 1, "2.0": 1})
    assert buckets(samples, "torch_rpc_tensor_bytes", **req) == cumulative(SIZE_LE, {"64.0": 1, "4096.0": 1})
    assert buckets(samples, "torch_rpc_tensor_storage_bytes", **req) == cumulative(SIZE_LE, {"64.0": 1, "16384.0": 1})
    assert buckets(samples, "torch_rpc_serialization_seconds", **req) == cumulative(
        SERIALIZATION_LE, {"5e-06": 1, "0.1": 1})
    assert value(samples, "torch_rpc_serialized_bytes_sum", **req) == 164
    assert value(samples, "torch_rpc_tensor_storage_bytes_sum", **req) == 8192
    assert value(samples, "torch_rpc_client_sent_bytes_total", worker=W, dst="worker1") == 8322 + 94
    assert value(samples, "torch_rpc_client_received_bytes_total", worker=W, dst="worker1") == 5_000_012 + 2**33
    assert buckets(samples, "torch_rpc_serialized_bytes", **resp) == cumulative(SIZE_LE, {"64.0": 1,
                                                                                         "1.6777216e+07": 1})
    assert buckets(samples, "torch_rpc_tensor_bytes", **resp) == cumulative(SIZE_LE, {"64.0": 1,
                                                                                      "4.294967296e+09": 1})
    assert buckets(samples, "torch_rpc_tensor_storage_bytes", **resp) == cumulative(SIZE_LE, {"64.0": 1, "+Inf": 1})
    assert buckets(samples, "torch_rpc_serialization_seconds", **resp) == cumulative(
        SERIALIZATION_LE, {"1e-06": 1, "+Inf": 1})
    assert value(samples, "torch_rpc_tensor_storage_bytes_sum", **resp) == 2**33


def test_served_records_and_errors(registry: CollectorRegistry, metrics: Metrics) -> None:
    cell = metrics.server_cells("f", "worker1")
    for seconds in (0.02, 0.025, 0.03, -1e-6):  # as Serving.finish; a negative clock step counts, adds nothing
        metrics.record((fold_served, cell, seconds, None))
    metrics.count_error("server", "f", "worker1", "ValueError")
    for _ in range(2):
        metrics.count_error("client", "f", "worker2", "timeout")
    samples = scrape(registry)
    labels = {"worker": W, "method": "f"}  # the callee's series carry no caller, by default
    assert buckets(samples, "torch_rpc_server_duration_seconds", **labels) == cumulative(
        LATENCY_LE, {"5e-05": 1, "0.025": 2, "0.05": 1})
    assert value(samples, "torch_rpc_server_duration_seconds_sum", **labels) == pytest.approx(0.075)
    assert value(samples, "torch_rpc_server_errors_total", **labels, exception="ValueError") == 1
    assert not [ls for n, ls, _ in samples if n.startswith("torch_rpc_server") and "src" in ls]
    errors = {"worker": W, "method": "f", "dst": "worker2", "exception": "timeout"}
    assert value(samples, "torch_rpc_client_errors_total", **errors) == 2


def test_exposition_format_and_types(registry: CollectorRegistry, metrics: Metrics) -> None:
    metrics.record((fold_started, metrics.client_cells("f", "sync", "worker1")))
    metrics.record((fold_message, metrics.message_cells("serialize", "request", "f"), 1, 0, 0, 0, 0.0, None, 0))
    text = generate_latest(registry).decode()
    types, _ = parse(text)
    assert {k: v for k, v in types.items() if k.startswith("torch_rpc")} == {
        "torch_rpc_serialized_bytes": "histogram", "torch_rpc_serialized_tensors": "histogram",
        "torch_rpc_tensor_bytes": "histogram", "torch_rpc_tensor_storage_bytes": "histogram",
        "torch_rpc_serialization_seconds": "histogram", "torch_rpc_client_duration_seconds": "histogram",
        "torch_rpc_server_duration_seconds": "histogram", "torch_rpc_client_requests": "counter",
        "torch_rpc_client_errors": "counter", "torch_rpc_client_sent_bytes": "counter",
        "torch_rpc_client_received_bytes": "counter",
        "torch_rpc_server_errors": "counter", "torch_rpc_client_in_flight": "gauge",
        "torch_rpc_client_callee_seconds": "histogram", "torch_rpc_client_outside_seconds": "histogram"}
    assert "# TYPE torch_rpc_client_requests_total counter" in text
    assert 'torch_rpc_client_requests_total{dst="worker1",method="f",mode="sync",worker="worker0"} 1.0' in text
    assert 'le="1.048576e+06"' in text and 'le="+Inf"' in text and 'le="5e-05"' in text
    assert "_created" not in text


def test_buckets_match_prometheus_clients_own_histogram() -> None:
    """Same `le` strings, counts and sums as prometheus_client Histograms with the same buckets and observations."""
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    m = Metrics(W, 10)
    ours.register(m)
    served = Histogram("torch_rpc_server_duration_seconds", "doc", ["worker", "method"],
                       buckets=LATENCY_BUCKETS, registry=theirs).labels(W, "f")
    sizes = Histogram("torch_rpc_serialized_bytes", "doc", ["worker", "direction", "message", "method"],
                      buckets=SIZE_BUCKETS, registry=theirs).labels(W, "serialize", "request", "f")
    cell, cells = m.server_cells("f", "w1"), m.message_cells("serialize", "request", "f")
    for seconds in (0.0007, 0.001, 0.0010001, 3.0, 100.0):
        m.record((fold_served, cell, seconds, None))
        served.observe(seconds)
    for size in (0, 64, 65, 1 << 20, 1 << 40):
        m.record((fold_message, cells, size, 0, 0, 0, 0.0, None, 0))
        sizes.observe(size)
    mine, reference = scrape(ours), scrape(theirs)
    for name in ("torch_rpc_server_duration_seconds", "torch_rpc_serialized_bytes"):
        assert buckets(mine, name) == buckets(reference, name) and len(buckets(mine, name)) > 10
        assert value(mine, name + "_sum") == value(reference, name + "_sum")
        assert value(mine, name + "_count") == value(reference, name + "_count") == 5


def test_names_are_capped_with_overflow_to_other(registry: CollectorRegistry) -> None:
    # max_names=3 and max_peers=3: per kind (method, peer, exception), the first 3 distinct names keep their label.
    metrics = Metrics(W, max_names=3, max_peers=3)
    registry.register(metrics)
    sites = [metrics.client_cells(m, "async", d) for m, d in
             (("f", "w1"), ("g", "w2"), ("h", "w3"), ("i", "w4"), ("j", "w5"), ("f", "w4"))]
    for cells in sites:
        metrics.record((fold_started, cells))
    assert sites[3].requests is sites[4].requests  # ("other", "other"): one child
    metrics.server_cells("k", "w1")  # methods are one kind across client, server and messages
    for exception in ("A", "B", "C", "D", "E"):
        metrics.count_error("client", "f", "w1", exception)
    samples = scrape(registry)
    requests = {(ls["method"], ls["dst"]): v for n, ls, v in samples if n == "torch_rpc_client_requests_total"}
    assert requests == {("f", "w1"): 1, ("g", "w2"): 1, ("h", "w3"): 1, ("other", "other"): 2, ("f", "other"): 1}
    assert {ls["method"] for n, ls, _ in samples if n == "torch_rpc_server_duration_seconds_count"} == {"other"}
    errors = {ls["exception"]: v for n, ls, v in samples if n == "torch_rpc_client_errors_total"}
    assert errors == {"A": 1, "B": 1, "C": 1, "other": 2}
    assert value(samples, "torch_rpc_client_in_flight", dst="other") == 3
    assert metrics.cap("method", "f") == "f" and metrics.cap("method", "zzz") == "other"


def test_the_peer_cap_is_its_own(registry: CollectorRegistry) -> None:
    """RPC_OBSERVE_MAX_PEERS caps peers (dst on every per-peer series), independently of the method cap."""
    metrics = Metrics(W, max_names=1, max_peers=4)
    registry.register(metrics)
    for i in range(6):
        metrics.record((fold_started, metrics.client_cells("f", "sync", f"w{i}")))
    metrics.count_error("client", "f", "w5", "timeout")
    samples = scrape(registry)
    in_flight = {ls["dst"]: v for n, ls, v in samples if n == "torch_rpc_client_in_flight"}
    assert in_flight == {"w0": 1, "w1": 1, "w2": 1, "w3": 1, "other": 2}
    assert {ls["dst"] for n, ls, _ in samples if n == "torch_rpc_client_received_bytes_total"} == set(in_flight)
    assert value(samples, "torch_rpc_client_errors_total", method="f", dst="other", exception="timeout") == 1


def test_peer_labels_histograms_puts_peers_on_the_latency_histograms(registry: CollectorRegistry) -> None:
    """RPC_OBSERVE_PEER_LABELS=histograms: the label sets before series were bounded (dst, src on latency)."""
    metrics = Metrics(W, 10, peer_histograms=True)
    registry.register(metrics)
    cells = metrics.client_cells("f", "sync", "worker1")
    metrics.record((fold_finished, cells, 0.01, None))
    metrics.record((fold_served, metrics.server_cells("g", "worker2"), 0.01, None))
    metrics.count_error("server", "g", "worker2", "ValueError")
    samples = scrape(registry)
    assert value(samples, "torch_rpc_client_duration_seconds_count", method="f", mode="sync", dst="worker1") == 1
    assert value(samples, "torch_rpc_server_duration_seconds_count", method="g", src="worker2") == 1
    assert value(samples, "torch_rpc_server_errors_total", method="g", src="worker2", exception="ValueError") == 1


def _served_by(n_callers: int, methods: int = 5, peer_histograms: bool = False) -> tuple[int, int]:
    """(series, bytes) of the scrape of a worker that `n_callers` peers call with `methods` methods, each site
    bound as hooks/server.py and hooks/pickler.py bind it."""
    registry = CollectorRegistry()
    m = Metrics(W, 100, peer_histograms=peer_histograms)
    registry.register(m)
    for k in range(methods):
        request = m.message_cells("deserialize", "request", f"m{k}")
        response = m.message_cells("serialize", "response", f"m{k}")
        for caller in range(n_callers):
            m.record((fold_message, request, 100, 1, 16, 16, 1e-5, None, 0))
            m.record((fold_served, m.server_cells(f"m{k}", f"worker{caller + 1}"), 1e-3, None))
            m.record((fold_message, response, 100, 1, 16, 16, 1e-5, None, 0))
    text = generate_latest(registry).decode()
    return len(parse(text)[1]), len(text)


def test_a_callees_series_do_not_grow_with_its_callers() -> None:
    (series, size), (series_1024, size_1024) = _served_by(15), _served_by(1024)
    assert series == series_1024 and size_1024 < size * 1.02  # the same series; only the values have more digits
    few, _ = _served_by(15, peer_histograms=True)
    many, _ = _served_by(1024, peer_histograms=True)
    # method x caller x (buckets, +Inf, sum, count), callers capped at RPC_OBSERVE_MAX_PEERS (256) and `other`
    assert many - few == (256 + 1 - 15) * 5 * (len(LATENCY_BUCKETS) + 3)


def test_a_callers_per_peer_series_are_capped() -> None:
    registry = CollectorRegistry()
    m = Metrics(W, 100, max_peers=256)
    registry.register(m)
    for peer in range(1024):
        cells = m.client_cells("f", "sync", f"worker{peer}")
        m.record((fold_started, cells))
        m.record((fold_finished, cells, 1e-3, None))
    samples = scrape(registry)
    for name in ("torch_rpc_client_requests_total", "torch_rpc_client_in_flight", "torch_rpc_client_sent_bytes_total",
                 "torch_rpc_client_received_bytes_total"):
        assert len([1 for n, _, _ in samples if n == name]) == 257  # 256 peers and `other`
    assert value(samples, "torch_rpc_client_requests_total", dst="other") == 1024 - 256
    assert value(samples, "torch_rpc_client_duration_seconds_count", method="f") == 1024  # one histogram


def test_drain_limit_reports_whether_records_are_left(metrics: Metrics) -> None:
    cells = metrics.client_cells("f", "sync", "w1")
    for _ in range(5):
        metrics.record((fold_started, cells))
    assert metrics.drain(2) is True and cells.requests == [2]
    assert metrics.drain(2) is True and cells.requests == [4]
    assert metrics.drain(2) is False and cells.requests == [5]
    assert metrics.drain(2) is False and metrics.drain() is False and cells.requests == [5]
    for _ in range(3):
        metrics.record((fold_finished, cells, 0.1, None))
    assert metrics.drain() is False and cells.in_flight == [2] and sum(cells.duration[:-1]) == 3


def test_concurrent_drains_fold_each_record_once(metrics: Metrics) -> None:
    """The housekeeping thread and a scrape drain at the same time: neither may count, nor pop, a record
    the other folds (the count of records to fold must be taken under the lock)."""
    cells = metrics.client_cells("f", "sync", "w1")
    holding, release = threading.Event(), threading.Event()

    def blocking_fold(record: tuple) -> None:
        holding.set()
        release.wait(2.0)

    metrics.record((blocking_fold,))
    for _ in range(2):
        metrics.record((fold_started, cells))
    errors: list[BaseException] = []

    def drain() -> None:
        try:
            metrics.drain()
        except BaseException as e:
            errors.append(e)

    first = threading.Thread(target=drain)
    first.start()
    assert holding.wait(2.0)  # the first drain holds the lock, 2 records still queued
    second = threading.Thread(target=drain)
    second.start()
    time.sleep(0.05)  # the second drain is waiting for the lock
    release.set()
    first.join(2.0)
    second.join(2.0)
    assert errors == [] and cells.requests == [2] and metrics.drain() is False


def test_health_counters_are_exposed(registry: CollectorRegistry, metrics: Metrics,
                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="rpc_observe")
    for where in ("serialize", "serialize", "deserialize"):
        try:
            raise RuntimeError(f"boom in {where}")
        except RuntimeError:
            health.internal_error(where)
    health.spans_lost(7, "queue_full")
    health.spans_lost(2, "disk_cap")
    health.invalid_context()
    samples = scrape(registry)
    assert value(samples, "rpc_observe_internal_errors_total", worker=W, where="serialize") == 2
    assert value(samples, "rpc_observe_internal_errors_total", worker=W, where="deserialize") == 1
    assert value(samples, "rpc_observe_spans_dropped_total", worker=W, reason="queue_full") == 7
    assert value(samples, "rpc_observe_spans_dropped_total", worker=W, reason="disk_cap") == 2
    assert value(samples, "rpc_observe_spans_dropped_total", worker=W, reason="disk_error") == 0  # every reason
    assert value(samples, "rpc_observe_invalid_context_total", worker=W) == 1
    warnings = [r for r in caplog.records if "internal error" in r.getMessage()]
    assert len(warnings) == 2  # the first of each kind, with its traceback
    assert all(r.exc_info is not None and r.exc_info[0] is RuntimeError for r in warnings)


def test_before_collect_hook_runs_and_its_errors_are_counted(registry: CollectorRegistry) -> None:
    calls: list[int] = []

    def hook() -> None:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("sweep failed")

    m = Metrics(W, 10, before_collect=hook)
    registry.register(m)
    scrape(registry)
    samples = scrape(registry)  # the hook raises: the scrape still works
    assert len(calls) == 2
    assert value(samples, "rpc_observe_internal_errors_total", where="before_collect") == 1


def test_agent_gauges(registry: CollectorRegistry, metrics: Metrics) -> None:
    metrics.agent_info = lambda: {"agent.thread_pool_size": "16", "agent.num_idle_threads": "3",
                                  "agent.gil_average_wait_time_us": "250", "agent.client_active_calls": "2",
                                  "agent.server_active_async_calls": "1", "unrelated": "x"}
    samples = scrape(registry)
    assert value(samples, "torch_rpc_agent_threads", worker=W) == 16
    assert value(samples, "torch_rpc_agent_idle_threads", worker=W) == 3
    assert value(samples, "torch_rpc_agent_gil_wait_seconds", worker=W) == pytest.approx(250e-6)
    active = {ls["side"]: v for n, ls, v in samples if n == "torch_rpc_agent_active_calls"}
    assert active == {"client": 2, "async": 1}

    def no_agent() -> dict[str, Any]:
        raise RuntimeError("RPC has not been initialized")

    metrics.agent_info = no_agent
    assert not [n for n, _, _ in scrape(registry) if n.startswith("torch_rpc_agent")]


# -- exposition: HTTP /metrics and the file_sd target -------------------------------------------


_closing: list[threading.Thread] = []


@pytest.fixture(scope="module", autouse=True)
def servers_closed() -> Iterator[None]:
    yield
    for thread in _closing:
        thread.join(2.0)


def close(server: Any) -> None:
    server.shutdown()  # waits for serve_forever's 0.5 s poll
    server.server_close()


@pytest.fixture
def servers() -> Iterator[list[Any]]:
    """Servers a test started; closed in the background (all joined at the end of the module)."""
    started: list[Any] = []
    yield started
    for server in started:
        thread = threading.Thread(target=close, args=(server,), daemon=True)
        thread.start()
        _closing.append(thread)


def get(port: int, path: str = "/metrics") -> tuple[int, str, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
        return response.status, response.headers["Content-Type"], response.read().decode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_on_a_free_port_and_scrape_over_http(registry: CollectorRegistry, metrics: Metrics,
                                                   servers: list[Any]) -> None:
    server, port = exposition.serve(registry, config.load({}), rank=0)
    servers.append(server)
    assert port > 0 and server.server_address == ("127.0.0.1", port)
    cells = metrics.client_cells("f", "sync", "worker1")
    metrics.record((fold_started, cells))
    metrics.record((fold_finished, cells, 0.003, None))
    status, content_type, body = get(port)
    assert status == 200 and content_type.startswith("text/plain")
    samples = parse(body)[1]
    assert value(samples, "torch_rpc_client_requests_total", method="f") == 1  # records queued before the scrape
    assert buckets(samples, "torch_rpc_client_duration_seconds", method="f") == cumulative(LATENCY_LE, {"0.005": 1})
    metrics.record((fold_started, cells))
    assert value(parse(get(port)[2])[1], "torch_rpc_client_in_flight", dst="worker1") == 1


def test_serve_on_base_port_plus_local_rank(registry: CollectorRegistry, metrics: Metrics, servers: list[Any],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    server, got = exposition.serve(registry, config.load({"RPC_OBSERVE_METRICS_PORT": str(port - 3)}), rank=3)
    servers.append(server)
    assert got == port  # LOCAL_RANK unset: the RPC rank
    other = free_port()
    monkeypatch.setenv("LOCAL_RANK", "1")
    server, got = exposition.serve(registry, config.load({"RPC_OBSERVE_METRICS_PORT": str(other - 1)}), rank=5)
    servers.append(server)
    assert got == other  # torchrun's LOCAL_RANK wins over the global rank
    assert get(got)[0] == 200


@pytest.mark.parametrize("local, rank, expected", [(None, 4, 4), ("2", 4, 2), ("x", 4, 4), (None, None, 0),
                                                    (None, -1, 0), ("", 7, 7)])
def test_local_rank(monkeypatch: pytest.MonkeyPatch, local: str | None, rank: int | None, expected: int) -> None:
    if local is not None:
        monkeypatch.setenv("LOCAL_RANK", local)
    assert exposition.local_rank(rank) == expected


def test_port_in_use_falls_back_to_a_free_port_with_one_warning(registry: CollectorRegistry, metrics: Metrics,
                                                                servers: list[Any],
                                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="rpc_observe")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        server, port = exposition.serve(registry, config.load({"RPC_OBSERVE_METRICS_PORT": str(taken)}), rank=0)
        servers.append(server)
    assert port != taken and get(port)[0] == 200
    warnings = [r for r in caplog.records if r.name == "rpc_observe" and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert f"metrics port {taken} (RPC_OBSERVE_METRICS_PORT={taken} + local rank) is not available" in message
    assert "using a free port instead" in message


def test_port_above_65535_falls_back_with_one_warning(registry: CollectorRegistry, metrics: Metrics,
                                                      servers: list[Any], monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="rpc_observe")
    monkeypatch.setenv("LOCAL_RANK", "1")
    server, port = exposition.serve(registry, config.load({"RPC_OBSERVE_METRICS_PORT": "65535"}), rank=1)
    servers.append(server)
    assert 0 < port < 65535 and get(port)[0] == 200
    assert [r.getMessage() for r in caplog.records if r.name == "rpc_observe"] == [
        "rpc_observe: RPC_OBSERVE_METRICS_PORT=65535 plus local rank 1 is above 65535; using a free port"]


LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def check_file_sd(path: Path) -> list[tuple[str, int]]:
    """Validates a Prometheus file_sd JSON file; returns its targets as (host, port)."""
    groups = json.loads(path.read_text(encoding="utf-8"))
    assert isinstance(groups, list) and groups
    found = []
    for group in groups:
        assert set(group) <= {"targets", "labels"} and isinstance(group["targets"], list)
        for name, label in group.get("labels", {}).items():
            assert LABEL_NAME.fullmatch(name) and not name.startswith("__") and isinstance(label, str)
        for target in group["targets"]:
            parts = urllib.parse.urlsplit("//" + target)  # <host>:<port>, IPv6 hosts in brackets
            assert parts.netloc == target and parts.path == "" and parts.port is not None
            found.append((parts.hostname, parts.port))
    return found


@pytest.mark.parametrize("addr, host", [("127.0.0.1", "127.0.0.1"), ("0.0.0.0", "127.0.0.1"), ("", "127.0.0.1"),
                                        ("::", "::1"), ("10.1.2.3", "10.1.2.3"), ("node7", "node7")])
def test_write_target_writes_valid_file_sd(tmp_path: Path, addr: str, host: str) -> None:
    path = exposition.write_target(str(tmp_path), "worker3", addr, 9101, "run-42")
    assert Path(path) == tmp_path / "worker3.json"
    assert check_file_sd(Path(path)) == [(host, 9101)]
    assert json.loads(Path(path).read_text())[0]["labels"] == {"job": "rpc_observe", "rpc_observe_run_id": "run-42"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["worker3.json"]  # no temporary file left
    exposition.write_target(str(tmp_path), "worker3", addr, 9102, "run-43")  # rewritten in place
    assert check_file_sd(Path(path)) == [(host, 9102)]


@pytest.mark.parametrize("addr", ["::1", "fe80::1"])
def test_write_target_brackets_ipv6_addresses(tmp_path: Path, addr: str) -> None:
    path = exposition.write_target(str(tmp_path), "worker3", addr, 9101, "run-42")
    assert check_file_sd(Path(path)) == [(addr, 9101)]


def test_write_target_names_the_advertised_address(tmp_path: Path) -> None:
    path = exposition.write_target(str(tmp_path), "worker3", "0.0.0.0", 9101, "run-42", advertise="node7.cluster")
    assert json.loads(Path(path).read_text())[0]["targets"] == ["node7.cluster:9101"]


def test_latency_buckets_carry_the_last_sampled_calls_exemplar_in_openmetrics_only(
        registry: CollectorRegistry, metrics: Metrics) -> None:
    from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics

    from rpc_observe.telemetry.tracing import CLIENT, SERVER, SpanRecord

    def span(kind: int, trace_id: int, span_id: int, sampled: bool) -> SpanRecord:
        record = SpanRecord("f", kind, trace_id, span_id, 0, False, sampled, {}, 1_000_000_000)
        record.end_ns = 3_000_000_000
        return record

    cells, served = metrics.client_cells("f", "sync", "worker1"), metrics.server_cells("f", "worker1")
    metrics.record((fold_finished, cells, 0.003, span(CLIENT, 0xA1, 0xB1, True)))
    metrics.record((fold_finished, cells, 0.004, span(CLIENT, 0xA2, 0xB2, True)))  # same bucket: the last one
    metrics.record((fold_finished, cells, 0.2, span(CLIENT, 0xA3, 0xB3, False)))  # not sampled: no exemplar
    metrics.record((fold_finished, cells, 0.3, None))  # no tracer
    metrics.record((fold_served, served, 0.002, span(SERVER, 0xC1, 0xD1, True)))
    text = generate_openmetrics(registry).decode()
    found = {(s.name, s.labels["le"]): (s.exemplar.labels, s.exemplar.value, float(s.exemplar.timestamp))
             for f in parse_openmetrics(text) for s in f.samples if s.exemplar is not None}
    assert found == {
        ("torch_rpc_client_duration_seconds_bucket", "0.005"): (
            {"trace_id": f"{0xA2:032x}", "span_id": f"{0xB2:016x}"}, 0.004, 3.0),
        ("torch_rpc_server_duration_seconds_bucket", "0.0025"): (
            {"trace_id": f"{0xC1:032x}", "span_id": f"{0xD1:016x}"}, 0.002, 3.0),
    }
    assert "trace_id" not in generate_latest(registry).decode()  # the plain text format is unchanged
