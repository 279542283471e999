"""Tests for ``rpc-observe merge`` (rpc_observe.merge, its clock estimate in rpc_observe.merge.clock).

Inputs are built in tmp_path: real torch.profiler Chrome traces exported
in-process (then re-homed to fake worker pids, skewed, tagged), and OTLP JSON
span files written in the format rpc_observe's file exporter uses.
"""

from __future__ import annotations

import copy
import gzip
import json
import os
import random
import stat
import threading
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from rpc_observe import merge as M
from rpc_observe.merge import spanfile
from rpc_observe.merge.clock import RpcPair, estimate_offsets
from rpc_observe.merge.files import span_streams
from rpc_observe.merge.rpc import FLOW_CAT, SPAN_CAT

RUN = "run-abc"
SKEW_US = 37_000.0  # worker1's clock runs 37 ms ahead
WORKERS = ["worker0", "worker1", "worker2"]
OS_PIDS = {"worker0": 41000, "worker1": 41001, "worker2": 41002}


# ------------------------------------------------------------- fixtures ---

@pytest.fixture(scope="module")
def raw_trace(tmp_path_factory) -> dict:
    """One real torch.profiler (Kineto) Chrome trace, CPU only."""
    torch = pytest.importorskip("torch")
    from torch.profiler import profile, record_function

    path = tmp_path_factory.mktemp("prof") / "raw.pt.trace.json"
    with profile() as prof:
        with record_function("my_block"):
            a = torch.randn(32, 32, requires_grad=True)
            (a @ a).sum().backward()
    prof.export_chrome_trace(str(path))
    doc = json.loads(path.read_text())
    assert doc["baseTimeNanoseconds"] > 0
    return doc


def trace_abs_start_ns(doc: dict) -> int:
    ts = min(e["ts"] for e in doc["traceEvents"] if e.get("ph") == "X")
    return doc["baseTimeNanoseconds"] + int(ts * 1000)


def worker_trace(raw: dict, worker: str, *, skew_us: float = 0.0, tag: bool = True,
                 rank: int | None = None, run_id: str = RUN, os_pid: int | None = None) -> dict:
    """A copy of the real trace as if recorded by `worker` (its OS pid, its clock)."""
    doc = copy.deepcopy(raw)
    real_pid = next(e["pid"] for e in doc["traceEvents"] if e.get("cat") == "cpu_op")
    pid = os_pid if os_pid is not None else OS_PIDS[worker]
    for e in doc["traceEvents"]:
        if e.get("pid") == real_pid:
            e["pid"] = pid
        if e.get("tid") == real_pid:
            e["tid"] = pid
    doc["baseTimeNanoseconds"] += int(skew_us * 1000)
    if tag:
        doc["rpc_observe"] = {"worker": worker, "pid": pid, "run_id": run_id}
    if rank is not None:
        doc["distributedInfo"] = {"backend": "tensorpipe", "rank": rank, "world_size": 3}
    return doc


