"""`rpc-observe demo`: a parameter server and trainers on loopback, with everything on.

It starts the workers with only environment variables (RPC_OBSERVE=1,
RPC_OBSERVE_PROFILE=1), shows their metrics endpoints and a progress bar, then prints a
per-method summary, a traffic matrix, and where the spans, the per-worker profiler
traces, the merged timeline and the HTML report are, with how to open each.  The progress
bar is drawn only on a terminal: a log gets no carriage-return frames.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from . import report

_WORKLOAD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workload.py")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rpc-observe demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=3, choices=(3, 4),
                        help="processes: 1 server + trainers (default 3)")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds of training (default 5)")
    parser.add_argument("--serve", action="store_true", help="keep running (for the docker-compose stack) until Ctrl-C")
    parser.add_argument("--out", default=os.environ.get("RPC_OBSERVE_DIR", "rpc_observe_out"),
                        help="output directory (default $RPC_OBSERVE_DIR or ./rpc_observe_out)")
    return parser.parse_args(argv)


def _worker_env(out_dir: str, run_id: str, duration: float) -> dict[str, str]:
    env = dict(os.environ)
    env.update(RPC_OBSERVE="1", RPC_OBSERVE_PROFILE=env.get("RPC_OBSERVE_PROFILE", "1"),
               RPC_OBSERVE_DIR=out_dir, RPC_OBSERVE_RUN_ID=run_id, DEMO_DURATION=str(duration))
    return env


def _targets(out_dir: str) -> dict[str, str]:
    found = {}
    for path in glob.glob(os.path.join(out_dir, "targets", "*.json")):
        try:
            with open(path) as f:
                found[os.path.basename(path)[:-5]] = json.load(f)[0]["targets"][0]
        except (OSError, ValueError, KeyError, IndexError):
            pass  # being written
    return found


def _calls(targets: dict[str, str]) -> float:
    count = 0.0
    for target in targets.values():
        try:
            count += sum(v for n, _, v in report.scrape(target) if n == "torch_rpc_client_requests_total")
        except OSError:
            pass
    return count


def _bar(fraction: float, calls: float, width: int = 30) -> str:
    filled = int(width * min(max(fraction, 0.0), 1.0))
    return f"[{'#' * filled}{'.' * (width - filled)}] {fraction:4.0%}  {calls:8.0f} RPCs"


def _save_scrapes(out_dir: str, targets: dict[str, str]) -> list[report.Sample]:
    """Every worker's /metrics, parsed, and saved as metrics/<worker>.prom for `rpc-observe report`
    (span files do not carry the bytes and tensors per message)."""
    os.makedirs(os.path.join(out_dir, "metrics"), exist_ok=True)
    samples: list[report.Sample] = []
    for worker, target in sorted(targets.items()):
        text = report.fetch(target)
        with open(os.path.join(out_dir, "metrics", f"{worker}.prom"), "w") as f:
            f.write(text)
        samples.extend(report.parse(text))
    return samples


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    out_dir = os.path.abspath(args.out)
    for sub in ("spans", "targets", "profiler", "metrics"):
        shutil.rmtree(os.path.join(out_dir, sub), ignore_errors=True)
    control = tempfile.mkdtemp(prefix="rpc_observe_demo_")
    open(os.path.join(control, "hold"), "w").close()
    run_id = f"demo-{int(time.time())}"
    start = time.time()
    env = _worker_env(out_dir, run_id, 0.0 if args.serve else args.duration)
    logs = [open(os.path.join(control, f"worker{r}.log"), "w") for r in range(args.workers)]
    procs = [subprocess.Popen([sys.executable, _WORKLOAD, str(r), str(args.workers), os.path.join(control, "init"),
                               control], env=env, stdout=log, stderr=subprocess.STDOUT) for r, log in enumerate(logs)]
    stopping = {"now": False}
    signal.signal(signal.SIGINT, lambda *_: stopping.update(now=True))
    signal.signal(signal.SIGTERM, lambda *_: stopping.update(now=True))
    try:
        return _run(args, out_dir, control, procs, start, stopping)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def _run(args: argparse.Namespace, out_dir: str, control: str, procs: list[subprocess.Popen], start: float,
         stopping: dict[str, bool]) -> int:
    print(f"rpc_observe demo: 1 parameter server + {args.workers - 1} trainers on 127.0.0.1, output in {out_dir}")
    targets: dict[str, str] = {}
    while len(targets) < args.workers:
        if any(p.poll() not in (None, 0) for p in procs) or time.time() - start > 120:
            return _failed(control, procs, "workers did not start")
        time.sleep(0.2)
        targets = _targets(out_dir)
    print("metrics endpoints (Prometheus file_sd targets in {}):".format(os.path.join(out_dir, "targets")))
    for worker, target in sorted(targets.items()):
        print(f"  {worker:<10} http://{target}/metrics")
    done = lambda: all(os.path.exists(os.path.join(control, f"done-{r}")) for r in range(1, args.workers))  # noqa: E731
    on_terminal = sys.stdout.isatty()
    while not done():
        if stopping["now"]:
            open(os.path.join(control, "stop"), "w").close()
        if any(p.poll() not in (None, 0) for p in procs):
            return _failed(control, procs, "a worker failed")
        started = os.path.join(control, "started-1")
        elapsed = time.time() - os.path.getmtime(started) if os.path.exists(started) else 0.0
        fraction = 1.0 if args.serve else elapsed / args.duration
        if on_terminal:
            print("\r" + _bar(fraction, _calls(targets)), end="", flush=True)
        time.sleep(0.5)
    samples = _save_scrapes(out_dir, targets)
    calls = sum(v for n, _, v in samples if n == "torch_rpc_client_requests_total")
    print(("\r" if on_terminal else "") + _bar(1.0, calls))
    os.remove(os.path.join(control, "hold"))
    for proc in procs:
        if proc.wait(timeout=120) != 0:
            return _failed(control, procs, "a worker failed at shutdown")
    print("\nper method (all workers):")
    print("\n".join("  " + row for row in report.method_table(samples)))
    print("\ntraffic matrix (client calls and bytes sent, caller -> callee):")
    print("\n".join("  " + row for row in report.traffic_matrix(samples)))
    return _artifacts(out_dir)


def _artifacts(out_dir: str) -> int:
    from .. import merge
    from .. import report as html_report

    merged = os.path.join(out_dir, "merged.json")
    status = merge.main([os.path.join(out_dir, "spans"), os.path.join(out_dir, "profiler"), "-o", merged, "-q"])
    page = os.path.join(out_dir, "report.html")
    report_status = html_report.main([out_dir, "-o", page, "-q"])
    print("\nartifacts:")
    print(f"  spans (OTLP JSON, one file per worker): {os.path.join(out_dir, 'spans')}")
    print(f"  torch.profiler traces, per worker:      {os.path.join(out_dir, 'profiler')}")
    print(f"  merged timeline of all workers:         {merged}")
    print(f"  report (one HTML page, opens offline):  {page}")
    print("\nopen them:")
    print("  Perfetto:  https://ui.perfetto.dev -> Open trace file -> merged.json"
          " (arrows link each call to its execution)")
    print("  Jaeger:    docker compose up -d; OTEL_TRACES_EXPORTER=otlp rpc-observe demo; then http://localhost:16686")
    print("  Grafana:   docker compose up -d; rpc-observe demo --serve; then http://localhost:3000"
          " (dashboard 'rpc_observe')")
    return status or report_status


def _failed(control: str, procs: list[subprocess.Popen], why: str) -> int:
    print(f"\nrpc_observe demo: {why}; worker logs in {control}", file=sys.stderr)
    for path in sorted(glob.glob(os.path.join(control, "worker*.log"))):
        with open(path) as f:
            tail = f.read()[-1500:]
        print(f"--- {path}\n{tail}", file=sys.stderr)
    return 1
