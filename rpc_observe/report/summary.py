"""The report's data: the aggregates of :mod:`.aggregate`, the clock offsets, the slowest calls
laid out as waterfalls, the files' verdicts and the flight recorder's findings, as one JSON-ready
dict that the page renders."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rpc_observe.doctor import BadInput, collect, diagnose, render_text
from rpc_observe.merge.clock import estimate_offsets
from rpc_observe.merge.files import natural
from rpc_observe.merge.model import KIND_CLIENT, Span

from .aggregate import OTHER, RunStats
from .series import BOUNDS_NS


def _ms(ns: float) -> float:
    return round(ns / 1e6, 4)


def methods_json(stats: RunStats, scrapes: dict[str, Any]) -> list[dict[str, Any]]:
    messages = scrapes.get("methods", {})
    rows = []
    for name, m in sorted(stats.methods.items(), key=lambda kv: (kv[0] == OTHER, -kv[1].calls, kv[0])):
        per_message = messages.get(name, {})
        rows.append({
            "method": name, "calls": m.calls, "errors": m.errors, "server_calls": m.server_calls,
            "server_errors": m.server_errors, "client": m.client.as_json(), "server": m.server.as_json(),
            "paired": m.paired,
            "paired_client_mean_ms": _ms(m.paired_client_ns / m.paired) if m.paired else None,
            "paired_server_mean_ms": _ms(m.paired_server_ns / m.paired) if m.paired else None,
            "outside_share": (round(1 - m.paired_server_ns / m.paired_client_ns, 4)
                              if m.paired and m.paired_client_ns else None),
            "bytes_per_message": per_message.get("bytes_per_message"),
            "tensors_per_message": per_message.get("tensors_per_message"),
        })
    return rows


def traffic_json(stats: RunStats, workers: list[str], scrapes: dict[str, Any]) -> dict[str, Any]:
    sent = scrapes.get("sent_bytes", {})
    return {"workers": workers, "cells": [
        {"src": src, "dst": dst, "calls": p.calls, "errors": p.errors, "bytes": sent.get(f"{src}\t{dst}")}
        for (src, dst), p in sorted(stats.pairs.items())]}


def clock_json(stats: RunStats, workers: list[str]) -> dict[str, Any]:
    est = estimate_offsets(stats.clock_pairs(), workers)
    pairs: dict[str, int] = dict.fromkeys(workers, 0)
    for (client, server), bounds in stats.clock.items():
        pairs[client] = pairs.get(client, 0) + bounds.pairs
        pairs[server] = pairs.get(server, 0) + bounds.pairs
    return {
        "reference": est.reference,
        "offsets_us": {w: round(est.offsets_us.get(w, 0.0), 3) for w in workers},
        "bounds_us": {w: None if (b := est.bounds_us.get(w)) is None else round(b, 3) for w in workers},
        "pairs": pairs,
        "inconsistent": [list(k) for k in est.inconsistent_edges],
    }


def waterfall(call: tuple[int, str, str], spans: list[Span], offsets_us: dict[str, float]) -> dict[str, Any]:
    """One slow call's trace on the reference clock: a row a span, nested under its parent."""
    duration_ns, trace_id, span_id = call
    by_id = {sp.span_id: sp for sp in spans}
    root = by_id.get(span_id)

    def start(sp: Span) -> float:
        return sp.start_ns / 1000 + offsets_us.get(sp.worker, 0.0)

    def depth(sp: Span) -> int:
        n, seen = 0, {sp.span_id}
        while sp.parent_id in by_id and sp.parent_id not in seen:
            sp = by_id[sp.parent_id]
            seen.add(sp.span_id)
            n += 1
        return n

    origin = min(map(start, spans)) if spans else 0.0
    rows = [{"worker": sp.worker, "kind": "client" if sp.kind == KIND_CLIENT else "server",
             "method": str(sp.attrs.get("rpc.method") or sp.name), "name": sp.name, "depth": depth(sp),
             "start_ms": round((start(sp) - origin) / 1000, 4), "duration_ms": _ms(sp.end_ns - sp.start_ns),
             "error": sp.status_code == 2, "slow": sp.span_id == span_id}
            for sp in sorted(spans, key=lambda s: (start(s), -s.end_ns))]
    return {"trace_id": trace_id, "span_id": span_id, "duration_ms": _ms(duration_ns),
            "method": str(root.attrs.get("rpc.method") or root.name) if root else "?",
            "caller": root.worker if root else "?",
            "callee": str(root.attrs.get("torch.rpc.dst", "?")) if root else "?",
            "rows": rows}


def worker_order(stats: RunStats) -> list[str]:
    return sorted(stats.workers, key=lambda w: (w == OTHER, natural(w)))


def bucket_labels() -> list[str]:
    """The latency histograms' buckets, by upper bound."""
    def label(ns: int) -> str:
        return f"{ns / 1e9:g} s" if ns >= 10**9 else f"{ns / 1e6:g} ms" if ns >= 10**6 else f"{ns / 1e3:g} us"
    return [f"≤ {label(b)}" for b in BOUNDS_NS] + [f"> {label(BOUNDS_NS[-1])}"]


def doctor_json(run_dirs: list[Path]) -> dict[str, Any] | None:
    """The flight recorder's findings from the dumps under ``debug/`` (None: no dumps)."""
    dumps = sorted(str(p) for d in run_dirs for p in (d / "debug").glob("*.json"))
    if not dumps:
        return None
    try:
        inputs = collect(dumps, 1.0)  # dump files only: nothing is fetched
    except BadInput as e:
        return {"dumps": len(dumps), "status": 2, "text": str(e), "headline": str(e)}
    diagnosis = diagnose(inputs.workers)
    text = render_text(diagnosis, inputs.notes)
    return {"dumps": len(dumps), "status": diagnosis.status, "text": text,
            "headline": text.splitlines()[0] if text else ""}
