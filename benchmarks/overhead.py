"""Overhead of rpc_observe on torch.distributed.rpc (issues 6 and 7): latency, CPU per call, throughput, saturation.

    python benchmarks/overhead.py                    # full run (~25 min): latency/throughput rounds, server
                                                     # saturation, serialization, memory, start-up
    python benchmarks/overhead.py --quick            # < 5 min: fewer rounds and calls, no memory section
    python benchmarks/overhead.py --saturation-only  # only the server-saturation section (~4 min; with --quick ~2)
    python benchmarks/overhead.py --memory           # only the memory section
    python benchmarks/overhead.py --profile          # where (c)/(d)/(e) spend time: /proc counters, in-situ self
                                                     # times, perf and py-spy where found

Configurations, each a pair of worker processes (worker0 calls, worker1 serves) on 127.0.0.1
TensorPipe (`uv` transport, `basic` channel), driven from here over stdin / a JSON answer pipe,
measured one pair at a time (the others SIGSTOPped) and interleaved block by block:

  a  torch RPC, rpc_observe not imported: `python -S`, site-packages appended by hand
  b  rpc_observe installed, RPC_OBSERVE unset (nothing patched)
  c  metrics only: RPC_OBSERVE=1 OTEL_TRACES_EXPORTER=none RPC_OBSERVE_PROFILER_EVENTS=0
  d  metrics + spans (100% sampled, file exporter) + profiler events: RPC_OBSERVE=1
  dn (d) with RPC_OBSERVE_KEEP_THREAD_STATES=0: torch's pool threads get a new Python thread state at every
     GIL hold, as with torch alone; (d) keeps them (hooks/thread_states.py), which saves more than the add-on
     costs, so (dn) is the cost of observing alone
  e  (d) with a torch.profiler session (CPU) active on the caller around each measurement
  h  the user's alternative, no rpc_observe: hand-written OpenTelemetry SDK spans (client span around
     the call, server span in the UDF, context in the kwargs via propagate.inject/extract, batch
     processor, OTLP-JSON-lines file exporter) and a prometheus_client Histogram on each side
  l  (reference) (a) with torch's legacy profiler (torch.autograd.profiler_legacy.profile(), which
     turns on torch's own RPC profiling) around each measurement on the caller
  a2 a second (a): the A/A control, the noise floor of every ratio
  ap (reference, --profiler-baseline) (a) with the same torch.profiler session as (e)

Every round starts fresh pairs (in a rotated order) and shuts them down at its end (--keep-pairs:
one set of pairs for all rounds, as before). CPU per call is utime+stime of every process of the
pair from /proc over the measured calls, so work moved to background threads is counted. The
saturation section runs groups of 4 client processes x 4 threads against one server per config
(a, c, d, h, a2). Ratios to (a) are computed per round (same round) and then the median is taken.
Results go to benchmarks/results/overhead-<date>[-quick|-saturation|-memory|-profile].json, with
the git commit, a hash of the rpc_observe/ working copy per round, and the command.

This file is the command line and the driver; the parts are in benchmarks/bench/ (pairs:
configurations and worker processes, sections: what is measured, procstat: /proc CPU of processes
and threads, stats, report: tables and the result file, profiling: --profile). The worker process
is benchmarks/_worker.py.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench import profiling, report, sections, stats
from bench.pairs import ENVS, LABELS, SAT_CONFIGS, add_baseline, configs_for, shutdown_all, start_pairs
from bench.report import show


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="< 5 minutes: fewer rounds and calls, no memory or serialization section")
    ap.add_argument("--saturation-only", action="store_true",
                    help="only the server-saturation section (with --quick: its quick parameters)")
    ap.add_argument("--memory", action="store_true", help="only the memory section (pairs a and d)")
    ap.add_argument("--profile", action="store_true",
                    help="only profile configs (c), (d) and (e) against (a): /proc counters, in-situ self times, perf "
                         "and py-spy if found")
    ap.add_argument("--py-spy", default=shutil.which("py-spy"), metavar="PATH",
                    help="py-spy for --profile (default: the py-spy on PATH, here: %(default)s); the py-spy view "
                         "is skipped, with a message, when there is none")
    ap.add_argument("--profile-seconds", type=float, default=15.0)
    ap.add_argument("--profiler-baseline", action="store_true",
                    help="also run (ap): (a) with the same torch.profiler session as (e), to separate the "
                         "profiler's own cost from the add-on's")
    ap.add_argument("--keep-pairs", action="store_true",
                    help="start the pairs once and keep them for every round (default: fresh pairs every round, "
                         "so no pair's own layout biases one config for the whole run)")
    ap.add_argument("--fixed-order", action="store_true",
                    help="measure the configs in the same order every round (default: the order rotates by one "
                         "each round, so no config is always first)")
    ap.add_argument("--no-control", action="store_true", help="leave out (a2), the second (a) pair (A/A control)")
    ap.add_argument("--transport", choices=("uv", "shm", "default"), default="uv",
                    help="TensorPipe transport (default uv: TCP on 127.0.0.1; see BENCHMARKS.md for why not shm)")
    ap.add_argument("--channels", default="basic",
                    help="TensorPipe channels, comma-separated, or 'default' for TensorPipe's own choice "
                         "(default basic: tensors inline over the transport)")
    ap.add_argument("--baseline", metavar="REV",
                    help="also run (c0), (d0) and (e0): (c), (d) and (e) with rpc_observe as it was at git revision "
                         "REV, in the same rounds (and, with --profile, its in-situ self times), so a change is "
                         "measured side by side; the saturation section adds (d0)")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--noop-calls", type=int)
    ap.add_argument("--big-calls", type=int)
    ap.add_argument("--thr-seconds", type=float)
    ap.add_argument("--sat-rounds", type=int)
    ap.add_argument("--sat-seconds", type=float, help="measured seconds per saturation block")
    ap.add_argument("--no-saturation", action="store_true")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--no-startup", action="store_true")
    ap.add_argument("--no-serialization", action="store_true")
    ap.add_argument("--out", help="JSON path (default: benchmarks/results/overhead-<date>[-<mode>].json)")
    return ap.parse_args(argv)


def baseline_tree(rev: str, tmp: str) -> str:
    """A directory holding rpc_observe/ as it was at git revision `rev` (`git archive`, no worktree to clean up),
    with its C modules built as an install builds them (REV's hatch_build.py), where REV has them: without
    them REV would run its Python references, not what its users run."""
    tree = os.path.join(tmp, "baseline")
    os.makedirs(tree)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    has_build = subprocess.run(["git", "-C", repo, "cat-file", "-e", f"{rev}:hatch_build.py"],
                               capture_output=True).returncode == 0
    paths = ["rpc_observe"] + (["hatch_build.py"] if has_build else [])
    archive = subprocess.run(["git", "-C", repo, "archive", rev, *paths], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", tree], input=archive.stdout, check=True)
    if has_build:
        built = subprocess.run([sys.executable, os.path.join(tree, "hatch_build.py")], capture_output=True, text=True)
        if built.returncode != 0:
            raise RuntimeError(f"{rev}'s C modules did not build: {built.stderr.strip()[:500]}")
    return tree


def span_files(tmp: str) -> dict[str, dict[str, int]]:
    """Sanity: what the instrumented and the hand-written workers exported (files, lines, spans)."""
    out = {}
    for entry in sorted(os.listdir(tmp)):
        out_dir = os.path.join(tmp, entry, "spans")
        if entry.startswith("out-") and os.path.isdir(out_dir):
            n_lines = n_spans = 0
            for name in os.listdir(out_dir):
                with open(os.path.join(out_dir, name), "rb") as f:
                    for line in f:
                        n_lines += 1
                        n_spans += line.count(b'"spanId"')
            out[entry[4:]] = {"files": len(os.listdir(out_dir)), "export_lines": n_lines, "spans": n_spans}
    return out


def cpu_comparisons(result: dict[str, Any]) -> None:
    """Added CPU per call over plain torch per config, and (d)'s against (h)'s, into `result`."""
    per_round: dict[str, dict[str, list[float]]] = {}
    for section in ("rounds", "saturation"):
        for c, metrics in result.get(section, {}).get("per_round", {}).items():
            per_round.setdefault(c, {}).update(metrics)
    added: dict[str, dict[str, Any]] = {}
    versus: dict[str, dict[str, Any]] = {}
    for m in sections.CPU_METRICS:
        configs = [c for c in per_round if m in per_round[c]]
        if "a" not in configs:
            continue
        sub = {c: per_round[c] for c in configs}
        added[m] = {c: stats.summary(v) for c, v in stats.added(sub, configs, m, pooled_base=True).items()
                    if c not in ("a", "a2")}
        if "d" in configs and "h" in configs:
            versus[m] = {"a": stats.versus(sub, m), "pooled": stats.versus(sub, m, pooled_base=True)}
    result["added_cpu"], result["vs_handwritten"] = added, versus


def run(args: argparse.Namespace, mode: str, configs: list[str], p: dict[str, Any], result: dict[str, Any],
        tmp: str) -> list[str]:
    """Runs the mode's sections into `result`; returns the sections' tables."""
    texts = []
    rotate, transport, channels = not args.fixed_order, args.transport, args.channels
    if mode in ("quick", "full"):
        result["rounds"] = res = sections.run_rounds(configs, p, rotate, not args.keep_pairs, tmp, transport,
                                                     channels, report.code_state)
        texts.append(show(report.rounds_table(res, configs)))
        shown = [c for c in ("a", "a2", "b", "c", "c0", "d", "dn", "d0", "e", "h") if c in configs]
        texts.append(show(report.threads_table("Callee (server) CPU per call by thread, 8-thread rpc_async loop",
                                               {c: res["threads"][c]["thr"] for c in shown}, shown)))
        texts.append(show(report.threads_table("Callee (server) CPU per call by thread, no-op rpc_sync loop",
                                               {c: res["threads"][c]["noop"] for c in shown}, shown)))
    if mode in ("quick", "full", "saturation") and not args.no_saturation:
        sat_configs = SAT_CONFIGS + (["d0"] if args.baseline else []) + ([] if args.no_control else ["a2"])
        result["saturation"] = res = sections.run_saturation(sat_configs, p, rotate, tmp, transport, channels,
                                                             report.code_state)
        texts.append(show(report.saturation_table(res, sat_configs)))
        texts.append(show(report.threads_table("Saturation server CPU per call by thread", res["threads"],
                                               sat_configs)))
        texts.append(show(report.threads_table(f"Saturation clients' CPU per call by thread, the {res['clients']} "
                                               "client processes summed", res["client_threads"], sat_configs)))
    if "rounds" in result or "saturation" in result:
        cpu_comparisons(result)
        texts.append(show(report.added_table(result)))
    if mode == "full" and not args.no_serialization:
        pairs = start_pairs([c for c in ("a", "a2", "c") if c in configs], tmp, transport, channels, verbose=False)
        try:
            sections.warm_up(pairs)
            result["serialization"] = sections.run_serialization(pairs, p)
        finally:
            shutdown_all(list(pairs.values()))
        texts.append(show(report.serialization_table(result["serialization"])))
    if mode == "memory" or (mode == "full" and not args.no_memory):
        pairs = start_pairs(["a", "d"], tmp, transport, channels, verbose=False)
        try:
            for pr in pairs.values():
                pr.pause()
            result["memory"] = sections.run_memory(pairs)
        finally:
            result["shutdown_memory"] = shutdown_all(list(pairs.values()))
        texts.append(show(report.memory_table(result["memory"])))
    if mode == "profile":
        pairs = start_pairs(configs, tmp, transport, channels)
        try:
            sections.warm_up(pairs)
            result["profile"], text = profiling.run_profile(pairs, args.py_spy, tmp, args.profile_seconds)
        finally:
            shutdown_all(list(pairs.values()))
        texts.append(text)
    spans = span_files(tmp)
    if spans:
        result["span_files"] = spans
    if mode in ("quick", "full") and not args.no_startup:
        result["startup"] = sections.run_startup(p["startup_runs"], p["torch_import_runs"])
        texts.append(show(report.startup_table(result["startup"])))
    if "rounds" in result or "saturation" in result:
        texts.append(show(report.targets_table(result)))
    return texts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    p = dict(sections.QUICK if args.quick else sections.FULL)
    for k in ("rounds", "noop_calls", "big_calls", "thr_seconds", "sat_rounds", "sat_seconds"):
        if getattr(args, k) is not None:
            p[k] = getattr(args, k)
    mode = ("memory" if args.memory else "profile" if args.profile else "saturation" if args.saturation_only
            else "quick" if args.quick else "full")
    if mode == "quick":
        args.no_serialization = True
    tmp = tempfile.mkdtemp(prefix="rpc_observe_bench_")
    if args.baseline:
        try:
            add_baseline(args.baseline, baseline_tree(args.baseline, tmp))
        except (subprocess.CalledProcessError, RuntimeError) as e:  # an unknown REV, or its C modules do not build
            shutil.rmtree(tmp, ignore_errors=True)
            failed = isinstance(e, subprocess.CalledProcessError)
            reason = (e.stderr or b"").decode(errors="replace").strip() if failed else str(e)
            raise SystemExit(f"--baseline {args.baseline}: {reason}") from None
    configs = configs_for(mode, control=not args.no_control, profiler_baseline=args.profiler_baseline,
                          baseline=bool(args.baseline))
    started = time.perf_counter()
    stamp = _dt.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    result = report.new_result(mode, stamp, sys.argv if argv is None else [sys.argv[0], *argv])
    result.update({"params": p, "configs": {c: LABELS[c] for c in configs}, "env": {c: ENVS[c] for c in configs},
                   "transport": args.transport, "channels": args.channels,
                   "order": "fixed" if args.fixed_order else "rotating",
                   "pairs": "kept for all rounds" if args.keep_pairs else "fresh every round"})
    try:
        texts = run(args, mode, configs, p, result, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result["elapsed_s"] = time.perf_counter() - started
    result["machine"]["loadavg_end"] = report.loadavg()
    result["git"]["code_at_end"] = report.code_state()
    if result["git"]["code_at_end"] != result["git"]["code_at_start"]:
        print(f"NOTE: rpc_observe changed during the run: {result['git']['code_at_start']} -> "
              f"{result['git']['code_at_end']} (each round's state: rounds_info of the result's sections)", flush=True)
    result["text"] = "\n\n".join(texts)
    path = report.result_path(args.out, stamp, mode)
    report.write_result(result, path)
    print(f"\n{mode} run took {result['elapsed_s']:.0f}s at {result['git']['commit_short']} "
          f"(rpc_observe tree {result['git']['code_at_start']['rpc_observe_tree_sha']}); "
          f"results: {os.path.relpath(path, os.getcwd())}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