def write_json(path: Path, doc, *, gz: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(doc).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def _kv(key, value):
    if isinstance(value, int):
        return {"key": key, "value": {"intValue": str(value) if value % 2 else value}}  # both encodings
    return {"key": key, "value": {"stringValue": value}}


def make_rpcs(t0_ns: int, n: int = 60, seed: int = 5) -> list[dict]:
    """Synthetic RPCs on a true clock: (client span, server span) dicts in OTLP form.

    worker0 talks to everyone (it gets the most pairs); worker2 only ever talks to
    worker0; calls overlap (async) so lanes are needed; one call fails."""
    rng = random.Random(seed)
    routes = [("worker0", "worker1"), ("worker1", "worker0"), ("worker0", "worker2"),
              ("worker2", "worker0"), ("worker0", "worker1")]
    rpcs, t = [], t0_ns + 1_000_000
    for i in range(n):
        src, dst = routes[i % len(routes)]
        t += rng.randint(100_000, 1_500_000)
        net1, net2 = rng.randint(40_000, 400_000), rng.randint(40_000, 400_000)
        work = rng.randint(200_000, 3_000_000)
        trace_id = f"{rng.getrandbits(128):032x}"
        cid, sid = f"{rng.getrandbits(64):016x}", f"{rng.getrandbits(64):016x}"
        method = f"fn{i % 3}"
        attrs = [_kv("rpc.system", "torch_rpc"), _kv("rpc.method", method), _kv("torch.rpc.src", src),
                 _kv("torch.rpc.dst", dst), _kv("torch.rpc.exec_mode", "async" if i % 2 else "sync")]
        err = i == 7
        status = {"code": 2, "message": "RuntimeError: boom"} if err else {"code": 0}
        name = f"rpc_{'async' if i % 2 else 'sync'}#{method}({src} -> {dst})"
        client = {"traceId": trace_id, "spanId": cid, "name": name, "kind": 3,
                  "start": t, "end": t + net1 + work + net2, "attributes": attrs, "status": status,
                  "worker": src}
        server = {"traceId": trace_id, "spanId": sid, "parentSpanId": cid, "name": name, "kind": 2,
                  "start": t + net1, "end": t + net1 + work, "attributes": attrs, "status": status,
                  "worker": dst}
        if err:
            for sp in (client, server):
                sp["events"] = [{"name": "exception", "timeUnixNano": str(sp["end"]),
                                 "attributes": [_kv("exception.type", "RuntimeError"),
                                                _kv("exception.message", "boom")]}]
        rpcs.append((client, server))
    return rpcs


def write_span_file(path: Path, worker: str, spans: list[dict], *, skew_us: float = 0.0,
                    run_id: str = RUN, pid: int | None = None, batch: int = 7) -> Path:
    res = {"attributes": [_kv("service.name", "trainer"), _kv("torch.rpc.worker", worker),
                          _kv("process.pid", pid if pid is not None else OS_PIDS[worker]),
                          _kv("rpc_observe.run_id", run_id)]}
    lines = []
    for i in range(0, len(spans), batch):
        out = []
        for sp in spans[i:i + batch]:
            d = {k: v for k, v in sp.items() if k not in ("start", "end", "worker")}
            d["startTimeUnixNano"] = str(sp["start"] + int(skew_us * 1000))
            d["endTimeUnixNano"] = str(sp["end"] + int(skew_us * 1000))
            out.append(d)
        lines.append(json.dumps({"resourceSpans": [{"resource": res, "scopeSpans": [
            {"scope": {"name": "rpc_observe", "version": "0.1.0"}, "spans": out}]}]},
            separators=(",", ":")))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def build_run(root: Path, raw: dict) -> dict:
    """A 3-worker run dir; worker1 is skewed by SKEW_US in spans and trace alike."""
    t0 = trace_abs_start_ns(raw)
    rpcs = make_rpcs(t0)
    per_worker = defaultdict(list)
    for c, s in rpcs:
        per_worker[c["worker"]].append(c)
        per_worker[s["worker"]].append(s)
    skew = {"worker1": SKEW_US}
    for w in WORKERS:
        write_span_file(root / "spans" / f"{w}-{OS_PIDS[w]}.jsonl", w, per_worker[w], skew_us=skew.get(w, 0.0))
    # worker0: plain json; worker1: gzip + skew + an injected rpc_observe event for one
    # of its server spans; worker2: no rpc_observe key (found by its OS pid).
    write_json(root / "traces" / "worker0.1.pt.trace.json", worker_trace(raw, "worker0", rank=0))
    t1 = worker_trace(raw, "worker1", skew_us=SKEW_US, rank=1)
    srv = next(s for c, s in rpcs if s["worker"] == "worker1")
    t1["traceEvents"].append({  # ts relative to baseTimeNanoseconds, in integer ns first (precision)
        "ph": "X", "cat": "rpc_observe", "name": "rpc_async#x", "pid": OS_PIDS["worker1"], "tid": 7,
        "ts": (srv["start"] + int(SKEW_US * 1000) - t1["baseTimeNanoseconds"]) / 1000,
        "dur": (srv["end"] - srv["start"]) / 1000,
        "args": {"trace_id": srv["traceId"], "span_id": srv["spanId"], "kind": "server"}})
    write_json(root / "traces" / "worker1.1.pt.trace.json.gz", t1, gz=True)
    write_json(root / "traces" / "host_41002.1.pt.trace.json", worker_trace(raw, "worker2", tag=False))
    return {"rpcs": rpcs, "injected_span": srv["spanId"]}


def run_main(capsys, *argv) -> tuple[int, str]:
    rc = M.main([str(a) for a in argv])
    return rc, capsys.readouterr().err


def span_slices(doc: dict) -> dict[str, dict]:
    return {e["args"]["span_id"]: e for e in doc["traceEvents"]
            if e.get("cat") == SPAN_CAT and e.get("ph") == "X" and "kind" in e.get("args", {})}


def process_names(doc: dict) -> dict[int, str]:
    return {e["pid"]: e["args"]["name"] for e in doc["traceEvents"]
            if e.get("ph") == "M" and e.get("name") == "process_name"}


# ---------------------------------------------------------------- tests ---

def test_merge_aligns_workers_and_links_rpcs(tmp_path, raw_trace, capsys):
    run = build_run(tmp_path / "out", raw_trace)
    # a trace nobody claims: no rpc_observe key, unknown pid -> named after the file
    write_json(tmp_path / "out" / "traces" / "stray.1790000000123.pt.trace.json",
               worker_trace(raw_trace, "x", tag=False, os_pid=5))
    out = tmp_path / "merged.json"
    rc, err = run_main(capsys, tmp_path / "out", "-o", out)
    assert rc == 0, err
    text = out.read_text()
    doc = json.loads(text)
    assert len(text.strip()) == len(json.dumps(doc, separators=(",", ":")))  # compact
    # Perfetto: displayTimeUnit first, unknown keys after traceEvents (older versions stop
    # at an unknown key), and no event may carry a top-level array (tokenizer error)
    assert list(doc) == ["displayTimeUnit", "traceEvents", "rpc_observe_merge"]
    assert doc["displayTimeUnit"] == "ms"
    assert doc["rpc_observe_merge"]["events"] == len(doc["traceEvents"]) and doc["rpc_observe_merge"]["cut"] is None
    assert "cut:" not in err
    assert not [e for e in doc["traceEvents"] if any(isinstance(v, list) for v in e.values())]
    summ = doc["rpc_observe_merge"]
    ev = doc["traceEvents"]

    # one named, sorted process track per worker
    names = process_names(doc)
    pid_of = {n: p for p, n in names.items()}
    assert set(WORKERS) | {"stray"} <= set(names.values())
    sort_idx = {e["pid"]: e["args"]["sort_index"] for e in ev if e.get("name") == "process_sort_index"}
    assert sort_idx[pid_of["worker0"]] < sort_idx[pid_of["worker1"]] < sort_idx[pid_of["worker2"]]
    assert all(type(e.get("pid", 0)) is int for e in ev)
    thread_names = {(e["pid"], e["args"]["name"]) for e in ev if e.get("name") == "thread_name"}
    assert (pid_of["worker0"], "RPC client #0") in thread_names
    assert (pid_of["worker1"], "RPC server #0") in thread_names
    assert any(p == pid_of["worker2"] and n.startswith("thread ") for p, n in thread_names)  # Kineto's
    # the untagged trace was mapped to worker2 by its OS pid: its ops live in worker2's process
    assert any(e.get("cat") == "cpu_op" and e["pid"] == pid_of["worker2"] for e in ev)
    assert summ["workers"]["worker2"]["os_pids"] == [OS_PIDS["worker2"]]
    assert summ["workers"]["worker1"]["rank"] == 1

    # clock: worker1's +37 ms skew recovered within the reported (small) bound
    assert summ["reference_worker"] == "worker0"
    off, bnd = summ["offsets_us"], summ["bounds_us"]
    assert off["worker0"] == 0 and bnd["worker0"] == 0
    assert 0 < bnd["worker1"] < 5_000
    assert abs(off["worker1"] + SKEW_US) <= bnd["worker1"] + 1e-3
    assert abs(off["worker2"]) <= bnd["worker2"] + 1e-3 and bnd["worker2"] < 5_000
    assert summ["unaligned"] == ["stray"] and bnd["stray"] is None
    assert "clock offset worker1: -3" in err and "worker1" in err

    # every RPC: a client slice on the caller, a server slice on the callee, server inside client
    slices = span_slices(doc)
    assert len(slices) == 2 * len(run["rpcs"]) == summ["rpc"]["spans"]
    for c, s in run["rpcs"]:
        cs, ss = slices[c["spanId"]], slices[s["spanId"]]
        assert cs["pid"] == pid_of[c["worker"]] and cs["args"]["kind"] == "client"
        assert ss["pid"] == pid_of[s["worker"]] and ss["args"]["kind"] == "server"
        assert cs["ts"] - 0.01 <= ss["ts"] and ss["ts"] + ss["dur"] <= cs["ts"] + cs["dur"] + 0.01
    # lanes never overlap, so X slices nest properly per thread
    by_lane = defaultdict(list)
    for e in slices.values():
        by_lane[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    assert any(len(v) > 1 for v in by_lane.values()) and len(by_lane) > 6  # concurrency -> several lanes
    for v in by_lane.values():
        v.sort()
        assert all(a[1] <= b[0] + 1e-6 for a, b in zip(v, v[1:]))

    # errors stand out
    bad = [e for e in slices.values() if e["args"].get("status") == "ERROR"]
    assert len(bad) == 2 and all(e["cname"] == "terrible" and "boom" in e["args"]["error"] for e in bad)

    # flows: every s has exactly one f with the same (cat, id), and vice versa (Kineto's
    # own fwdbwd flows from 4 traces included: their ids were made unique per trace)
    flows = defaultdict(Counter)
    for e in ev:
        if e.get("ph") in ("s", "f"):
            flows[(e["cat"], e["id"])][e["ph"]] += 1
    assert flows and all(c == Counter({"s": 1, "f": 1}) for c in flows.values())
    assert any(cat == "fwdbwd" for cat, _ in flows)
    rpc_flows = [e for e in ev if e.get("cat") == FLOW_CAT]
    assert len(rpc_flows) == 4 * len(run["rpcs"]) and summ["rpc"]["flows"] == 2 * len(run["rpcs"])
    assert all(e["bp"] == "e" for e in rpc_flows if e["ph"] == "f")
    # ...and bind to the RPC slices: same pid/tid, ts inside the slice (and inside a marker)
    spans_by_thread = defaultdict(list)
    for e in ev:
        if e.get("cat") == SPAN_CAT and e.get("ph") == "X":
            spans_by_thread[(e["pid"], e["tid"])].append(e)
    by_id = defaultdict(dict)
    for f in rpc_flows:
        encl = [x for x in spans_by_thread[(f["pid"], f["tid"])] if x["ts"] <= f["ts"] <= x["ts"] + x["dur"]]
        rpc = [x for x in encl if "kind" in x.get("args", {})]
        assert len(rpc) == 1 and len(encl) == 2, f
        by_id[f["id"]][(f["name"], f["ph"])] = rpc[0]["args"]["kind"]
    for d in by_id.values():
        assert d in ({("rpc request", "s"): "client", ("rpc request", "f"): "server"},
                     {("rpc reply", "s"): "server", ("rpc reply", "f"): "client"})

    # profiler events are on the same corrected clock as the spans:
    # the same op recorded by worker0 and (skewed) worker1 lands at the same time...
    blocks = {e["pid"]: e["ts"] for e in ev if e.get("name") == "my_block" and e.get("ph") == "X"}
    assert abs(blocks[pid_of["worker1"]] - blocks[pid_of["worker0"]]) <= bnd["worker1"] + 0.01
    assert blocks[pid_of["worker2"]] == pytest.approx(blocks[pid_of["worker0"]], abs=bnd["worker2"] + 0.01)
    # ...and the rpc_observe event injected into worker1's trace sits exactly on its span slice
    inj = next(e for e in ev if e.get("cat") == "rpc_observe")
    assert inj["pid"] == pid_of["worker1"]
    assert inj["ts"] == pytest.approx(slices[run["injected_span"]]["ts"], abs=0.01)
    assert min(e["ts"] for e in ev if "ts" in e and e.get("ph") != "M") >= -0.01


def test_short_calls_bind_flows_inside_their_slices(tmp_path, capsys):
    """Server spans of 0.4, 1, 5 and 9 us (no marker, short markers, full markers):
    each flow end lies on its span's lane, inside its slice (and inside a marker
    where there is one); a second server span claiming the same client is drawn
    but not paired, so every flow id still has one start and one end."""
    rpcs = make_rpcs(1_790_000_000_000_000_000, n=8, seed=9)
    for (c, s), work in zip(rpcs, [400, 1000, 5000, 9000, 400, 1000, 5000, 9000]):
        s["end"] = s["start"] + work
        c["end"] = s["end"] + 50_000
    twin = dict(rpcs[0][1], spanId="00000000000000aa")
    per_worker = defaultdict(list)
    for c, s in rpcs:
        per_worker[c["worker"]].append(c)
        per_worker[s["worker"]].append(s)
    per_worker[twin["worker"]].append(twin)
    for w, spans in per_worker.items():
        write_span_file(tmp_path / "spans" / f"{w}-{OS_PIDS[w]}.jsonl", w, spans)
    out = tmp_path / "m.json"
    assert run_main(capsys, tmp_path / "spans", "-o", out)[0] == 0
    doc = json.loads(out.read_text())
    ev = doc["traceEvents"]
    assert doc["rpc_observe_merge"]["rpc"]["pairs"] == len(rpcs)
    slices = span_slices(doc)
    assert "00000000000000aa" in slices
    flows = [e for e in ev if e.get("cat") == FLOW_CAT]
    ids = Counter((e["id"], e["ph"]) for e in flows)
    assert len(ids) == 4 * len(rpcs) and set(ids.values()) == {1}
    markers = [e for e in ev if e.get("cat") == SPAN_CAT and e.get("ph") == "X" and "args" not in e]
    for f in flows:
        inside = [x for x in slices.values() if (x["pid"], x["tid"]) == (f["pid"], f["tid"])
                  and x["ts"] <= f["ts"] <= x["ts"] + x["dur"]]
        assert len(inside) == 1, f
        work = inside[0]["dur"]
        held = [m for m in markers if (m["pid"], m["tid"]) == (f["pid"], f["tid"])
                and m["ts"] <= f["ts"] <= m["ts"] + m["dur"]]
        assert len(held) == (0 if work < 1 else 1), (work, f)
        if 1 <= work < 8:
            assert held[0]["dur"] == pytest.approx(round(work * 1000) // 8 / 1000)


def test_a_device_or_pipe_as_output_is_written_not_replaced(tmp_path, capsys):
    """`-o /dev/null` (here a FIFO, which is no regular file either) is written to as it is: the temporary
    file renamed into place would replace the device (as root, /dev/null itself)."""
    per_worker = defaultdict(list)
    for pair in make_rpcs(1_790_000_000_000_000_000, n=4, seed=3):
        for span in pair:
            per_worker[span["worker"]].append(span)
    for w, spans in per_worker.items():
        write_span_file(tmp_path / "spans" / f"{w}-{OS_PIDS[w]}.jsonl", w, spans)
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    rc = run_main(capsys, tmp_path / "spans", "-o", fifo)[0]
    reader.join(10)
    assert rc == 0 and stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert not list(tmp_path.glob("*.tmp"))
    assert json.loads(received[0])["rpc_observe_merge"]["rpc"]["pairs"] == 4


def test_bad_inputs_are_reported_and_the_rest_merged(tmp_path, raw_trace, capsys):
    root = tmp_path / "out"
    build_run(root, raw_trace)
    bad = root / "bad"
    bad.mkdir()
    good_trace = json.dumps(worker_trace(raw_trace, "worker0"))
    (bad / "truncated.pt.trace.json").write_text(good_trace[: len(good_trace) // 2])
    (bad / "foreign.json").write_text('{"model": "resnet", "epochs": 3}')
    nobase = worker_trace(raw_trace, "worker0")
    del nobase["baseTimeNanoseconds"]
    write_json(bad / "nobase.pt.trace.json", nobase)
    write_span_file(bad / "spans" / "old-run.jsonl", "worker0",
                    [c for c, _ in make_rpcs(trace_abs_start_ns(raw_trace), n=4, seed=9)], run_id="old-run")
    partial = root / "spans" / "worker2-41002.jsonl"
    partial.write_text(partial.read_text() + '{"resourceSpans":[{"resource":{"attr')  # killed mid-write
    (bad / "broken.json.gz").write_bytes(gzip.compress(b'{"traceEvents": []}')[:-6])
    out = tmp_path / "merged.json"
    rc, err = run_main(capsys, root, tmp_path / "missing_dir", "-o", out)

    assert rc == 2
    lines = [ln for ln in err.splitlines() if "skipped" in ln]
    expect = {"truncated.pt.trace.json": "truncated JSON", "foreign.json": "not a torch.profiler trace",
              "nobase.pt.trace.json": "baseTimeNanoseconds", "old-run.jsonl": "another run",
              "worker2-41002.jsonl": "partially read", "broken.json.gz": "gzip",
              "missing_dir": "no such file"}
    for name, reason in expect.items():
        hits = [ln for ln in lines if name in ln]
        assert len(hits) == 1 and reason in hits[0], (name, lines)
    assert len(lines) == len(expect)

    doc = json.loads(out.read_text())
    summ = doc["rpc_observe_merge"]
    assert {Path(s["file"]).name for s in summ["skipped"]} == set(expect)
    assert summ["run_id"] == RUN
    assert set(process_names(doc).values()) == set(WORKERS)
    assert summ["rpc"]["flows"] > 0  # the good files were merged (incl. worker2's good lines)
    assert abs(summ["offsets_us"]["worker1"] + SKEW_US) <= summ["bounds_us"]["worker1"] + 1e-3


def test_nothing_usable_exits_1_without_output(tmp_path, capsys):
    (tmp_path / "a.json").write_text("[1, 2")
    (tmp_path / "b.json").write_text('{"traceEvents": [{"ph": "X", "ts": 1, "dur": 1, "pid": 1, "tid": 1}]}')
    out = tmp_path / "merged.json"
    (tmp_path / "spans").mkdir()
    (tmp_path / "spans" / "w.jsonl").write_text("\n")  # valid but empty: still nothing usable
    rc, err = run_main(capsys, tmp_path, "-o", out)
    assert rc == 1 and not out.exists()
    assert "a.json: truncated JSON" in err and "b.json: profiler trace without baseTimeNanoseconds" in err


def test_default_dir_from_env_ignores_own_side_files(tmp_path, raw_trace, capsys, monkeypatch):
    root = tmp_path / "rpcdir"
    build_run(root, raw_trace)
    (root / "targets").mkdir()
    (root / "targets" / "worker0.json").write_text(
        '[{"targets": ["127.0.0.1:9400"], "labels": {"job": "rpc_observe"}}]')
    (root / "spans" / "worker9-77.jsonl").write_text("")  # a worker that made no RPC
    (root / "debug").mkdir()
    (root / "debug" / "worker1-42.json").write_text('{"schema": "rpc_observe.debug/1", "worker": "worker1"}')
    monkeypatch.setenv("RPC_OBSERVE_DIR", str(root))
    monkeypatch.chdir(tmp_path)
    rc, err = run_main(capsys, "-o", root / "merged.json.gz")
    assert rc == 0 and "flight recorder dump" in err, err
    doc = json.loads(gzip.decompress((root / "merged.json.gz").read_bytes()))
    assert set(process_names(doc).values()) == set(WORKERS)
    # merging again over the same dir ignores the previous output, still exit 0
    rc, err = run_main(capsys, "-o", tmp_path / "again.json")
    assert rc == 0 and "previous merge" in err and "file_sd" in err


def test_spans_only_and_otlp_variants(tmp_path, capsys):
    """No profiler traces at all; OTLP enum names and a whole-document span file."""
    rpcs = make_rpcs(1_790_000_000_000_000_000, n=10)
    doc = {"resourceSpans": [{"resource": {"attributes": [_kv("torch.rpc.worker", "a")]}, "scopeSpans": [
        {"spans": [{**{k: v for k, v in c.items() if k not in ("start", "end", "worker")},
                    "kind": "SPAN_KIND_CLIENT", "startTimeUnixNano": c["start"], "endTimeUnixNano": c["end"]}
                   for c, _ in rpcs]}]}]}
    write_json(tmp_path / "a.json", doc)
    write_span_file(tmp_path / "spans" / "b.jsonl", "b", [s for _, s in rpcs], pid=1, skew_us=-5_000)
    result = M.merge([tmp_path])
    assert result.status == 0 and result.workers == ["a", "b"]
    assert abs(result.trace["rpc_observe_merge"]["offsets_us"]["b"] - 5_000) <= result.clock.bounds_us["b"]
    assert result.trace["rpc_observe_merge"]["rpc"]["pairs"] == 10


def test_clock_estimate_offsets():
    def pair(c, s, cs, ce, ss, se):
        return RpcPair(c, s, cs, ce, ss, se)

    # true offsets (correction added to local clocks): a 0, b -100, c -100 + 50 = -50
    pairs = [
        pair("a", "b", 0, 40, 110, 130),     # b's clock is 100 ahead
        pair("b", "a", 200, 260, 115, 150),
        pair("b", "c", 300, 340, 260, 270),  # c is 50 behind b
        pair("a", "a", 0, 1, 5, 6),          # self call: no information
    ]
    est = estimate_offsets(pairs, ["a", "b", "c", "d"])
    assert est.reference in ("a", "b")  # most pairs
    ref_off = est.offsets_us[est.reference]
    rel = {w: est.offsets_us[w] - ref_off for w in "abc"}
    assert est.offsets_us[est.reference] == 0 and est.bounds_us[est.reference] == 0
    assert abs((rel["b"] - rel["a"]) - -100) <= est.bounds_us["a"] + est.bounds_us["b"]
    assert abs((rel["c"] - rel["a"]) - -50) <= est.bounds_us["a"] + est.bounds_us["c"]
    e = est.edges[("a", "b")]
    # a->b: d in [0-110, 40-130] = [-110, -90]; b->a: -d in [85, 110] -> d in [-110, -85]
    assert (e.lo, e.hi, e.pairs) == (-110, -90, 2) and e.half_width == 10
    assert est.bounds_us["d"] is None and est.unaligned == ["d"] and est.offsets_us["d"] == 0
    assert not est.inconsistent_edges
    # a server slice longer than its client slice cannot fit: flagged
    est2 = estimate_offsets([pair("x", "y", 0, 10, 0, 30)])
    assert est2.inconsistent_edges == [("x", "y")]


def test_hta_loads_traces(tmp_path, raw_trace):
    """HolisticTraceAnalysis reads a directory of rpc_observe-written traces.

    What HTA (0.5.0) needs, found here: ``*.json`` / ``*.gz`` files directly in
    the directory (not recursive, nothing else with those suffixes in it), each
    with ``"distributedInfo": {"rank": N}`` written with a space after the colon
    (HTA finds the rank with the regex ``"rank":\\s+(\\d+)``: compact JSON makes
    every file rank 0), and the real Kineto content (``baseTimeNanoseconds``...).
    """
    try:
        from hta.trace_analysis import TraceAnalysis
    except Exception as e:  # ImportError, or its undeclared deps (psutil) missing
        pytest.skip(f"HolisticTraceAnalysis not importable here ({type(e).__name__}: {e}); "
                    "pip install holistictraceanalysis psutil to run this check")
    d = tmp_path / "traces"
    for rank, w in enumerate(WORKERS):
        doc = worker_trace(raw_trace, w, rank=rank)
        # key order as the lead's writer should produce: metadata before traceEvents
        ordered = {"distributedInfo": doc.pop("distributedInfo"), **doc}
        (d / f"{w}.1.pt.trace.json").parent.mkdir(exist_ok=True)
        (d / f"{w}.1.pt.trace.json").write_text(json.dumps(ordered))  # default separators
    analysis = TraceAnalysis(trace_dir=str(d))
    assert analysis.t.get_ranks() == [0, 1, 2]
    for rank in range(3):
        assert len(analysis.t.get_trace(rank)) > 0
        assert analysis.t.meta_data[rank]["distributedInfo"]["rank"] == rank
    # and the same files merge
    result = M.merge([d])
    assert result.status == 0 and result.workers == WORKERS


# ------------------------------------------- span streams and limits ---

def local_spans(run: dict, skew: dict[str, int] | None = None) -> dict[str, tuple[int, int]]:
    """span id -> (start, end) on its worker's own clock (worker1 is skewed), as in the span files."""
    skew = {"worker1": int(SKEW_US * 1000)} if skew is None else skew
    return {sp["spanId"]: (sp["start"] + skew.get(sp["worker"], 0), sp["end"] + skew.get(sp["worker"], 0))
            for pair in run["rpcs"] for sp in pair}


def rotate(path: Path, parts: int, gz_oldest: bool = False) -> list[Path]:
    """Split a span file as logrotate would have: ``path.N`` (oldest) ... ``path.1``, ``path`` (newest)."""
    lines = path.read_text().splitlines(keepends=True)
    size = -(-len(lines) // parts)
    chunks = [lines[i:i + size] for i in range(0, len(lines), size)]
    out = []
    for age, chunk in zip(range(len(chunks) - 1, -1, -1), chunks):
        p = path if age == 0 else path.with_name(f"{path.name}.{age}")
        data = "".join(chunk).encode()
        if gz_oldest and age and age == len(chunks) - 1:
            p, data = p.with_name(p.name + ".gz"), gzip.compress(data)
        p.write_bytes(data)
        out.append(p)
    return out


def test_span_streams_group_rotated_files_oldest_first():
    names = ["s/w-1.jsonl", "s/w-1.jsonl.10", "s/w-1.jsonl.2", "s/w-1.jsonl.1.gz", "s/x-2.jsonl.gz", "t/w-1.jsonl"]
    streams = [[p.as_posix() for p in s] for s in span_streams(map(Path, names))]
    assert streams == [["s/w-1.jsonl.10", "s/w-1.jsonl.2", "s/w-1.jsonl.1.gz", "s/w-1.jsonl"],
                       ["s/x-2.jsonl.gz"], ["t/w-1.jsonl"]]


def test_rotated_span_files_are_read_as_one_stream(tmp_path, raw_trace, capsys):
    """A worker's spans split over rotated files merge exactly as from one file."""
    build_run(tmp_path / "whole", raw_trace)
    build_run(tmp_path / "rotated", raw_trace)
    spans = tmp_path / "rotated" / "spans"
    w0 = rotate(spans / "worker0-41000.jsonl", 3, gz_oldest=True)
    rotate(spans / "worker1-41001.jsonl", 2)
    # worker2's current file is gone (rotated away, then the worker exited): its .2 and .1 remain
    older, current = rotate(spans / "worker2-41002.jsonl", 2)
    older.rename(spans / "worker2-41002.jsonl.2")
    current.rename(spans / "worker2-41002.jsonl.1")
    rc_whole, _ = run_main(capsys, tmp_path / "whole", "-o", tmp_path / "whole.json")
    rc, err = run_main(capsys, tmp_path / "rotated", "-o", tmp_path / "rotated.json")
    assert rc_whole == rc == 0, err
    whole, rotated = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("whole", "rotated"))
    for key in ("rpc", "offsets_us", "bounds_us", "workers"):
        assert rotated["rpc_observe_merge"][key] == whole["rpc_observe_merge"][key], key
    assert span_slices(rotated) == span_slices(whole)
    listed = [Path(f).name for f in rotated["rpc_observe_merge"]["inputs"]["span_files"]]
    assert listed[:3] == [p.name for p in w0] == ["worker0-41000.jsonl.2.gz", "worker0-41000.jsonl.1",
                                                 "worker0-41000.jsonl"]
    assert "worker2-41002.jsonl.2" in listed and "worker2-41002.jsonl.1" in listed

    # an older file cut short is named in the report; the rest of the stream is read
    older = spans / "worker1-41001.jsonl.1"
    older.write_text(older.read_text() + '{"resourceSpans":[{"resou')
    rc, err = run_main(capsys, tmp_path / "rotated", "-o", tmp_path / "again.json")
    assert rc == 2
    assert "partially read: worker1-41001.jsonl.1 line" in err and "truncated JSON" in err
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["rpc_observe_merge"]["rpc"] == whole["rpc_observe_merge"]["rpc"]


def test_exporter_layout_read_by_text_as_by_json(tmp_path, monkeypatch, capsys):
    """Span files written by rpc_observe's own exporter (read by text) merge as the same
    spans written in another key order (read by json)."""
    exporters = pytest.importorskip("rpc_observe.telemetry.exporters")
    from rpc_observe.telemetry.tracing import SpanRecord

    rpcs = make_rpcs(1_790_000_000_000_000_000, n=40)
    per_worker = defaultdict(list)
    for c, s in rpcs:
        per_worker[c["worker"]].append(c)
        per_worker[s["worker"]].append(s)
    sites: dict[str, dict] = {}  # the exporter encodes a call site's attributes once: shared dicts
    for w, spans in per_worker.items():
        write_span_file(tmp_path / "json" / f"{w}-{OS_PIDS[w]}.jsonl", w, spans)
        (tmp_path / "text").mkdir(exist_ok=True)
        sink = exporters.OtlpJsonFileSink(str(tmp_path / "text" / f"{w}-{OS_PIDS[w]}.jsonl"), {
            "service.name": "trainer", "torch.rpc.worker": w, "process.pid": OS_PIDS[w], "rpc_observe.run_id": RUN})
        records = []
        for sp in spans:
            attrs = sites.setdefault(sp["name"], {kv["key"]: kv["value"]["stringValue"] for kv in sp["attributes"]})
            rec = SpanRecord(sp["name"], sp["kind"], int(sp["traceId"], 16), int(sp["spanId"], 16),
                             int(sp.get("parentSpanId", "0"), 16), True, True, attrs, sp["start"])
            rec.end_ns = sp["end"]
            if sp["status"]["code"] == 2:
                rec.error_type, rec.error_message = "RuntimeError", "boom"
            records.append(rec)
        sink.export(records[:25])
        sink.export(records[25:])
        sink.shutdown()
    decoded = []
    real = spanfile.parse_span
    monkeypatch.setattr(spanfile, "parse_span", lambda *a: decoded.append(a[0]) or real(*a))
    by_json = M.merge([tmp_path / "json"])
    n_json = len(decoded)
    decoded.clear()
    by_text = M.merge([tmp_path / "text"])
    assert by_json.status == by_text.status == 0
    assert n_json == 2 * len(rpcs) and len(decoded) == 2  # by text, but the failed call's two spans
    a, b = span_slices(by_json.trace), span_slices(by_text.trace)
    assert a.keys() == b.keys() and len(a) == 2 * len(rpcs)
    for sid, ev in a.items():
        if ev["args"].get("status") == "ERROR":  # the exporter adds error.type and its own message
            assert b[sid]["args"]["status"] == "ERROR" and b[sid]["cname"] == "terrible"
        else:
            assert b[sid] == ev
    for key in ("rpc", "offsets_us", "bounds_us"):
        assert by_text.trace["rpc_observe_merge"][key] == by_json.trace["rpc_observe_merge"][key]


def test_max_spans_keeps_the_newest_and_says_so(tmp_path, raw_trace, capsys):
    run = build_run(tmp_path / "out", raw_trace)
    times = local_spans(run)
    out = tmp_path / "merged.json"
    rc, err = run_main(capsys, tmp_path / "out", "-o", out, "--max-spans", "50", "-q")
    assert rc == 0, err
    cut = [ln for ln in err.splitlines() if "cut:" in ln]
    assert cut == [f"rpc-observe merge: cut: left out {len(times) - 50} older span(s) beyond --max-spans 50; "
                   "kept 50 span(s)"]
    doc = json.loads(out.read_text())
    summ = doc["rpc_observe_merge"]
    assert summ["cut"]["spans_over_max"] == len(times) - 50 and summ["cut"]["max_spans"] == 50
    assert summ["rpc"]["spans"] == summ["cut"]["spans_kept"] == 50
    newest = sorted(times, key=lambda sid: times[sid][0])[-50:]  # the latest starts, each on its own clock
    assert set(span_slices(doc)) == set(newest)
    assert any(e.get("cat") == "cpu_op" for e in doc["traceEvents"])  # profiler events are not spans: all kept


def test_since_until_window_cuts_spans_and_profiler_events(tmp_path, raw_trace, capsys):
    # The RPCs come after the profiled block; worker1's clock is so far ahead that on it
    # the profiled block falls inside the window, which starts 20 ms into the RPCs.
    xs = [e for e in raw_trace["traceEvents"] if e.get("ph") == "X"]
    t_start = trace_abs_start_ns(raw_trace)
    t_end = raw_trace["baseTimeNanoseconds"] + int(1000 * max(e["ts"] + e.get("dur", 0) for e in xs))
    lo, hi = t_end + 20_000_000, t_end + 40_000_000
    skew_us = (t_end - t_start + 25_000_000) / 1000
    rpcs = make_rpcs(t_end + 1_000_000)
    per_worker = defaultdict(list)
    for c, s in rpcs:
        per_worker[c["worker"]].append(c)
        per_worker[s["worker"]].append(s)
    root = tmp_path / "out"
    for w in WORKERS:
        write_span_file(root / "spans" / f"{w}-{OS_PIDS[w]}.jsonl", w, per_worker[w],
                        skew_us=skew_us if w == "worker1" else 0.0)
        write_json(root / "traces" / f"{w}.json",
                   worker_trace(raw_trace, w, skew_us=skew_us if w == "worker1" else 0.0, rank=WORKERS.index(w)))
    times = local_spans({"rpcs": rpcs}, {"worker1": int(skew_us * 1000)})
    out = tmp_path / "merged.json"
    rc, err = run_main(capsys, root, "-o", out, "--since", f"@{lo / 1e9!r}", "--until", f"@{hi / 1e9!r}")
    assert rc == 0, err
    doc = json.loads(out.read_text())
    summ, ev = doc["rpc_observe_merge"], doc["traceEvents"]
    cut = summ["cut"]
    assert abs(cut["since_unix_ns"] - lo) < 1000 and abs(cut["until_unix_ns"] - hi) < 1000
    expected = {sid for sid, (s, e) in times.items() if e >= cut["since_unix_ns"] and s <= cut["until_unix_ns"]}
    assert 0 < len(expected) < len(times)
    assert set(span_slices(doc)) == expected
    assert cut["spans_outside_window"] == len(times) - len(expected) and cut["spans_kept"] == len(expected)
    assert cut["profiler_events_outside_window"] > 0
    lines = [ln for ln in err.splitlines() if "cut:" in ln]
    assert len(lines) == 1 and f"{len(times) - len(expected)} span(s) and " in lines[0]
    assert "outside --since/--until" in lines[0]
    pid_of = {n: p for p, n in process_names(doc).items()}
    ops = Counter(e["pid"] for e in ev if e.get("cat") == "cpu_op")
    assert ops[pid_of["worker1"]] > 0 and not ops[pid_of["worker0"]] and not ops[pid_of["worker2"]]
    flows = defaultdict(Counter)  # a Kineto flow with an end outside is left out whole
    for e in ev:
        if e.get("ph") in ("s", "f"):
            flows[(e["cat"], e["id"])][e["ph"]] += 1
    assert all(c == Counter({"s": 1, "f": 1}) for c in flows.values())

    # relative to the run's first event by default; nothing that ended before the start is kept
    rc, err = run_main(capsys, root, "-o", out, "--since", "0.03")
    doc = json.loads(out.read_text())
    cut = doc["rpc_observe_merge"]["cut"]
    assert cut["since"] == "0.03s" and cut["until_unix_ns"] is None
    assert cut["run_start_unix_ns"] <= t_start and cut["since_unix_ns"] == cut["run_start_unix_ns"] + 30_000_000
    assert set(span_slices(doc)) == {sid for sid, (_, e) in times.items() if e >= cut["since_unix_ns"]}


def test_bad_limits_are_refused(capsys):
    for args in (["--max-spans", "0"], ["--since", "soon"], ["--until", "@nan"]):
        with pytest.raises(SystemExit) as exc:
            M.main(args)
        assert exc.value.code == 2
    assert "--max-spans" in capsys.readouterr().err


@pytest.mark.parametrize("limit", [[], ["--max-spans", "50"], ["--since", "0.02", "--until", "0.05"]],
                         ids=["all", "max-spans", "window"])
def test_span_files_read_in_processes_merge_as_read_here(tmp_path, raw_trace, capsys, monkeypatch, limit):
    """A large run's span files are read by a helper process (a real spawned one here: the size
    threshold is lowered) and by this one meanwhile, from the back (made to happen here by
    a helper that never looks done); the output is byte for byte the one read here alone."""
    from rpc_observe.merge import parallel

    build_run(tmp_path / "out", raw_trace)
    rotate(tmp_path / "out" / "spans" / f"worker0-{OS_PIDS['worker0']}.jsonl", 3)  # one stream of three files
    here, there = tmp_path / "here.json", tmp_path / "there.json"
    assert run_main(capsys, tmp_path / "out", "-o", here, "-j", "1", *limit)[0] == 0
    monkeypatch.setattr(parallel, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(parallel, "_busy", lambda job: True)
    read_here = []
    real_read_here = parallel._read_here
    monkeypatch.setattr(parallel, "_read_here", lambda si, *a: read_here.append(si.path.name) or real_read_here(si, *a))
    rc, err = run_main(capsys, tmp_path / "out", "-o", there, "-j", "2", *limit)
    assert rc == 0, err
    # streams in name order: worker0 (rotated), worker1 and worker2; the helper took the first two
    assert read_here == [f"worker2-{OS_PIDS['worker2']}.jsonl"]
    assert there.read_bytes() == here.read_bytes()


def test_a_pool_that_cannot_start_reads_in_this_process(tmp_path, raw_trace, capsys, monkeypatch):
    from rpc_observe.merge import parallel

    def no_processes(*a, **k):
        raise OSError(11, "Resource temporarily unavailable")

    build_run(tmp_path / "out", raw_trace)
    here, there = tmp_path / "here.json", tmp_path / "there.json"
    assert run_main(capsys, tmp_path / "out", "-o", here, "-j", "1")[0] == 0
    monkeypatch.setattr(parallel, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr("concurrent.futures.ProcessPoolExecutor", no_processes)  # imported when used
    assert run_main(capsys, tmp_path / "out", "-o", there, "-j", "2")[0] == 0
    assert there.read_bytes() == here.read_bytes()
