"""The demo's end-of-run tables, computed from the workers' own /metrics scrapes."""

from __future__ import annotations

import math
import urllib.request
from collections import defaultdict
from collections.abc import Iterable

from prometheus_client.parser import text_string_to_metric_families


def fetch(target: str) -> str:
    """A worker's /metrics page, as Prometheus text."""
    with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as response:
        return response.read().decode()


def parse(text: str) -> list[tuple[str, dict, float]]:
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def scrape(target: str) -> list[tuple[str, dict, float]]:
    return parse(fetch(target))


def quantile(q: float, buckets: dict[float, float]) -> float:
    """Prometheus' histogram_quantile over cumulative buckets {le: count}."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] == 0:
        return math.nan
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for le in bounds:
        if buckets[le] >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * (rank - below) / max(buckets[le] - below, 1e-12)
        lower, below = le, buckets[le]
    return lower


Sample = tuple[str, dict, float]  # name, labels, value: one scraped sample


def _histograms(samples: Iterable[Sample], name: str, key: str) -> dict[str, dict[float, float]]:
    out: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    for n, labels, value in samples:
        if n == f"{name}_bucket":
            out[labels[key]][float(labels["le"])] += value
    return out


def _sums(samples: Iterable[Sample], name: str, key: str, **match: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for n, labels, value in samples:
        if n == name and all(labels.get(k) == v for k, v in match.items()):
            out[labels[key]] += value
    return out


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:.2f}"


def method_table(samples: list[Sample]) -> list[str]:
    """Calls, errors, client and server p50/p99, bytes and tensors per call, wasted storage."""
    calls = _sums(samples, "torch_rpc_client_requests_total", "method")
    errors = _sums(samples, "torch_rpc_client_errors_total", "method")
    client = _histograms(samples, "torch_rpc_client_duration_seconds", "method")
    server = _histograms(samples, "torch_rpc_server_duration_seconds", "method")
    req = {"direction": "serialize", "message": "request"}
    nbytes = _sums(samples, "torch_rpc_serialized_bytes_sum", "method", **req)
    messages = _sums(samples, "torch_rpc_serialized_bytes_count", "method", **req)
    tensors = _sums(samples, "torch_rpc_serialized_tensors_sum", "method", **req)
    logical = _sums(samples, "torch_rpc_tensor_bytes_sum", "method", **req)
    storage = _sums(samples, "torch_rpc_tensor_storage_bytes_sum", "method", **req)
    callee = _sums(samples, "torch_rpc_client_callee_seconds_sum", "method")
    outside = _sums(samples, "torch_rpc_client_outside_seconds_sum", "method")
    split = _sums(samples, "torch_rpc_client_outside_seconds_count", "method")
    header = (f"{'method':<34}{'calls':>7}{'errors':>7}{'client p50/p99 ms':>19}{'server p50/p99 ms':>19}"
              f"{'mean ms: client = callee + outside':>36}{'bytes/msg':>11}{'tensors/msg':>12}{'wasted':>8}")
    rows = [header, "-" * len(header)]
    for method in sorted(calls, key=lambda m: -calls[m]):
        n = messages.get(method, 0)
        wasted = 1 - logical[method] / storage[method] if storage.get(method) else 0.0
        c, s = client.get(method, {}), server.get(method, {})
        rows.append(f"{method[:33]:<34}{calls[method]:>7.0f}{errors.get(method, 0):>7.0f}"
                    f"{_ms(quantile(0.5, c)) + '/' + _ms(quantile(0.99, c)):>19}"
                    f"{_ms(quantile(0.5, s)) + '/' + _ms(quantile(0.99, s)):>19}"
                    f"{_split(callee.get(method, 0.0), outside.get(method, 0.0), split.get(method, 0.0)):>36}"
                    f"{(nbytes[method] / n if n else 0):>11.0f}{(tensors[method] / n if n else 0):>12.1f}"
                    f"{wasted:>8.0%}")
    return rows


def _split(callee: float, outside: float, calls: float) -> str:
    """`client = callee + outside`, mean ms per call, over the calls whose response gave the callee's time."""
    if not calls:
        return "-"
    return f"{(callee + outside) / calls * 1e3:.2f} = {callee / calls * 1e3:.2f} + {outside / calls * 1e3:.2f}"


def traffic_matrix(samples: list[Sample]) -> list[str]:
    """Bytes and calls from each worker (rows) to each peer (columns)."""
    sent: dict[tuple[str, str], float] = defaultdict(float)
    calls: dict[tuple[str, str], float] = defaultdict(float)
    for n, labels, value in samples:
        if n == "torch_rpc_client_sent_bytes_total":
            sent[labels["worker"], labels["dst"]] += value
        elif n == "torch_rpc_client_requests_total":
            calls[labels["worker"], labels["dst"]] += value
    workers = sorted({w for w, _ in calls} | {d for _, d in calls})
    corner = "from \\ to"
    rows = [f"{corner:<12}" + "".join(f"{w:>22}" for w in workers)]
    for src in workers:
        cells = [f"{calls.get((src, dst), 0):.0f} calls {sent.get((src, dst), 0) / 1e6:.1f} MB"
                 if (src, dst) in calls else "-" for dst in workers]
        rows.append(f"{src:<12}" + "".join(f"{c:>22}" for c in cells))
    return rows
