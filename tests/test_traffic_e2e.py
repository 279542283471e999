"""Traffic that never reaches the Python pickler: RRef.to_here(), dist_autograd.backward,
DistributedOptimizer.step, and torch's own RRef and autograd state as gauges."""

from __future__ import annotations

import pytest

from cluster import Cluster, total

INTERNAL, CLIENT = 1, 3


@pytest.fixture(scope="module")
def traffic(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("traffic"), "traffic", env={"RPC_OBSERVE": "1"}, hold=True)
    result, scraped = cluster.scrape_held()
    results = cluster.wait()
    assert results[0]["fetched"] == [1000, 1001, 1002, 2, 2]  # what torch returned, unchanged
    assert results[0]["async"] == [2.0, 2.0]
    assert results[0]["builtin"] == [3.0, 3.0]
    assert results[0]["sync_left"] == []  # ended where rpc_sync's wait returned, not by a later sweep
    return cluster, scraped, cluster.spans()


def test_to_here_is_a_client_span_and_a_client_call(traffic):
    cluster, scraped, spans = traffic
    fetches = [s for s in spans if s["name"] == "rpc_to_here#RRef.to_here(worker0 -> worker1)"]
    assert len(fetches) == 7 and {s["kind"] for s in fetches} == {CLIENT}  # 4 tensors, a dict, the weight twice
    assert all(int(s["endTimeUnixNano"]) > int(s["startTimeUnixNano"]) for s in fetches)
    assert fetches[0]["attrs"]["rpc.method"] == "RRef.to_here" and fetches[0]["attrs"]["torch.rpc.dst"] == "worker1"
    w0 = scraped["worker0"]
    assert total(w0, "torch_rpc_client_requests_total", method="RRef.to_here", mode="to_here") == 7
    assert total(w0, "torch_rpc_client_duration_seconds_count", method="RRef.to_here", mode="to_here") == 7
    # every fetch's response is named: the dict's pickle as the tensors' storage
    response = {"direction": "deserialize", "message": "response"}
    assert total(w0, "torch_rpc_serialized_bytes_count", method="RRef.to_here", **response) == 7  # once each
    assert total(w0, "torch_rpc_serialized_bytes_sum", method="RRef.to_here", **response) > 0  # the dict's pickle
    # the fetched tensors' bytes: 3 tensors of 1000-1002 floats, the 4-float weight twice, the builtin's 2 floats
    fetched = 4 * (1000 + 1001 + 1002) + 2 * 4 * 4 + 2 * 4
    assert total(w0, "torch_rpc_tensor_storage_bytes_sum", method="RRef.to_here", direction="deserialize") == fetched
    assert total(w0, "torch_rpc_client_received_bytes_total", dst="worker1") >= fetched


def test_the_owner_names_the_responses_it_pickles(traffic):
    """An RRef fetch's reply as the caller names it, an async_execution UDF's reply by its method: none unknown."""
    w1 = traffic[1]["worker1"]
    sent = {"direction": "serialize", "message": "response"}
    # Python values held by worker1's OwnerRRefs, fetched: 3 tensors, the dict, the weight twice (the builtin's
    # tensor is a TorchScript value: torch sends it without the Python pickler)
    assert total(w1, "torch_rpc_serialized_bytes_count", method="RRef.to_here", **sent) == 6
    assert total(w1, "torch_rpc_tensor_storage_bytes_sum", method="RRef.to_here", **sent) == (
        4 * (1000 + 1001 + 1002) + 2 * 4 * 4)
    assert total(w1, "torch_rpc_serialized_bytes_count", method="async_add", **sent) == 1
    assert total(w1, "torch_rpc_serialized_bytes_count", method="unknown", **sent) == 0


def test_backward_and_optimizer_step_are_spans_and_parents(traffic):
    _, _, spans = traffic
    (backward,) = [s for s in spans if s["name"] == "dist_autograd.backward"]
    assert backward["kind"] == INTERNAL and backward["worker"] == "worker0"
    assert backward["attrs"]["torch.rpc.dist_autograd.workers"] == "1,2"  # the workers the context reached
    (step,) = [s for s in spans if s["name"] == "DistributedOptimizer.step"]
    assert step["kind"] == INTERNAL
    context_id = backward["attrs"]["torch.rpc.dist_autograd.context_id"]  # one context, both calls (OTLP intValue)
    assert int(context_id) >= 0 and step["attrs"]["torch.rpc.dist_autograd.context_id"] == context_id
    children = [s for s in spans if s.get("parentSpanId") == step["spanId"]]
    assert len(children) == 1 and children[0]["attrs"]["rpc.method"].endswith("_local_optimizer_step")
    assert children[0]["attrs"]["torch.rpc.internal"] is False  # the user's work, carried by torch
    assert children[0]["traceId"] == step["traceId"]


def test_torch_rref_and_autograd_state_are_gauges(traffic):
    _, scraped, _ = traffic
    assert total(scraped["worker1"], "torch_rpc_rref_owners") >= 3  # the kept tensors and the weight
    assert total(scraped["worker0"], "torch_rpc_rref_owners") == 0
    for worker in ("worker0", "worker1", "worker2"):
        names = {n for n, _, _ in scraped[worker]}
        assert {"torch_rpc_rref_pending_users", "torch_rpc_rref_forks", "torch_rpc_rref_pending_futures",
                "torch_rpc_dist_autograd_contexts", "torch_rpc_dist_autograd_backward_passes"} <= names
    assert total(scraped["worker0"], "torch_rpc_dist_autograd_backward_passes") == 0
