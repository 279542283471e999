"""The merge's C loops (rpc_observe/merge/_speedups.c) against the Python code they
stand in for, which stays the fallback: the same spans read from the same pieces
(valid ones and thousands of mutations), the same text encoded from the same spans,
and whole merges byte for byte, with the C loops and without."""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rpc_observe import merge as M
from rpc_observe.merge import encode, speedups
from rpc_observe.merge.model import KIND_CLIENT, KIND_SERVER, Span
from rpc_observe.merge.otlp import Resource
from rpc_observe.merge.spanfile import _NO_SITE, _SEP, SpanReader

C = speedups.C
needs_c = pytest.mark.skipif(C is None, reason="the C loops are not built here")

SITE = ('"name":"rpc_sync#step(w0 -> w1)","kind":3,"attributes":[{"key":"rpc.method","value":{"stringValue":'
        '"step"}},{"key":"torch.rpc.src","value":{"stringValue":"w0"}},{"key":"torch.rpc.dst","value":'
        '{"stringValue":"w1"}}],"status":{"code":0}')
VALID = [
    '%032x","spanId":"%016x","startTimeUnixNano":"1790000000000000123","endTimeUnixNano":"1790000000000900000",'
    % (0xABC << 100, 0x1234) + SITE,
    '%032x","spanId":"%016x","parentSpanId":"%016x","startTimeUnixNano":"1790000000000000500",'
    '"endTimeUnixNano":"1790000000000000400",' % (7, 0xFEED, 0xBEEF) + SITE,  # ends before it starts
]


def test_the_c_loops_are_built_where_a_compiler_is():
    if os.environ.get(speedups.ENV, "").strip() == "0":
        pytest.skip(f"{speedups.ENV}=0")
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler here: the merge runs in pure Python")
    assert C is not None, "rpc_observe/merge/_speedups.c is not built: reinstall (pip install -e .)"


@needs_c
def test_a_span_type_without_the_slots_is_refused():
    class NotSpan:
        def __init__(self) -> None:
            self.trace_id = ""

    fields = tuple(f.name for f in dataclasses.fields(Span))
    with pytest.raises(TypeError, match="not a slot"):
        C.configure_span(NotSpan, fields, NotSpan())
    reader = SpanReader(lambda spans: None, "run")  # and the spans are still made as before
    expected = reader._piece_span(VALID[1], Resource("w0", 1, "run"), Path("w0-1.jsonl"), "fb")
    assert C.line_spans(VALID[1], 0, len(VALID[1]), reader._sites, _NO_SITE, "w0", "fb") == ([expected], [])


@pytest.mark.parametrize("value, pure, says", [("0", True, False), ("1", False, False), ("", False, False),
                                               ("off", False, True)])
def test_the_switch_takes_0_or_1_and_the_command_names_anything_else(tmp_path, value, pure, says):
    env = {**os.environ, speedups.ENV: value}
    probe = "from rpc_observe.merge import speedups; print(speedups.C is None)"
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=env)
    assert run.stdout.strip() == str(pure or C is None) and run.stderr == ""  # importing says nothing
    run = subprocess.run([sys.executable, "-m", "rpc_observe", "merge", str(tmp_path), "-o", str(tmp_path / "o.json")],
                         capture_output=True, text=True, env=env)
    said = [line for line in run.stderr.splitlines() if speedups.ENV in line]
    assert said == ([f"rpc-observe merge: {speedups.ENV}='off' is not 0 (pure Python) or 1 (the C loops, "
                     "where built); using 1"] if says else [])


def _mutations(piece: str, rng: random.Random, n: int) -> list[str]:
    """``piece`` with one character replaced, inserted or deleted, ``n`` times over."""
    chars = '0789afAFg",:{}[]-+. x'
    out = []
    for _ in range(n):
        i = rng.randrange(len(piece))
        c = rng.choice(chars)
        op = rng.randrange(3)
        out.append(piece[:i] + c + piece[i + 1:] if op == 0 else piece[:i] + c + piece[i:] if op == 1
                   else piece[:i] + piece[i + 1:])
    return out


@needs_c
@pytest.mark.parametrize("res", [Resource("w0", 11, "run"), Resource(None, 11, "run")], ids=["worker", "route"])
def test_a_piece_is_read_as_the_python_code_reads_it(res):
    reader = SpanReader(lambda spans: None, "run")
    path = Path("w0-11.jsonl")
    rng = random.Random(3)
    pieces = VALID + [m for p in VALID for m in _mutations(p, rng, 3000)]
    pieces += [VALID[0].replace("1790000000000000123", "9" * 19), VALID[0].replace("1790000000000000123", "0"),
               VALID[0].replace("1790000000000000123", "12345678901234567890"), ""]
    read_by_c = 0
    for p in pieces:
        expected = reader._piece_span(p, res, path, "fallback")  # first: it learns the call sites it meets
        spans, left = C.line_spans(p, 0, len(p), reader._sites, _NO_SITE, res.worker, "fallback")
        assert len(spans) == 1
        if left:  # left to Python: the piece as it is
            assert left == [0] and spans[0] == p
        else:
            assert spans[0] == expected, p
            read_by_c += 1
    assert read_by_c > 100
    line = _SEP.join(pieces[:200])  # a line of them: each in place
    spans, left = C.line_spans("head" + line + "tail", 4, 4 + len(line), reader._sites, _NO_SITE, res.worker, "fb")
    expected = [reader._piece_span(p, res, path, "fb") for p in pieces[:200]]
    for i in left:
        spans[i] = reader._piece_span(spans[i], res, path, "fb")
    assert spans == expected
    assert C.line_spans("é" + line, 1, 1 + len(line), reader._sites, _NO_SITE, None, "fb") is None  # not ASCII


