"""RSS of a caller/callee pair over 1,000,000 no-op RPCs with metrics and spans on (issue 13.3).

    python benchmarks/memory_long.py [--calls 1000000] [--threads 8] [--every 100000]

Prints, every `--every` calls, both processes' RSS (MB) and the sizes of the call table,
site caches and the profiler ring, and writes benchmarks/results/memory_long-<date>.json.
RPC_OBSERVE=1 with the defaults (spans to files, capped at RPC_OBSERVE_SPANS_MAX_BYTES).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1]) / 1024


def state(_: Any = None) -> dict[str, Any]:
    """This process's RSS and the add-on's tables, read in the process itself."""
    from rpc_observe.hooks import calls, naming
    from rpc_observe.telemetry import runtime

    rt = runtime.current
    ring = len(rt.profiler._ring) if rt is not None and rt.profiler is not None else 0
    return {"rss_mb": round(_rss_mb(), 1), "in_flight": len(calls.in_flight),
            "client_sites": len(rt.client_sites) if rt else -1, "server_sites": len(rt.server_sites) if rt else -1,
            "request_cells": len(rt.request_cells) if rt else -1, "method_names": len(naming._method_names),
            "profiler_ring": ring, "queued_records": len(rt.metrics._records) if rt and rt.metrics else -1}


def noop() -> None:
    return None


def worker(rank: int, init: str, args: argparse.Namespace) -> None:
    import torch.distributed.rpc as rpc

    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{init}", _transports=["uv"], _channels=["basic"])
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 0:
        done, lock, samples = [0], threading.Lock(), []

        def sample() -> None:
            samples.append({"calls": done[0], "caller": state(), "callee": rpc.rpc_sync("worker1", state)})
            print(json.dumps(samples[-1]), flush=True)

        sample()
        per_thread = args.calls // args.threads
        next_sample = [args.every]

        def loop() -> None:
            for _ in range(per_thread):
                rpc.rpc_sync("worker1", noop)
                with lock:
                    done[0] += 1
                    due = done[0] >= next_sample[0]
                    if due:
                        next_sample[0] += args.every
                if due:
                    sample()

        started = time.monotonic()
        threads = [threading.Thread(target=loop) for _ in range(args.threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        sample()
        print(json.dumps({"seconds": time.monotonic() - started}), flush=True)
    rpc.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=1_000_000)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--every", type=int, default=100_000)
    ap.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--init", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank >= 0:
        worker(args.rank, args.init, args)
        return
    tmp = tempfile.mkdtemp(prefix="memory_long-")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RPC_OBSERVE", "OTEL_"))}
    env.update(RPC_OBSERVE="1", RPC_OBSERVE_DIR=os.path.join(tmp, "out"))
    base = [sys.executable, os.path.abspath(__file__), "--calls", str(args.calls), "--threads", str(args.threads),
            "--every", str(args.every), "--init", os.path.join(tmp, "init")]
    callee = subprocess.Popen(base + ["--rank", "1"], env=env, stdout=subprocess.DEVNULL)
    caller = subprocess.run(base + ["--rank", "0"], env=env, capture_output=True, text=True)
    callee.wait(timeout=120)
    lines = [json.loads(line) for line in caller.stdout.splitlines() if line.startswith("{")]
    print("| calls | caller RSS MB | callee RSS MB | in flight | client sites | server sites | ring |")
    print("|---|---|---|---|---|---|---|")
    for s in (x for x in lines if "calls" in x):
        print(f"| {s['calls']:,} | {s['caller']['rss_mb']} | {s['callee']['rss_mb']} | {s['caller']['in_flight']} | "
              f"{s['caller']['client_sites']} | {s['callee']['server_sites']} | {s['callee']['profiler_ring']} |")
    spans = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(os.path.join(tmp, "out", "spans"))
                for f in fs)
    print(f"span files: {spans / 1e6:.0f} MB in {tmp}/out/spans; stderr tail: {caller.stderr[-300:]!r}")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                       f"memory_long-{time.strftime('%Y-%m-%d-%H%M%S')}.json")
    with open(out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "samples": lines, "span_bytes": spans}, f, indent=1)
    print(f"results: {out}")


if __name__ == "__main__":
    main()
