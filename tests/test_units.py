"""Unit tests of the pieces that need no RPC: context trailer, config, metric families, tensor sizes."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from rpc_observe.hooks import trailer
from rpc_observe.hooks.pickler import tensor_sizes
from rpc_observe.telemetry import propagation
from rpc_observe.telemetry.metrics import Metrics, fold_finished, fold_started

from cluster import samples, total


def test_trailer_round_trip_and_plain_pickles():
    carrier = {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"}
    head = trailer.request_head("worker0", "sync")
    tail = trailer.request_trailer(head, 42, propagation.carrier_text(carrier))
    size, fields = trailer.split(b"PICKLE." + tail)
    assert size == 7 and fields[:4] == ["q", "worker0", "sync", "42"]
    assert propagation.carrier_of(fields[trailer.CONTEXT :]) == carrier
    size, fields = trailer.split(b"PICKLE." + trailer.request_trailer(head))
    assert fields == ["q", "worker0", "sync", ""] and propagation.carrier_of(fields[trailer.CONTEXT :]) == {}
    assert trailer.split(b"PICKLE.") == (7, None)
    size, fields = trailer.split(b"PICKLE." + trailer.response_trailer("42"))
    assert (size, fields) == (7, ["r", "42"])


@pytest.mark.parametrize(
    "value",
    [
        "00-" + "a" * 32 + "-" + "b" * 16,
        "00-" + "0" * 32 + "-" + "b" * 16 + "-01",
        "ff-" + "a" * 32 + "-" + "b" * 16 + "-01",
        "00-" + "A" * 32 + "-" + "b" * 16 + "-01",
        "x" * 55,
        "00-" + "a" * 32 + "-" + "0" * 16 + "-01",
    ],
)
def test_invalid_traceparents_are_rejected(value):
    assert propagation.parse_traceparent(value) is None


def test_traceparent_round_trip():
    text = propagation.format_traceparent(0xABC, 0xDEF, True)
    assert propagation.parse_traceparent(text) == (0xABC, 0xDEF, True)


def test_metric_families_are_cumulative_and_labelled():
    metrics = Metrics("w0", max_names=2)
    cells = metrics.client_cells("f", "sync", "w1")
    for seconds in (0.0007, 3.0):
        metrics.record((fold_started, cells))
        metrics.record((fold_finished, cells, seconds, None))
    for name in ("g", "h"):
        metrics.client_cells(name, "sync", "w1")
    registry = CollectorRegistry()
    registry.register(metrics)
    parsed = samples(generate_latest(registry).decode())
    hist = "torch_rpc_client_duration_seconds"
    assert total(parsed, hist + "_count", method="f") == 2
    assert total(parsed, hist + "_bucket", method="f", le="0.001") == 1
    assert total(parsed, hist + "_bucket", method="f", le="5.0") == 2
    assert total(parsed, hist + "_sum", method="f") == pytest.approx(3.0007)
    assert {lab["method"] for n, lab, _ in parsed if n == hist + "_count"} == {"f", "g", "other"}  # capped at 2
    assert total(parsed, "torch_rpc_client_in_flight") == 0


def test_tensor_sizes_follow_torchs_clone_rule():
    big = torch.zeros(1 << 20)  # 4 MiB
    assert tensor_sizes([big[:10]]) == (40, 40)  # a small view of a big storage is cloned
    assert tensor_sizes([big[:600_000]]) == (2_400_000, 4 << 20)  # a big view sends the whole storage
    small = torch.zeros(100)  # under 8 KiB: sent whole
    assert tensor_sizes([small[:10]]) == (40, 400)
    assert tensor_sizes([]) == (0, 0)