def _group(rng: random.Random, n: int, zero: int, base_tid: int, ordinary: bool) -> list[Span]:
    sites = [{"rpc.method": f"m{i}", "torch.rpc.internal": bool(i % 2)} for i in range(3)]
    durations = [0, 1, 499, 500, 999, 1000, 1001, 7999, 8000, 8001, 123_456, 5_000_000]
    group = []
    for i in range(n):
        start = zero + rng.randrange(0 if ordinary else -3000, 10_000_000)
        kind = rng.choice([KIND_CLIENT, KIND_SERVER])
        status = 0 if ordinary else rng.choice([0, 0, 1, 2])
        group.append(Span(f"{rng.getrandbits(128):032x}", f"{rng.getrandbits(64):016x}",
                          rng.choice(["", f"{rng.getrandbits(64):016x}"]), f"rpc_sync#m{i % 3}", kind, start,
                          start + rng.choice(durations), "w0", sites[i % 3], status,
                          "boom" if status == 2 else "", (), base_tid + rng.randrange(4),
                          rng.choice([-1, i, 2 * i])))
    return group


@needs_c
@pytest.mark.parametrize("ordinary", [True, False], ids=["ordinary", "errors-and-early-times"])
def test_a_group_is_encoded_as_the_python_code_encodes_it(ordinary):
    rng = random.Random(5)
    zero, base_tid, pid = 1_790_000_000_000_000_000, 1_000_000_000, 100
    texts = ['"pid":%d,"tid":%d' % (pid, base_tid + k) for k in range(4)]
    group = _group(rng, 3000, zero, base_tid, ordinary)
    by_python = list(encode._slices(group, zero, pid, texts, base_tid, 7))
    by_c = list(encode._fast_slices(group, zero, pid, texts, base_tid, 7))
    assert ",".join(t for t, _ in by_c) == ",".join(t for t, _ in by_python)
    assert sum(n for _, n in by_c) == sum(n for _, n in by_python) > 3000
    if ordinary:  # the C loop encodes them all itself, in one call
        _, _, stop, left = C.encode_spans(group, 0, len(group), zero, texts, base_tid, 7, {}, encode._slice_parts)
        assert (stop, left) == (len(group), False)


def _exporter_run(root: Path) -> None:
    """A 3-worker run written by rpc_observe's own span exporter: several call sites, failed
    calls, calls shorter than their markers, and one site named outside ASCII."""
    exporters = pytest.importorskip("rpc_observe.telemetry.exporters")
    from rpc_observe.telemetry.tracing import SpanRecord

    rng = random.Random(9)
    workers = ["w0", "w1", "w2"]
    records: dict[str, list] = {w: [] for w in workers}
    root.mkdir()
    t = 1_790_000_000_000_000_000
    for i in range(1500):
        src, dst = rng.sample(workers, 2)
        method = ["step", "get", "put", "évaluer"][i % 4] if i < 1400 else "step"
        name = f"rpc_async#{method}({src} -> {dst})"
        attrs = {"rpc.system": "torch_rpc", "rpc.method": method, "torch.rpc.src": src, "torch.rpc.dst": dst}
        t += rng.randrange(10_000, 400_000)
        work = rng.choice([300, 2_000, 50_000, 3_000_000])
        trace, cid, sid = rng.getrandbits(128), rng.getrandbits(64), rng.getrandbits(64)
        client = SpanRecord(name, KIND_CLIENT, trace, cid, 0, True, True, attrs, t)
        client.end_ns = t + work + 40_000
        server = SpanRecord(name, KIND_SERVER, trace, sid, cid, True, True, attrs, t + 20_000)
        server.end_ns = t + 20_000 + work
        if i % 53 == 7:
            for rec in (client, server):
                rec.error_type, rec.error_message = "RuntimeError", "boom"
        records[src].append(client)
        records[dst].append(server)
    for i, w in enumerate(workers):
        sink = exporters.OtlpJsonFileSink(str(root / f"{w}-{100 + i}.jsonl"), {
            "service.name": "trainer", "torch.rpc.worker": w, "process.pid": 100 + i, "rpc_observe.run_id": "r"})
        for k in range(0, len(records[w]), 200):
            sink.export(records[w][k:k + 200])
        sink.shutdown()


@needs_c
@pytest.mark.parametrize("limits", [[], ["--max-spans", "700"], ["--since", "0.1", "--until", "0.3"]],
                         ids=["all", "max-spans", "window"])
def test_a_merge_with_the_c_loops_is_the_merge_without(tmp_path, monkeypatch, capsys, limits):
    _exporter_run(tmp_path / "spans")
    with_c, without = tmp_path / "c.json", tmp_path / "py.json"
    assert M.main([str(tmp_path / "spans"), "-o", str(with_c), "-q", "-j1", *limits]) == 0
    monkeypatch.setattr(speedups, "C", None)
    assert M.main([str(tmp_path / "spans"), "-o", str(without), "-q", "-j1", *limits]) == 0
    assert with_c.read_bytes() == without.read_bytes()
    assert b'"status":"ERROR"' in without.read_bytes() and b"\\u00e9valuer" in without.read_bytes()
