"""`rpc-observe report`'s aggregation, on span files written by rpc_observe's own exporter: counts,
the client = server + outside split, clock offsets, waterfalls, bounded tables, the files' verdicts."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from rpc_observe import report
from rpc_observe.merge.model import KIND_CLIENT, KIND_SERVER, Span
from rpc_observe.report import aggregate, series
from rpc_observe.report.page import render

T0 = 1_790_000_000_000_000_000
UPLOT_JS_SHA256 = "19c8d4c6ad88929a79f4ae49d6f7161566dfd0ba3d15cc495e974f787eb78f1f"
UPLOT_CSS_SHA256 = "df630c6a8d6f8eeaff264b50f73ce5b114f646ffd9a0bb74f049b0a00135fa04"
SKEW_NS = {"w0": 0, "w1": 3_000_000, "w2": -2_000_000}  # each worker's clock error


def _write_run(root: Path, calls: int = 300, run_id: str = "r", methods: tuple[str, ...] = ("step", "get", "put"),
               seed: int = 3) -> dict:
    """A 3-worker run through OtlpJsonFileSink; returns what the report must find."""
    exporters = pytest.importorskip("rpc_observe.telemetry.exporters")
    from rpc_observe.telemetry.tracing import SpanRecord

    rng = random.Random(seed)
    workers = list(SKEW_NS)
    records: dict[str, list] = {w: [] for w in workers}
    expect: dict = {"calls": {}, "errors": {}, "client_ns": {}, "server_ns": {}, "slowest": (0, "")}
    t = T0
    for i in range(calls):
        src, dst = rng.sample(workers, 2)
        method = methods[i % len(methods)]
        attrs = {"rpc.system": "torch_rpc", "rpc.method": method, "torch.rpc.src": src, "torch.rpc.dst": dst}
        name = f"rpc_sync#{method}({src} -> {dst})"
        t += rng.randrange(100_000, 2_000_000)
        work, wire = rng.randrange(10_000, 5_000_000), rng.randrange(50_000, 400_000)
        trace, cid, sid = rng.getrandbits(128), rng.getrandbits(64), rng.getrandbits(64)
        client = SpanRecord(name, KIND_CLIENT, trace, cid, 0, False, True, attrs, t + SKEW_NS[src])
        client.end_ns = t + 2 * wire + work + SKEW_NS[src]
        server = SpanRecord(name, KIND_SERVER, trace, sid, cid, True, True, attrs, t + wire + SKEW_NS[dst])
        server.end_ns = t + wire + work + SKEW_NS[dst]
        failed = i % 29 == 5
        if failed:
            for rec in (client, server):
                rec.error_type, rec.error_message = "RuntimeError", "boom"
        records[src].append(client)
        records[dst].append(server)
        expect["calls"][method] = expect["calls"].get(method, 0) + 1
        expect["errors"][method] = expect["errors"].get(method, 0) + failed
        expect["client_ns"][method] = expect["client_ns"].get(method, 0) + 2 * wire + work
        expect["server_ns"][method] = expect["server_ns"].get(method, 0) + work
        expect["slowest"] = max(expect["slowest"], (2 * wire + work, f"{trace:032x}"))
    root.mkdir(parents=True, exist_ok=True)
    for i, w in enumerate(workers):
        sink = exporters.OtlpJsonFileSink(str(root / f"{w}-{100 + i}.jsonl"), {
            "service.name": "trainer", "torch.rpc.worker": w, "process.pid": 100 + i, "rpc_observe.run_id": run_id})
        for k in range(0, len(records[w]), 50):
            sink.export(records[w][k:k + 50])
        sink.shutdown()
    return expect


def test_counts_split_and_clock_match_what_was_written(tmp_path: Path) -> None:
    expect = _write_run(tmp_path / "spans")
    data = report.make_report([str(tmp_path)])
    rows = {m["method"]: m for m in data["methods"]}
    assert set(rows) == set(expect["calls"])
    for method, row in rows.items():
        assert (row["calls"], row["server_calls"], row["paired"]) == (expect["calls"][method],) * 3
        assert row["errors"] == row["server_errors"] == expect["errors"][method]
        client_ms = expect["client_ns"][method] / expect["calls"][method] / 1e6
        server_ms = expect["server_ns"][method] / expect["calls"][method] / 1e6
        assert row["paired_client_mean_ms"] == pytest.approx(client_ms, abs=1e-3)
        assert row["paired_server_mean_ms"] == pytest.approx(server_ms, abs=1e-3)
        assert row["outside_share"] == pytest.approx(1 - server_ms / client_ms, abs=1e-3)
        assert sum(row["client"]["counts"]) == row["calls"]
    assert data["spans"] == 2 * sum(expect["calls"].values()) and data["unpaired_spans"] == 0
    assert sum(c["calls"] for c in data["traffic"]["cells"]) == sum(expect["calls"].values())
    # The clocks: each worker's error, relative to the reference, within the bound the calls give.
    clock = data["clock"]
    ref = clock["reference"]
    for w in data["workers"]:
        truth_us = (SKEW_NS[ref] - SKEW_NS[w]) / 1000
        assert abs(clock["offsets_us"][w] - truth_us) <= (clock["bounds_us"][w] or 0) + 1e-3, w
    assert data["files"]["skipped"] == [] and len(data["files"]["span_files"]) == 3
    tl = data["timeline"]
    assert sum(sum(v) for v in tl["calls_per_s"].values()) * tl["bin_s"] == pytest.approx(sum(expect["calls"].values()))


def test_the_slowest_call_comes_first_as_a_waterfall_across_workers(tmp_path: Path) -> None:
    expect = _write_run(tmp_path / "spans")
    data = report.make_report([str(tmp_path / "spans")])
    first = data["slowest"][0]
    assert first["trace_id"] == expect["slowest"][1]
    assert first["duration_ms"] == pytest.approx(expect["slowest"][0] / 1e6, abs=1e-4)  # kept to 100 ns
    assert [(r["kind"], r["depth"]) for r in first["rows"]] == [("client", 0), ("server", 1)]
    client, server = first["rows"]
    assert client["worker"] != server["worker"] and client["slow"]
    # On the reference clock the server lies inside its client.
    assert client["start_ms"] <= server["start_ms"] + 1e-3
    assert server["start_ms"] + server["duration_ms"] <= client["start_ms"] + client["duration_ms"] + 1e-3
    assert len({c["trace_id"] for c in data["slowest"]}) == len(data["slowest"]) == aggregate.SLOWEST


def test_nested_calls_are_indented_under_the_server_that_made_them() -> None:
    stats = aggregate.RunStats()
    attrs = {"rpc.method": "outer", "torch.rpc.dst": "b"}
    inner = {"rpc.method": "inner", "torch.rpc.dst": "c"}
    spans = [Span("t" * 32, "a1", "", "outer", KIND_CLIENT, T0, T0 + 100, "a", attrs),
             Span("t" * 32, "b1", "a1", "outer", KIND_SERVER, T0 + 10, T0 + 90, "b", attrs),
             Span("t" * 32, "b2", "b1", "inner", KIND_CLIENT, T0 + 20, T0 + 80, "b", inner),
             Span("t" * 32, "c1", "b2", "inner", KIND_SERVER, T0 + 30, T0 + 70, "c", inner)]
    stats.add_many(spans)
    stats.finish()
    from rpc_observe.report.summary import waterfall

    call = stats.slowest_calls()[0]
    rows = waterfall(call, spans, {})["rows"]
    assert [(r["worker"], r["method"], r["depth"]) for r in rows] == [
        ("a", "outer", 0), ("b", "outer", 1), ("b", "inner", 2), ("c", "inner", 3)]
    assert stats.methods["inner"].paired == stats.methods["outer"].paired == 1


def test_tables_are_bounded_whatever_the_run() -> None:
    stats = aggregate.RunStats()
    for i in range(3000):
        attrs = {"rpc.method": f"m{i % 100}", "torch.rpc.dst": f"w{(i + 1) % 50}"}
        start = T0 + i * 10**9  # 50 minutes: the bins must widen, not grow
        stats.add(Span(f"{i:032x}", f"{i:016x}", "", "x", KIND_CLIENT, start, start + 10**6, f"w{i % 50}", attrs))
    stats.finish()
    assert len(stats.methods) == aggregate.MAX_METHODS + 1 and aggregate.OTHER in stats.methods
    assert len(stats.workers) == aggregate.MAX_WORKERS + 1
    assert sum(m.calls for m in stats.methods.values()) == 3000
    assert stats.bins is not None
    tl = stats.bins.as_json(sorted(stats.workers))
    assert len(tl["t_s"]) <= series.TIME_BINS and sum(sum(stats.bins.calls[w]) for w in stats.bins.calls) == 3000
    assert stats.unpaired == 3000 and len(stats.slowest_calls()) == aggregate.SLOWEST


def test_time_bins_keep_calls_and_busy_time_when_they_widen() -> None:
    bins = series.TimeBins(T0)
    bins.add("w", T0, T0 + 25_000_000, False)  # 2.5 bins of 10 ms
    assert bins.busy_ns["w"][:3] == [10_000_000, 10_000_000, 5_000_000]
    bins.add("w", T0 + 10**10, T0 + 10**10 + 1, True)  # 10 s on: 240 bins of 10 ms no longer reach
    assert bins.width_ns == 80_000_000 and sum(bins.calls["w"]) == 2 and sum(bins.errors["w"]) == 1
    assert sum(bins.busy_ns["w"]) == 25_000_001


def test_latency_quantiles_stay_within_the_bucket_and_the_max() -> None:
    lat = series.Latency()
    for ns in [30_000] * 90 + [3_000_000] * 10:
        lat.add(ns)
    assert 20_000 <= lat.quantile_ns(0.5) <= 50_000  # type: ignore[operator]
    assert lat.quantile_ns(0.99) == 3_000_000 and lat.max_ns == 3_000_000


def test_foreign_and_cut_files_are_named_and_the_rest_reported(tmp_path: Path) -> None:
    _write_run(tmp_path / "spans")
    _write_run(tmp_path / "old" / "spans", calls=10, run_id="another", seed=4)
    for name in ("w1-101.jsonl", "w2-102.jsonl"):  # one file of another run, outvoted by the three of run r
        (tmp_path / "old" / "spans" / name).unlink()
    cut = tmp_path / "spans" / "w0-100.jsonl"
    lines = cut.read_bytes().count(b"\n")
    cut.write_bytes(cut.read_bytes() + b'{"resourceSpans":[{"resource":{"attr')  # a worker killed mid-write
    data = report.make_report([str(tmp_path)])
    reasons = {str(Path(s["file"]).relative_to(tmp_path)): s["reason"] for s in data["files"]["skipped"]}
    assert reasons.keys() == {"old/spans/w0-100.jsonl", "spans/w0-100.jsonl"}
    assert reasons["old/spans/w0-100.jsonl"].startswith("from another run (run_id 'another'")
    assert reasons["spans/w0-100.jsonl"].startswith(f"partially read: line {lines + 1}: truncated JSON")
    assert data["run_id"] == "r" and data["spans"] == 600


@pytest.mark.parametrize("content", [None, "notes.txt", "spans/x.jsonl"])
def test_an_empty_or_foreign_directory_is_one_line_and_exit_2(tmp_path: Path, capsys, content: str | None) -> None:
    if content:
        (tmp_path / content).parent.mkdir(exist_ok=True)
        (tmp_path / content).write_text('{"hello": 1}\n')
    assert report.main([str(tmp_path), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rpc-observe report: no ") and "accepted:" in err
    assert not (tmp_path / "r.html").exists()


def test_the_page_is_self_contained_and_its_data_parses(tmp_path: Path) -> None:
    _write_run(tmp_path / "spans", methods=("</script><b>x",))
    page = render(report.make_report([str(tmp_path)]))
    assert "http://" not in page.replace("http://www.w3.org", "") and "src=" not in page
    head = '<script type="application/json" id="report-data">'
    data = json.loads(page.split(head, 1)[1].split("</script>", 1)[0])
    assert data["methods"][0]["method"] == "</script><b>x"
    assert len(page) < 200_000


def test_the_vendored_charting_library_is_the_pinned_uplot_with_its_licence() -> None:
    """rpc_observe/report/static/ holds uPlot's dist/uPlot.iife.min.js and uPlot.min.css from the npm
    package uplot@1.6.32 as published (update all three lines and the hashes together)."""
    import hashlib

    from rpc_observe.report.page import STATIC, UPLOT_VERSION

    script = (STATIC / "uPlot.iife.min.js").read_bytes()
    assert script.startswith(f"/*! https://github.com/leeoniya/uPlot (v{UPLOT_VERSION}) */".encode())
    assert hashlib.sha256(script).hexdigest() == UPLOT_JS_SHA256
    assert hashlib.sha256((STATIC / "uPlot.min.css").read_bytes()).hexdigest() == UPLOT_CSS_SHA256
    assert (STATIC / "uPlot.LICENSE").read_text().startswith("The MIT License (MIT)")


def test_flight_recorder_dumps_under_debug_are_read_by_the_doctor(tmp_path: Path) -> None:
    from test_doctor import two_worker_deadlock, write_dumps

    _write_run(tmp_path / "spans")
    assert report.make_report([str(tmp_path)])["doctor"] is None
    write_dumps(tmp_path, two_worker_deadlock())
    found = report.make_report([str(tmp_path)])["doctor"]
    assert found["dumps"] == 3 and found["status"] == 1
    assert found["headline"].startswith("DEADLOCK") and "worker1" in found["text"]


def test_a_run_past_every_limit_gives_a_page_within_the_stated_bound(tmp_path: Path) -> None:
    """60 methods of long names, 50 workers, 10 minutes, and 12 slow traces of 35 nested calls each:
    every table at its limit; the page stays under PAGE_BOUND_BYTES (the bound __init__ states)."""
    exporters = pytest.importorskip("rpc_observe.telemetry.exporters")
    from rpc_observe.telemetry.tracing import SpanRecord

    rng = random.Random(5)
    workers = [f"worker-with-a-long-name-{i}" for i in range(50)]
    records: dict[str, list] = {w: [] for w in workers}

    def rpc(trace: int, parent: int, src: str, dst: str, method: str, start: int, end: int) -> int:
        attrs = {"rpc.method": method, "torch.rpc.src": src, "torch.rpc.dst": dst}
        cid, sid = rng.getrandbits(64), rng.getrandbits(64)
        client = SpanRecord(method, KIND_CLIENT, trace, cid, parent, bool(parent), True, attrs, start)
        client.end_ns = end
        server = SpanRecord(method, KIND_SERVER, trace, sid, cid, True, True, attrs, start + 1000)
        server.end_ns = end - 1000
        records[src].append(client)
        records[dst].append(server)
        return sid

    for k in range(aggregate.SLOWEST):  # first in time: their methods are among the 40 kept
        trace, parent, start = rng.getrandbits(128), 0, T0 + k * 10**9
        for depth in range(35):
            src, dst = workers[depth % 50], workers[(depth + 1) % 50]
            parent = rpc(trace, parent, src, dst, f"nested_call_{k}", start + depth * 10**4,
                         start + 10**11 - depth * 10**4)
    for i in range(6000):
        start = T0 + 10**11 + i * 100_000_000
        src, dst = rng.sample(workers, 2)
        rpc(rng.getrandbits(128), 0, src, dst, f"module.submodule.Class.method_number_{i % 60:02d}", start,
            start + rng.randrange(10**5, 10**8))
    (tmp_path / "spans").mkdir()
    for i, w in enumerate(workers):
        sink = exporters.OtlpJsonFileSink(str(tmp_path / "spans" / f"{w}-{i}.jsonl"), {
            "torch.rpc.worker": w, "process.pid": i, "rpc_observe.run_id": "big"})
        sink.export(records[w])
        sink.shutdown()
    data = report.make_report([str(tmp_path)])
    assert len(data["methods"]) == aggregate.MAX_METHODS + 1 and len(data["workers"]) == aggregate.MAX_WORKERS + 1
    assert len(data["timeline"]["t_s"]) <= series.TIME_BINS
    assert [len(c["rows"]) for c in data["slowest"]] == [60] * aggregate.SLOWEST
    size = len(render(data).encode())
    assert size < report.PAGE_BOUND_BYTES, size


def test_one_slow_method_does_not_hide_the_others_slowest_calls() -> None:
    stats = aggregate.RunStats()
    calls = [("slow", 100 + i) for i in range(50)] + [(f"other{i}", 50) for i in range(5)]
    for n, (method, ms) in enumerate(calls):
        attrs = {"rpc.method": method, "torch.rpc.dst": "b"}
        stats.add(Span(f"{n:032x}", f"{n:016x}", "", method, KIND_CLIENT, T0, T0 + ms * 10**6, "a", attrs))
    picked = [(d // 10**6, int(t, 16)) for d, t, _ in stats.slowest_calls()]
    # Slowest first; "slow" gets its 3 and the room the others leave (its heap holds 6), each
    # other method its slowest call.
    assert picked == [(149 - i, 49 - i) for i in range(6)] + [(50, n) for n in range(54, 49, -1)]


def test_an_output_that_cannot_be_written_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    _write_run(tmp_path / "spans", calls=20)
    assert report.main([str(tmp_path), "-o", str(tmp_path / "no" / "such" / "dir.html")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write" in err and "No such file or directory" in err
    assert report.main([str(tmp_path), "-o", os.devnull, "-q"]) == 0  # a device is written as it is
