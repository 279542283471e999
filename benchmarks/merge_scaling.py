"""How ``rpc-observe merge`` scales with its input: wall time and peak memory.

Writes synthetic span files of a 16-worker run in the exact format of rpc_observe's
file exporter (``OtlpJsonFileSink``: one OTLP/HTTP JSON ``ExportTraceServiceRequest``
a line, many spans a line, a CLIENT span on the caller and a SERVER span on the callee
whose ``parentSpanId`` is the client's), then runs ``rpc-observe merge`` on each size in
a fresh subprocess and reports its wall time and peak RSS (``ru_maxrss`` of that child).

Run by hand (the 1M-span input is about 0.6 GB, and is deleted afterwards)::

    .venv/bin/python benchmarks/merge_scaling.py                        # 10k, 100k, 1M spans
    .venv/bin/python benchmarks/merge_scaling.py --sizes 100000 --profile
    .venv/bin/python benchmarks/merge_scaling.py --sizes 1000000 --rotate 3 --merge-args=--max-spans=100000
    .venv/bin/python benchmarks/merge_scaling.py --sizes 1000000 --compare=-j2 --rounds 3   # side by side
    .venv/bin/python benchmarks/merge_scaling.py --compare=RPC_OBSERVE_MERGE_SPEEDUPS=0 --rounds 3  # without C
    .venv/bin/python benchmarks/merge_scaling.py --servers 2          # a parameter-server job: few call sites
    .venv/bin/python benchmarks/merge_scaling.py --sizes 100000 --instructions   # + valgrind's count (-j1, ~1 min)

This VM's speed drifts by +-25 % within an hour, so a change of a few % is judged by
``--instructions``: the merge's instructions under ``valgrind --tool=callgrind``, repeatable to
about 0.2 % (three runs of the same 100,000-span merge differed by 0.2 %).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKERS = 16
BATCH = 512  # spans a line; the exporter's batches are up to OTEL_BSP_MAX_EXPORT_BATCH_SIZE (2048)
RUN_ID = "bench-run"
T0_NS = 1_790_000_000_000_000_000
METHODS = ["ParameterServer.get_weights", "ParameterServer.update_and_fetch", "evaluate",
           "score_batch", "make_stats", "save_checkpoint", "store_activations", "forward"]
MODES = ["sync", "async", "remote"]


def _value(v: object) -> dict:
    """An OTLP AnyValue, encoded as the exporter encodes it."""
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    return {"stringValue": str(v)}


def _attrs(d: dict) -> str:
    return json.dumps([{"key": k, "value": _value(v)} for k, v in d.items()], separators=(",", ":"))


class SpanWriter:
    """One worker's span files: batches of ``BATCH`` spans a line, ``rotate`` files
    named like a rotated log (``.jsonl`` newest, ``.jsonl.1`` older, ...)."""

    def __init__(self, root: Path, worker: str, pid: int, per_file: int, rotate: int) -> None:
        res = {"service.name": worker, "torch.rpc.worker": worker, "process.pid": pid,
               "rpc_observe.run_id": RUN_ID, "telemetry.sdk.language": "python",
               "telemetry.sdk.name": "opentelemetry", "telemetry.sdk.version": "1.39.1"}
        scope = json.dumps({"name": "rpc_observe", "version": "0.1.0"}, separators=(",", ":"))
        self.head = '{"resourceSpans":[{"resource":{"attributes":%s},"scopeSpans":[{"scope":%s,"spans":[' % (
            _attrs(res), scope)
        self.base = root / f"{worker}-{pid}.jsonl"
        self.per_file, self.rotate = per_file, rotate
        self.part, self.in_file, self.pending = 0, 0, []
        self.file = open(self._part_path(0), "w", encoding="utf-8")

    def _part_path(self, part: int) -> Path:
        return self.base.with_name(f"{self.base.name}.part{part}")

    def add(self, span_json: str) -> None:
        self.pending.append(span_json)
        if len(self.pending) >= BATCH:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        self.file.write(self.head + ",".join(self.pending) + "]}]}]}\n")
        self.in_file += len(self.pending)
        self.pending = []
        if self.in_file >= self.per_file and self.part + 1 < self.rotate:
            self.file.close()
            self.part, self.in_file = self.part + 1, 0
            self.file = open(self._part_path(self.part), "w", encoding="utf-8")

    def close(self) -> None:
        self.flush()
        self.file.close()
        for part in range(self.part + 1):  # part 0 is the oldest: the highest suffix
            age = self.part - part
            self._part_path(part).rename(self.base if age == 0 else self.base.with_name(f"{self.base.name}.{age}"))


def generate(root: Path, n_spans: int, rotate: int = 1, seed: int = 1, servers: int = 0) -> int:
    """Write ``n_spans`` spans (``n_spans // 2`` RPCs) of a 16-worker run; returns bytes written.
    Every worker calls every other (11,520 call sites: a worst case), or, with ``servers``, the
    first ``servers`` workers serve and the others call them (a parameter-server job)."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    names = [f"worker{i}" for i in range(WORKERS)]
    skew_ns = {w: rng.randint(-5_000_000, 5_000_000) for w in names}  # each worker's clock error
    per_file = -(-n_spans // WORKERS // rotate)
    writers = {w: SpanWriter(root, w, 50_000 + i, per_file, rotate) for i, w in enumerate(names)}
    sites: dict[tuple, str] = {}
    t = T0_NS
    for i in range(n_spans // 2):
        if servers:
            dst = names[rng.randrange(servers)]
            src = names[rng.randrange(servers, WORKERS)]
        else:
            src, dst = rng.sample(names, 2)
        method, mode = METHODS[i % len(METHODS)], MODES[i % 7 % len(MODES)]
        key = (method, mode, src, dst)
        site = sites.get(key)
        if site is None:
            name = f"rpc_{mode}#{method}({src} -> {dst})"
            attrs = {"rpc.system": "torch_rpc", "rpc.system.name": "torch_rpc", "rpc.method": method,
                     "torch.rpc.src": src, "torch.rpc.dst": dst, "torch.rpc.exec_mode": mode,
                     "torch.rpc.profiling_key": name, "torch.rpc.internal": False}
            site = sites[key] = ',"name":%s,"kind":%%d,"attributes":%s' % (json.dumps(name), _attrs(attrs))
        t += rng.randint(20_000, 380_000)  # ~5,000 RPCs a second over the whole run
        net1, work, net2 = rng.randint(30_000, 300_000), rng.randint(50_000, 5_000_000), rng.randint(30_000, 300_000)
        trace_id, cid, sid = rng.getrandbits(128), rng.getrandbits(64), rng.getrandbits(64)
        failed = i % 97 == 13
        for worker, kind, sp_id, parent, start, end in (
            (src, 3, cid, 0, t, t + net1 + work + net2),
            (dst, 2, sid, cid, t + net1, t + net1 + work),
        ):
            start, end = start + skew_ns[worker], end + skew_ns[worker]
            parent_json = ',"parentSpanId":"%016x"' % parent if parent else ""
            if failed:
                status = ('"status":{"code":2,"message":"PermissionError: read-only file system"},'
                          '"events":[{"name":"exception","timeUnixNano":"%d","attributes":%s}]' % (
                              end, _attrs({"exception.type": "PermissionError",
                                           "exception.message": "read-only file system"})))
            else:
                status = '"status":{"code":0}'
            writers[worker].add(
                '{"traceId":"%032x","spanId":"%016x"%s,"startTimeUnixNano":"%d","endTimeUnixNano":"%d"%s,%s}' % (
                    trace_id, sp_id, parent_json, start, end, site % kind, status))
    for w in writers.values():
        w.close()
    return sum(f.stat().st_size for f in root.iterdir())


def split_env(extra: list[str]) -> tuple[dict[str, str], list[str]]:
    """A variant's leading NAME=VALUE words (its environment) and its merge arguments."""
    env = dict(os.environ)
    while extra and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", extra[0]):
        name, _, value = extra[0].partition("=")
        env[name], extra = value, extra[1:]
    return env, extra


def run_merge(inputs: Path, output: Path, extra: list[str]) -> tuple[float, float, int, str]:
    """``rpc-observe merge`` in a fresh interpreter: (wall seconds, CPU seconds, peak RSS bytes, stderr)."""
    env, extra = split_env(extra)
    cmd = [sys.executable, "-m", "rpc_observe", "merge", str(inputs), "-o", str(output), *extra]
    with tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
        # wait4: this child's own rusage (RUSAGE_CHILDREN would be the max over every child so far).
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        text = err.read().decode(errors="replace")
    if proc.returncode not in (0, 2):
        raise SystemExit(f"merge failed ({proc.returncode}): {shlex.join(cmd)}\n{text}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024, text  # ru_maxrss: KiB on Linux


def count_instructions(inputs: Path, output: Path, extra: list[str]) -> int:
    """Instructions of one in-process merge (-j1) under ``valgrind --tool=callgrind``."""
    env, extra = split_env(extra)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, "-m", "rpc_observe",
               "merge", str(inputs), "-o", str(output), *extra, "-q", "-j1"]  # -j1 last: helpers go uncounted
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        for line in proc.stderr.splitlines():
            if "Collected :" in line:
                return int(line.split(":")[-1].strip())
    raise SystemExit(f"valgrind gave no count ({proc.returncode}): {shlex.join(cmd)}\n{proc.stderr[-2000:]}")


def profile_merge(inputs: Path, output: Path, extra: list[str], top: int = 25) -> None:
    """cProfile of one merge, in this process; the top functions by own time."""
    from rpc_observe import merge

    prof = cProfile.Profile()
    prof.runcall(merge.main, [str(inputs), "-o", str(output), "-q", *extra])
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10000,100000,1000000", help="span counts, comma-separated")
    ap.add_argument("--rotate", type=int, default=1, help="files per worker (rotated like logrotate)")
    ap.add_argument("--servers", type=int, default=0, metavar="K",
                    help="workers 0..K-1 serve and the others call them, a parameter-server job "
                         "(default: every worker calls every other, 11,520 call sites: a worst case)")
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one, deleted)")
    ap.add_argument("--merge-args", default="", help="extra arguments for rpc-observe merge")
    ap.add_argument("--profile", action="store_true", help="also cProfile the merge of each size")
    ap.add_argument("--compare", action="append", default=[], metavar="ARGS",
                    help="merge each size also with these extra arguments, leading NAME=VALUE words set in its "
                         "environment (repeatable, e.g. --compare=-j2 --compare=RPC_OBSERVE_MERGE_SPEEDUPS=0), "
                         "alternating with the plain merge on the same input")
    ap.add_argument("--rounds", type=int, default=1, help="merges per variant and size, alternating (median shown)")
    ap.add_argument("--instructions", action="store_true",
                    help="also count the instructions of one -j1 merge per size and variant under valgrind's "
                         "callgrind (repeatable where wall time is not; ~50x slower)")
    args = ap.parse_args(argv)
    if not 0 <= args.servers < WORKERS:
        ap.error(f"--servers: 0 (all pairs) to {WORKERS - 1}")
    extra = shlex.split(args.merge_args)
    variants = [args.merge_args] + args.compare
    work = Path(args.dir or tempfile.mkdtemp(prefix="merge_scaling_"))
    rows = []
    try:
        for n in (int(s) for s in args.sizes.split(",")):
            inputs, output = work / f"spans-{n}", work / f"merged-{n}.json"
            size_in = generate(inputs, n, args.rotate, servers=args.servers)
            runs: dict[str, list[tuple[float, float, int]]] = {v: [] for v in variants}
            for _ in range(args.rounds):
                for v in variants:
                    wall, cpu, rss, err = run_merge(inputs, output, [*shlex.split(v), "-q"])
                    runs[v].append((wall, cpu, rss))
                    size_out = output.stat().st_size
                    output.unlink()
                    if err.strip():
                        print(err.strip(), file=sys.stderr)
            for v in variants:
                walls = sorted(r[0] for r in runs[v])
                wall = statistics.median(walls)
                cpu = statistics.median(r[1] for r in runs[v])
                rss = max(r[2] for r in runs[v])
                rows.append((n, v, size_in, size_out, wall, walls, cpu, rss))
            if args.instructions:
                for v in variants:
                    n_instr = count_instructions(inputs, output, shlex.split(v))
                    output.unlink()
                    print(f"{n:,} spans, {v or '(default)'} (-j1): {n_instr:,} instructions, "
                          f"{n_instr / n:,.0f} a span", flush=True)
            if args.profile:
                profile_merge(inputs, output, extra)
                output.unlink()
            shutil.rmtree(inputs)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    layout = f"{args.servers} server(s) called by the others" if args.servers else "all pairs calling"
    print(f"rpc-observe merge, {WORKERS} workers ({layout}), {BATCH} spans a line, {args.rotate} file(s) a worker, "
          f"{args.rounds} round(s) a variant (median; variants alternate on the same input)")
    print("| spans | merge args | input MB | output MB | wall s | runs s | CPU s | spans/s (wall) | spans/s (CPU) "
          "| peak RSS MB | RSS / output |")
    print("|------:|---|---------:|----------:|-------:|---|------:|---------------:|--------------:|------------:"
          "|-------------:|")
    for n, v, size_in, size_out, wall, walls, cpu, rss in rows:
        print(f"| {n:,} | {v or '(default)'} | {size_in / 1e6:,.1f} | {size_out / 1e6:,.1f} | {wall:.2f} "
              f"| {', '.join(f'{w:.2f}' for w in walls)} | {cpu:.2f} | {n / wall:,.0f} | {n / cpu:,.0f} "
              f"| {rss / 1e6:,.0f} | {rss / max(size_out, 1):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
