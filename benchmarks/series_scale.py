"""Series and scrape cost at world size: a real job, then the arithmetic for 256 and 1,024 peers.

    python benchmarks/series_scale.py                  # 16 workers, defaults then PEER_LABELS=histograms (~2 min)
    python benchmarks/series_scale.py --scrapes 400    # more scrapes per CPU measurement

One job per configuration, on this machine: 16 worker processes (one `server`, 15 clients
`client1`..`client15`), TensorPipe with `_transports=["uv"], _channels=["basic"]` (idle uv
workers do not busy-poll, unlike shm), `RPC_OBSERVE=1` and nothing else set. Every client
calls the server with 5 methods (3 with rpc_sync, 2 with rpc_async), then all wait, idle,
while this script measures:

- series per worker: the sample lines of each worker's /metrics, and their bytes;
- the server's CPU per scrape: utime + stime of the server process (/proc/<pid>/stat, all
  its threads) across N back-to-back scrapes, divided by N; the same process's idle CPU
  over as long a time (its housekeeping thread) is also reported and subtracted ("net").

Configurations: the defaults (`RPC_OBSERVE_PEER_LABELS=counters`) and
`RPC_OBSERVE_PEER_LABELS=histograms` (the label sets before series were bounded). Then the
arithmetic for a server called by 256 and 1,024 peers: the series that carry a peer label,
per peer, are measured here (15 callers); series and bytes scale from them, and CPU from
the CPU per series the two jobs measured. Results: benchmarks/results/series_scale-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gzip
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SERVER = "server"
CONFIGS = {"counters (default)": {}, "histograms": {"RPC_OBSERVE_PEER_LABELS": "histograms"}}
MAX_PEERS = 256  # RPC_OBSERVE_MAX_PEERS' default: peer label values beyond it are `other`


# -- the worker processes -----------------------------------------------------------------


def get_weights(step: int) -> Any:
    import torch

    return torch.ones(1024)


def push_grad(grad: Any) -> None:
    return None


def step_done(step: int) -> int:
    return step


def report(stats: dict) -> None:
    return None


def ping() -> int:
    return 0


def worker(rank: int, world: int, run_dir: Path, calls: int) -> None:
    import torch
    import torch.distributed.rpc as rpc

    options = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{run_dir / 'init'}", num_worker_threads=16,
                                              rpc_timeout=300, _transports=["uv"], _channels=["basic"])
    rpc.init_rpc(SERVER if rank == 0 else f"client{rank}", rank=rank, world_size=world, rpc_backend_options=options)
    if rank:
        grad = torch.ones(1024)
        for i in range(calls):
            rpc.rpc_sync(SERVER, get_weights, args=(i,))
            rpc.rpc_sync(SERVER, push_grad, args=(grad,))
            rpc.rpc_async(SERVER, step_done, args=(i,)).wait()
            rpc.rpc_async(SERVER, report, args=({"loss": 1.0, "step": i},)).wait()
            rpc.rpc_sync(SERVER, ping)
    (run_dir / f"done{rank}").write_text("done")
    while not (run_dir / "release").exists():
        time.sleep(0.2)
    rpc.shutdown()


# -- the driver ---------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of `pid`, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # fields 14 and 15 of stat(5)


def scrape(target: str) -> bytes:
    with urllib.request.urlopen(f"http://{target}/metrics", timeout=30) as response:
        return response.read()


def sample_lines(text: bytes) -> list[bytes]:
    return [line for line in text.splitlines() if line and not line.startswith(b"#")]


_PEER_LABEL = re.compile(rb'(?:dst|src)="([^"]*)"')


def describe(text: bytes) -> dict[str, Any]:
    """Series and bytes of one scrape, and the part of them that carries a peer label (dst or src)."""
    lines = sample_lines(text)
    peered = [line for line in lines if _PEER_LABEL.search(line)]
    return {"series": len(lines), "bytes": len(text), "gzip_bytes": len(gzip.compress(text)),
            "peers": sorted({m.decode() for line in peered for m in _PEER_LABEL.findall(line)}),
            "peer_series": len(peered), "peer_bytes": sum(len(line) + 1 for line in peered),
            "families": families(lines)}


def families(lines: list[bytes]) -> dict[str, int]:
    """Series per metric family (a histogram's _bucket, _sum and _count lines together)."""
    counts: dict[str, int] = {}
    for line in lines:
        name = line.split(b"{", 1)[0].split(b" ", 1)[0].decode()
        for suffix in ("_bucket", "_sum", "_count"):
            if name.endswith(suffix) and not name.endswith("_total"):
                name = name.removesuffix(suffix)
                break
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def targets(out_dir: Path) -> dict[str, str]:
    found = {}
    for path in out_dir.glob("targets/*.json"):
        try:
            found[path.stem] = json.loads(path.read_text())[0]["targets"][0]
        except (ValueError, IndexError, KeyError):
            pass  # being written
    return found


def run_job(label: str, extra_env: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(prefix="series_scale-"))
    out_dir = run_dir / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RPC_OBSERVE", "OTEL_"))}
    env.update(RPC_OBSERVE="1", RPC_OBSERVE_DIR=str(out_dir), PYTHONUNBUFFERED="1", **extra_env)
    procs = []
    for rank in range(args.workers):
        log = open(run_dir / f"log{rank}.txt", "w")
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", str(rank), "--world", str(args.workers),
                                       "--run-dir", str(run_dir), "--calls", str(args.calls)],
                                      env=env, stdout=log, stderr=subprocess.STDOUT, cwd=run_dir))
    try:
        deadline = time.monotonic() + args.timeout
        while not all((run_dir / f"done{rank}").exists() for rank in range(args.workers)):
            failed = [rank for rank, p in enumerate(procs) if p.poll() is not None]
            if failed or time.monotonic() > deadline:
                raise RuntimeError(f"{label}: workers {failed or 'too slow'}; logs in {run_dir}")
            time.sleep(0.5)
        while len(found := targets(out_dir)) < args.workers:
            time.sleep(0.2)
        time.sleep(2.0)  # the housekeeping threads drain, the span exporters flush: the job is idle
        per_worker = {name: describe(scrape(target)) for name, target in sorted(found.items())}
        server_target, pid = found[SERVER], procs[0].pid
        idle_start, idle_cpu = time.monotonic(), cpu_seconds(pid)
        time.sleep(args.idle_seconds)
        idle_rate = (cpu_seconds(pid) - idle_cpu) / (time.monotonic() - idle_start)
        walls = []
        start, cpu = time.monotonic(), cpu_seconds(pid)
        for _ in range(args.scrapes):
            t = time.perf_counter()
            scrape(server_target)
            walls.append(time.perf_counter() - t)
        elapsed, used = time.monotonic() - start, cpu_seconds(pid) - cpu
        server = per_worker[SERVER]
        result = {
            "label": label,
            "env": extra_env,
            "workers": args.workers,
            "per_worker": per_worker,
            "server": {
                **server,
                "bytes_per_series": server["bytes"] / server["series"],
                "cpu_ms_per_scrape": 1e3 * used / args.scrapes,
                "idle_cpu_ms_per_s": 1e3 * idle_rate,
                "net_cpu_ms_per_scrape": 1e3 * max(used - idle_rate * elapsed, 0.0) / args.scrapes,
                "wall_ms_p50": 1e3 * statistics.median(walls),
                "scrapes": args.scrapes,
            },
        }
    finally:
        (run_dir / "release").write_text("release")
        for p in procs:
            try:
                p.wait(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return result


def extrapolate(scraped: dict[str, Any], peers: int, cap: int | None, job_peers: int) -> tuple[float, float]:
    """(series, bytes) of a worker's scrape in a job of `peers` + 1 workers. What carries no peer label
    stays. A worker whose peer labels name every other worker of the measured job (`job_peers` of them: the
    server's callers, or everyone for the leader of torch's all-gather in init_rpc and shutdown) gets its
    measured series per peer for each distinct peer label value, at most `cap` + `other`; the others (a
    client: the server and the leader) keep theirs."""
    seen = len(scraped["peers"])
    if seen < job_peers:
        return scraped["series"], scraped["bytes"]
    distinct = peers if cap is None else min(peers, cap + 1)
    fixed_series, fixed_bytes = scraped["series"] - scraped["peer_series"], scraped["bytes"] - scraped["peer_bytes"]
    return (fixed_series + scraped["peer_series"] / seen * distinct,
            fixed_bytes + scraped["peer_bytes"] / seen * distinct)


def in_process(peers: int, peer_histograms: bool, max_peers: int) -> dict[str, float]:
    """The server's label sets for `peers` callers of the 5 methods, bound as the hooks bind them, in this
    process: series, bytes and CPU of prometheus_client's `generate_latest` (a scrape without HTTP)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from rpc_observe.telemetry.metrics import Metrics, fold_message, fold_served

    registry = CollectorRegistry()
    metrics = Metrics(SERVER, 100, max_peers=max_peers, peer_histograms=peer_histograms)
    registry.register(metrics)
    for method in ("get_weights", "push_grad", "step_done", "report", "ping"):
        request = metrics.message_cells("deserialize", "request", method)
        response = metrics.message_cells("serialize", "response", method)
        for caller in range(1, peers + 1):
            metrics.record((fold_message, request, 120, 1, 4096, 4096, 2e-5, None, 0))
            metrics.record((fold_served, metrics.server_cells(method, f"client{caller}"), 1e-3, None))
            metrics.record((fold_message, response, 120, 1, 4096, 4096, 2e-5, None, 0))
    text = generate_latest(registry)
    runs, start = 0, time.process_time()
    while runs < 3 or time.process_time() - start < 1.0:
        text = generate_latest(registry)
        runs += 1
    return {"series": len(sample_lines(text)), "bytes": len(text),
            "cpu_ms": 1e3 * (time.process_time() - start) / runs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=16, help="processes: one server and workers-1 clients")
    ap.add_argument("--calls", type=int, default=40, help="rounds of the 5 methods per client")
    ap.add_argument("--scrapes", type=int, default=200, help="back-to-back scrapes of the server per CPU measure")
    ap.add_argument("--idle-seconds", type=float, default=5.0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", help="JSON path (default: benchmarks/results/series_scale-<date>.json)")
    ap.add_argument("--keep", action="store_true", help="keep the run directories (logs, spans) in /tmp")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args.world, Path(args.run_dir), args.calls)
        return 0

    results = [run_job(label, env, args) for label, env in CONFIGS.items()]
    print(f"\n{args.workers} workers (1 server, {args.workers - 1} clients, 5 methods), uv transport, "
          f"{args.scrapes} scrapes of the server, CPU from /proc/<pid>/stat\n")
    header = (f"{'configuration':<20}{'server series':>14}{'scrape bytes':>14}{'gzip':>9}{'B/series':>10}"
              f"{'peer series':>13}{'client series':>15}{'CPU ms/scrape':>15}{'net':>7}{'wall p50 ms':>13}")
    print(header + "\n" + "-" * len(header))
    for r in results:
        s = r["server"]
        clients = [w["series"] for name, w in r["per_worker"].items() if name != SERVER]
        print(f"{r['label']:<20}{s['series']:>14}{s['bytes']:>14}{s['gzip_bytes']:>9}{s['bytes_per_series']:>10.1f}"
              f"{s['peer_series']:>13}{f'{min(clients)}-{max(clients)}':>15}"
              f"{s['cpu_ms_per_scrape']:>15.2f}{s['net_cpu_ms_per_scrape']:>7.2f}{s['wall_ms_p50']:>13.2f}")
        leader = max(r["per_worker"], key=lambda name: len(r["per_worker"][name]["peers"]))
        if leader != SERVER:
            w = r["per_worker"][leader]
            print(f"{'':<20}({leader}, init_rpc's all-gather leader, talks to {len(w['peers'])} peers: "
                  f"{w['series']} series, {w['peer_series']} with a peer label)")
    idle = ", ".join(f"{r['label']}: {r['server']['idle_cpu_ms_per_s']:.1f}" for r in results)
    print(f"(server idle CPU, ms per second, subtracted for 'net': {idle})")

    # CPU per series: the largest scrape measured gives the least noisy figure (it includes the fixed cost).
    biggest = max(results, key=lambda r: r["server"]["series"])["server"]
    cpu_per_series = biggest["cpu_ms_per_scrape"] / biggest["series"]
    print(f"\nOne server called by N peers (series and bytes from the series per peer measured above; CPU at "
          f"{1e3 * cpu_per_series:.2f} us per series, the largest scrape's CPU / its series)\n")
    header = (f"{'configuration':<32}{'peers':>7}{'server series':>15}{'MB':>8}{'CPU ms':>8}"
              f"{'busiest worker':>16}{'series':>8}{'MB':>8}{'CPU ms':>8}")
    print(header + "\n" + "-" * len(header))
    arithmetic = []
    rows = [(results[0], MAX_PEERS, results[0]["label"]), (results[1], MAX_PEERS, "histograms, MAX_PEERS=256"),
            (results[1], None, "histograms, MAX_PEERS >= peers")]
    for peers in (args.workers - 1, 256, 1024):
        for result, cap, label in rows:
            sized = {name: extrapolate(w, peers, cap, args.workers - 1) for name, w in result["per_worker"].items()}
            busiest = max(sized, key=lambda name: sized[name][0])
            (series, size), (b_series, b_size) = sized[SERVER], sized[busiest]
            arithmetic.append({"configuration": label, "peers": peers, "server_series": series,
                               "server_bytes": size, "server_cpu_ms": cpu_per_series * series,
                               "busiest": busiest, "busiest_series": b_series, "busiest_bytes": b_size,
                               "busiest_cpu_ms": cpu_per_series * b_series})
            print(f"{label:<32}{peers:>7}{series:>15.0f}{size / 1e6:>8.3f}{cpu_per_series * series:>8.1f}"
                  f"{busiest:>16}{b_series:>8.0f}{b_size / 1e6:>8.3f}{cpu_per_series * b_series:>8.1f}")
    print("\nChecked in this process: the server's label sets for N callers (5 methods), bound as the hooks "
          "bind them,\nand one scrape by prometheus_client's generate_latest (no HTTP, no agent or state gauges)\n")
    header = f"{'configuration':<32}{'peers':>7}{'series':>10}{'MB':>8}{'CPU ms':>8}"
    print(header + "\n" + "-" * len(header))
    checked = []
    for peers in (args.workers - 1, 256, 1024):
        for label, histograms, cap in (("counters (default)", False, MAX_PEERS),
                                       ("histograms, MAX_PEERS=256", True, MAX_PEERS),
                                       ("histograms, MAX_PEERS >= peers", True, 100_000)):
            row = in_process(peers, histograms, cap)
            checked.append({"configuration": label, "peers": peers, **row})
            print(f"{label:<32}{peers:>7}{row['series']:>10}{row['bytes'] / 1e6:>8.3f}{row['cpu_ms']:>8.1f}")
    out = Path(args.out) if args.out else HERE / "results" / f"series_scale-{_dt.datetime.now():%Y-%m-%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if v is not None},
                               "results": results, "arithmetic": arithmetic, "in_process": checked}, indent=1))
    print(f"\n{out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
