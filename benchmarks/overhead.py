"""Overhead of rpc_observe on torch.distributed.rpc (issue 6).

    python benchmarks/overhead.py            # full run (~10-15 min): latency rounds, serialization,
                                             # start-up and memory
    python benchmarks/overhead.py --quick    # < 2 min: fewer rounds and calls, no memory section
    python benchmarks/overhead.py --memory   # only the memory section
    python benchmarks/overhead.py --profile  # where (c)/(d) spend time: /proc counters, in-situ self times,
                                             # perf and py-spy where found, cProfile

Configurations, each a pair of worker processes (worker0 calls, worker1 serves) on
127.0.0.1 TensorPipe, all started once and kept alive, driven from here over stdin /
a JSON answer pipe, measured one pair at a time and interleaved round by round:

  a  torch RPC, rpc_observe not imported: `python -S`, site-packages appended by hand
  b  rpc_observe installed, RPC_OBSERVE unset (nothing patched)
  c  metrics only: RPC_OBSERVE=1 OTEL_TRACES_EXPORTER=none RPC_OBSERVE_PROFILER_EVENTS=0
  d  metrics + spans (100% sampled, file exporter) + profiler events: RPC_OBSERVE=1
  e  (d) with a torch.profiler session (CPU) active on the caller around each measurement
  ap (reference, --profiler-baseline) (a) with the same torch.profiler session as (e)

Ratios to (a) are computed per round (same round) and then the median is taken.
Results go to benchmarks/results/overhead-<date>[-quick|-memory|-profile].json.

This file is the command line and the driver; the parts are in benchmarks/bench/ (pairs:
configurations and worker processes, sections: what is measured, stats, report: tables and
the result file, profiling: --profile). The worker process is benchmarks/_worker.py.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from bench import profiling, report, sections
from bench.pairs import ENVS, LABELS, Pair, configs_for, start_pairs
from bench.report import show


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="< 2 minutes: fewer rounds and calls, no memory section")
    ap.add_argument("--memory", action="store_true", help="only the memory section (pairs a and d)")
    ap.add_argument("--profile", action="store_true",
                    help="only profile configs (c) and (d) against (a): /proc counters, in-situ self times, perf "
                         "and py-spy if found, cProfile")
    ap.add_argument("--py-spy", default=shutil.which("py-spy"), metavar="PATH",
                    help="py-spy for --profile (default: the py-spy on PATH, here: %(default)s); the py-spy view "
                         "is skipped, with a message, when there is none")
    ap.add_argument("--profile-seconds", type=float, default=15.0)
    ap.add_argument("--profiler-baseline", action="store_true",
                    help="also run (ap): (a) with the same torch.profiler session as (e), to separate the "
                         "profiler's own cost from the add-on's")
    ap.add_argument("--fixed-order", action="store_true",
                    help="measure the configs in the same order every round (default: the order rotates by one "
                         "each round, so no config is always first)")
    ap.add_argument("--no-control", action="store_true", help="leave out (a2), the second (a) pair (A/A control)")
    ap.add_argument("--transport", choices=("uv", "shm", "default"), default="uv",
                    help="TensorPipe transport (default uv: TCP on 127.0.0.1; see BENCHMARKS.md for why not shm)")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--noop-calls", type=int)
    ap.add_argument("--big-calls", type=int)
    ap.add_argument("--thr-seconds", type=float)
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--no-startup", action="store_true")
    ap.add_argument("--no-serialization", action="store_true")
    ap.add_argument("--out", help="JSON path (default: benchmarks/results/overhead-<date>[-<mode>].json)")
    return ap.parse_args(argv)


def span_files(tmp: str, configs: list[str]) -> dict[str, dict[str, int]]:
    """Sanity: what the instrumented workers exported."""
    out = {}
    for c in configs:
        out_dir = os.path.join(tmp, f"out-{c}", "spans")
        if os.path.isdir(out_dir):
            n_lines = 0
            for name in os.listdir(out_dir):
                with open(os.path.join(out_dir, name)) as f:
                    n_lines += sum(1 for _ in f)
            out[c] = {"files": len(os.listdir(out_dir)), "export_lines": n_lines}
    return out


def run(args: argparse.Namespace, mode: str, configs: list[str], p: dict[str, Any], result: dict[str, Any],
        tmp: str) -> list[str]:
    """Starts the pairs and runs the mode's sections into `result`; returns the sections' tables."""
    texts = []
    pairs: dict[str, Pair] = {}
    try:
        pairs = start_pairs(configs, tmp, args.transport)
        result["workers"] = {c: {"caller": pr.caller.ready, "callee": pr.callee.ready} for c, pr in pairs.items()}
        for pr in pairs.values():  # one-time warm-up of every pair, then all paused
            pr.caller.call("noop", n=300, warmup=0)
            pr.caller.call("big", n=5, warmup=0)
            pr.caller.call("thr", threads=8, seconds=0.3)
            pr.pause()
        if mode in ("quick", "full"):
            result["rounds"] = sections.run_rounds(pairs, configs, p, not args.fixed_order)
            texts.append(show(report.rounds_table(result["rounds"], configs)))
            if not args.no_serialization:
                result["serialization"] = sections.run_serialization(pairs, p)
                texts.append(show(report.serialization_table(result["serialization"])))
        if mode == "full" and not args.no_memory:  # fresh (a) and (d) pairs: peak RSS without the rounds' history
            result["shutdown"] = {c: pr.shutdown() for c, pr in pairs.items()}
            pairs = start_pairs(["a", "d"], tmp, args.transport)
            for pr in pairs.values():
                pr.pause()
        if mode == "memory" or (mode == "full" and not args.no_memory):
            result["memory"] = sections.run_memory(pairs)
            texts.append(show(report.memory_table(result["memory"])))
        if mode == "profile":
            result["profile"], text = profiling.run_profile(pairs, args.py_spy, tmp, args.profile_seconds)
            texts.append(text)
        spans = span_files(tmp, configs)
        if spans:
            result["span_files"] = spans
        result.setdefault("shutdown", {}).update({c: pr.shutdown() for c, pr in pairs.items()})
        pairs = {}
        if mode in ("quick", "full") and not args.no_startup:
            result["startup"] = sections.run_startup(p["startup_runs"], p["torch_import_runs"])
            texts.append(show(report.startup_table(result["startup"])))
    finally:
        for pr in pairs.values():
            pr.kill()
    return texts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    p = dict(sections.QUICK if args.quick else sections.FULL)
    for k in ("rounds", "noop_calls", "big_calls", "thr_seconds"):
        if getattr(args, k) is not None:
            p[k] = getattr(args, k)
    mode = "memory" if args.memory else "profile" if args.profile else "quick" if args.quick else "full"
    configs = configs_for(mode, control=not args.no_control, profiler_baseline=args.profiler_baseline)
    started = time.perf_counter()
    stamp = _dt.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    result = report.new_result(mode, stamp, sys.argv if argv is None else [sys.argv[0], *argv])
    result.update({"params": p, "configs": {c: LABELS[c] for c in configs}, "env": {c: ENVS[c] for c in configs},
                   "transport": args.transport, "order": "fixed" if args.fixed_order else "rotating"})
    tmp = tempfile.mkdtemp(prefix="rpc_observe_bench_")
    try:
        texts = run(args, mode, configs, p, result, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result["elapsed_s"] = time.perf_counter() - started
    result["machine"]["loadavg_end"] = report.loadavg()
    result["text"] = "\n\n".join(texts)
    path = report.result_path(args.out, stamp, mode)
    report.write_result(result, path)
    print(f"\n{mode} run took {result['elapsed_s']:.0f}s; results: {os.path.relpath(path, os.getcwd())}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
