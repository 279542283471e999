"""Overhead of rpc_observe on torch.distributed.rpc (issue 6).

    python benchmarks/overhead.py            # full run (~10-15 min): latency rounds, serialization,
                                             # start-up and memory
    python benchmarks/overhead.py --quick    # < 2 min: fewer rounds and calls, no memory section
    python benchmarks/overhead.py --memory   # only the memory section
    python benchmarks/overhead.py --profile  # py-spy + cProfile of config (d) (needs --py-spy PATH)

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
Results go to benchmarks/results/overhead-<date>[-quick].json.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import signal
import site
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "_worker.py")
RESULTS = os.path.join(HERE, "results")

LABELS = {
    "a": "(a) torch RPC only (python -S, no .pth)",
    "a2": "(a2) = (a), 2nd pair: A/A noise control",
    "b": "(b) installed, RPC_OBSERVE unset",
    "c": "(c) metrics only",
    "d": "(d) metrics+spans+profiler events",
    "e": "(e) (d) + torch.profiler on caller",
    "ap": "(ap) (a) + torch.profiler on caller [ref]",
}
ON = {"RPC_OBSERVE": "1"}
ENVS = {
    "a": {},
    "a2": {},
    "ap": {},
    "b": {},
    "c": {**ON, "OTEL_TRACES_EXPORTER": "none", "RPC_OBSERVE_PROFILER_EVENTS": "0"},
    "d": dict(ON),
    "e": dict(ON),
}
NO_SITE = ("a", "a2", "ap")
for _c in ("c", "d"):  # --profile: (c), (d) with the worker's in-situ self-timer (BENCH_SELF_TIME)
    LABELS[_c + "_t"] = LABELS[_c] + " + self-timer"
    ENVS[_c + "_t"] = {**ENVS[_c], "BENCH_SELF_TIME": "1"}
TRANSPORT = ["uv"]  # set from --transport
EXTRA_ENV: dict[str, dict] = {}  # per config, for diagnostics

# (config, metric, comparison, threshold) on the median of per-round ratios to (a).
TARGETS = [
    ("b", "noop_p50", "<=", 1.01),
    ("c", "noop_p50", "<=", 1.03),
    ("d", "noop_p50", "<=", 1.10),
    ("d", "big_p50", "<=", 1.01),
    ("d", "thr", ">=", 0.95),
]
METRICS = [  # key, title, unit scale, lower is better
    ("noop_p50", "no-op p50 us", 1.0, True),
    ("noop_p99", "no-op p99 us", 1.0, True),
    ("big_p50", "4MB p50 ms", 1e-3, True),
    ("thr", "8-thr calls/s", 1.0, False),
    ("noop_cpu", "no-op CPU us/call", 1.0, True),  # caller+callee process CPU time
    ("thr_cpu", "8-thr CPU us/call", 1.0, True),
]

QUICK = dict(rounds=3, blocks=3, noop_calls=600, noop_warmup=100, big_calls=20, big_warmup=3, thr_seconds=1.0,
             ser_rounds=3, ser_calls=300, pickler_calls=200, startup_runs=10, torch_import_runs=4)
FULL = dict(rounds=15, blocks=5, noop_calls=2000, noop_warmup=200, big_calls=50, big_warmup=5, thr_seconds=2.0,
            ser_rounds=6, ser_calls=1000, pickler_calls=500, startup_runs=20, torch_import_runs=8)


# -- worker processes ---------------------------------------------------------------------
class Worker:
    def __init__(self, config: str, rank: int, init_file: str, tmp: str):
        env = {k: v for k, v in os.environ.items()
               if not (k.startswith("RPC_OBSERVE") or k.startswith("OTEL_"))}
        env.update(ENVS[config])
        env.update(EXTRA_ENV.get(config, {}))
        env["RPC_OBSERVE_DIR"] = os.path.join(tmp, f"out-{config}")
        env["BENCH_SITE_DIRS"] = os.pathsep.join(site_dirs())
        env["BENCH_TRANSPORT"] = TRANSPORT[0]
        env.setdefault("PYTHONUNBUFFERED", "1")
        cmd = [sys.executable] + (["-S"] if config in NO_SITE else []) + [WORKER, config, str(rank), init_file]
        self.config, self.rank = config, rank
        self.log_path = os.path.join(tmp, f"worker-{config}-{rank}-{os.path.basename(init_file)}.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     env=env, text=True, bufsize=1, cwd=tmp)
        self.ready: dict | None = None

    def send(self, cmd: str, **kwargs) -> None:
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kwargs}) + "\n")
        self.proc.stdin.flush()

    def recv(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(5)
            raise RuntimeError(f"worker {self.config}/{self.rank} died (rc={self.proc.returncode}); "
                               f"log {self.log_path}:\n{tail(self.log_path)}")
        msg = json.loads(line)
        if msg.get("ok") is False:
            raise RuntimeError(f"worker {self.config}/{self.rank}: {msg['error']}\n{tail(self.log_path)}")
        return msg

    def call(self, cmd: str, **kwargs):
        self.send(cmd, **kwargs)
        return self.recv().get("result")

    @property
    def pid(self) -> int:
        return self.proc.pid


def tail(path: str, n: int = 30) -> str:
    try:
        with open(path) as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def site_dirs() -> list[str]:
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        dirs.append(site.getusersitepackages())
    return dirs


class Pair:
    started = 0
    def __init__(self, config: str, tmp: str):
        Pair.started += 1
        init_file = os.path.join(tmp, f"init-{config}-{Pair.started}")  # a fresh file:// rendezvous
        self.config = config
        self.caller = Worker(config, 0, init_file, tmp)
        self.callee = Worker(config, 1, init_file, tmp)

    def wait_ready(self) -> None:
        for w in (self.caller, self.callee):
            w.ready = w.recv()

    # TensorPipe's shm transport has a reactor thread (TP_SHM_reactor) that busy-polls:
    # ~50% of a core per process even when no RPC is in flight. Ten idle workers would
    # fill both cores, so every pair but the one being measured is kept SIGSTOPped.
    def pause(self) -> None:
        for w in (self.caller, self.callee):
            os.kill(w.pid, signal.SIGSTOP)

    def resume(self) -> None:
        for w in (self.caller, self.callee):
            os.kill(w.pid, signal.SIGCONT)

    def call(self, cmd: str, **kwargs):
        """Runs one command on the caller, with this pair (only) running."""
        self.resume()
        try:
            return self.caller.call(cmd, **kwargs)
        finally:
            self.pause()

    def shutdown(self) -> dict:
        self.resume()
        for w in (self.caller, self.callee):
            w.send("shutdown")
        out = {}
        for w in (self.caller, self.callee):
            try:
                out[w.rank] = w.recv()
                w.proc.wait(30)
            except Exception as e:  # noqa: BLE001
                out[w.rank] = {"error": str(e)}
                w.proc.kill()
        return out

    def kill(self) -> None:
        for w in (self.caller, self.callee):
            if w.proc.poll() is None:
                w.proc.kill()


def start_pairs(configs: list[str], tmp: str) -> dict[str, Pair]:
    t0 = time.perf_counter()
    pairs = {c: Pair(c, tmp) for c in configs}
    for p in pairs.values():
        p.wait_ready()
    print(f"started {2 * len(pairs)} worker processes in {time.perf_counter() - t0:.1f}s", flush=True)
    for c, p in pairs.items():
        st = p.caller.ready["state"]
        print(f"  {c:>2}: pids {p.caller.pid}/{p.callee.pid} rpc_observe imported={st['rpc_observe_imported']} "
              f"patched={st['invoke_rpc_patched']} no_site={st['no_site']} runtime={st.get('runtime')}", flush=True)
    return pairs


# -- statistics ---------------------------------------------------------------------------
def quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    k = (len(values) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "q1": quantile(values, 0.25), "q3": quantile(values, 0.75), "n": len(values)}


# -- latency / throughput rounds ---------------------------------------------------------------
_TICK_US = 1e6 / os.sysconf("SC_CLK_TCK")


def cpu_us(pid: int) -> float:
    """utime + stime of a process (all its threads, live and exited), in microseconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_US


def measure(pair: Pair, step: str, kwargs: dict) -> tuple[dict, float]:
    """One command on the caller; also the CPU time the caller and callee used for it."""
    before = cpu_us(pair.caller.pid) + cpu_us(pair.callee.pid)
    res = pair.call(step, **kwargs)
    return res, cpu_us(pair.caller.pid) + cpu_us(pair.callee.pid) - before


def run_rounds(pairs: dict[str, Pair], configs: list[str], p: dict, rotate: bool) -> dict:
    """Each round: every metric for every config, in blocks interleaved across configs.

    A block is short (about 0.1-0.5 s), so the configs of one round see the same
    machine weather; the blocks of one config in a round are pooled.
    """
    blocks = p["blocks"]
    per_round: dict[str, dict[str, list]] = {c: {m: [] for m, *_ in METRICS} for c in configs}
    raw: dict[str, list] = {c: [] for c in configs}
    steps = [
        ("noop", dict(n=p["noop_calls"] // blocks, warmup=max(10, p["noop_warmup"] // blocks), raw=True)),
        ("big", dict(n=max(2, p["big_calls"] // blocks), warmup=1, raw=True)),
        ("thr", dict(threads=8, seconds=p["thr_seconds"] / blocks, warmup_s=0.1)),
    ]
    for r in range(p["rounds"]):
        t0 = time.perf_counter()
        order = configs[r % len(configs):] + configs[:r % len(configs)] if rotate else configs
        got = {c: {"noop": [], "big": [], "thr": [], "noop_cpu": 0.0, "thr_cpu": 0.0, "profiler_rpc_events": None}
               for c in configs}
        for step, kwargs in steps:  # each metric across all configs, back to back, block by block
            for _b in range(blocks):
                for c in order:
                    res, cpu = measure(pairs[c], step, kwargs)
                    g = got[c]
                    if step == "thr":
                        g["thr"].append((res["calls"], res["seconds"]))
                        g["thr_cpu"] += cpu
                    else:
                        g[step].extend(res["lat_us"])
                        if step == "noop":
                            g["noop_cpu"] += cpu
                            g["profiler_rpc_events"] = res.get("profiler_rpc_events")
        row = {}
        for c in configs:
            g = got[c]
            calls = sum(n for n, _ in g["thr"])
            row[c] = {
                "noop_p50": quantile(g["noop"], 0.5), "noop_p99": quantile(g["noop"], 0.99),
                "big_p50": quantile(g["big"], 0.5),
                "thr": calls / sum(t for _, t in g["thr"]),
                # CPU per call: the commands' warm-up calls are included in the CPU time.
                "noop_cpu": g["noop_cpu"] / (len(g["noop"]) + blocks * steps[0][1]["warmup"]),
                "thr_cpu": g["thr_cpu"] / calls if calls else float("nan"),
            }
            for m, *_ in METRICS:
                per_round[c][m].append(row[c][m])
            raw[c].append({"profiler_rpc_events": g["profiler_rpc_events"], **row[c]})
        line = "  ".join(f"{c}:{row[c]['noop_p50']:.0f}us/{row[c]['big_p50'] / 1e3:.2f}ms/"
                         f"{row[c]['thr']:.0f}/s" for c in configs)
        print(f"round {r + 1}/{p['rounds']} ({time.perf_counter() - t0:.1f}s): {line}", flush=True)
    result = {"per_round": per_round, "raw": raw, "summary": {}, "ratio_to_a": {}, "ratio_to_pooled": {}}
    pooled = {m: [(x + y) / 2 for x, y in zip(per_round["a"][m], per_round["a2"][m])] if "a2" in configs
              else per_round["a"][m] for m, *_ in METRICS}
    for c in configs:
        result["summary"][c] = {m: summary(per_round[c][m]) for m, *_ in METRICS}
        result["ratio_to_a"][c] = {
            m: summary([x / y for x, y in zip(per_round[c][m], per_round["a"][m])]) for m, *_ in METRICS}
        result["ratio_to_pooled"][c] = {
            m: summary([x / y for x, y in zip(per_round[c][m], pooled[m])]) for m, *_ in METRICS}
    targets = []
    for c, m, op, limit in TARGETS:
        if c not in configs:
            continue
        ratio = result["ratio_to_a"][c][m]["median"]
        ok = ratio <= limit if op == "<=" else ratio >= limit
        noise = result["ratio_to_a"].get("a2", {}).get(m)
        pooled_ratio = result["ratio_to_pooled"][c][m]["median"]
        targets.append({"config": c, "metric": m, "target": f"{op} {limit}", "ratio": ratio,
                        "pooled_ratio": pooled_ratio,
                        "pooled_pass": pooled_ratio <= limit if op == "<=" else pooled_ratio >= limit,
                        "ratio_iqr": [result["ratio_to_a"][c][m]["q1"], result["ratio_to_a"][c][m]["q3"]],
                        "a2_ratio": noise["median"] if noise else None,
                        "a2_iqr": [noise["q1"], noise["q3"]] if noise else None,
                        "pass": ok})
    result["targets"] = targets
    return result


def print_rounds(res: dict, configs: list[str]) -> str:
    lines = []
    head = f"| {'config':<42} |" + "".join(f" {title:>26} |" for _, title, _, _ in METRICS)
    lines.append(head)
    lines.append("|" + "-" * 44 + "|" + "".join("-" * 28 + "|" for _ in METRICS))
    for c in configs:
        row = f"| {LABELS[c]:<42} |"
        for m, _, scale, _ in METRICS:
            s = res["summary"][c][m]
            row += f" {fmt(s['median'] * scale)} [{fmt(s['min'] * scale)}-{fmt(s['max'] * scale)}] |".rjust(28)
        lines.append(row)
    lines.append("")
    lines.append("Ratio to (a), per round then median [IQR]:")
    lines.append("")
    lines.append(f"| {'config':<42} |" + "".join(f" {title:>26} |" for _, title, _, _ in METRICS))
    lines.append("|" + "-" * 44 + "|" + "".join("-" * 28 + "|" for _ in METRICS))
    for c in configs:
        row = f"| {LABELS[c]:<42} |"
        for m, *_ in METRICS:
            s = res["ratio_to_a"][c][m]
            row += f" {s['median']:.3f} [{s['q1']:.3f}-{s['q3']:.3f}] |".rjust(28)
        lines.append(row)
    lines.append("")
    lines.append("| target | ratio to (a): median | IQR | result | A/A control (a2)/(a): median [IQR] | "
                 "ratio to mean of (a),(a2): median | result |")
    lines.append("|---|---|---|---|---|---|---|")
    for t in res["targets"]:
        noise = (f"{t['a2_ratio']:.3f} [{t['a2_iqr'][0]:.3f}-{t['a2_iqr'][1]:.3f}]" if t["a2_ratio"] is not None
                 else "-")
        lines.append(f"| ({t['config']}) {t['metric']} {t['target']} | {t['ratio']:.3f} | "
                     f"{t['ratio_iqr'][0]:.3f}-{t['ratio_iqr'][1]:.3f} | {'PASS' if t['pass'] else 'FAIL'} | {noise} | "
                     f"{t['pooled_ratio']:.3f} | {'PASS' if t['pooled_pass'] else 'FAIL'} |")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def fmt(x: float) -> str:
    if x >= 1000:
        return f"{x:.0f}"
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


# -- serialization scaling -------------------------------------------------------------------
def run_serialization(pairs: dict[str, Pair], p: dict) -> tuple[dict, str]:
    """(c) vs (a) for payloads of 1/8/64 small tensors and 1 tensor of 4 KB / 4 MB.

    The baseline is the mean of (a) and (a2) when the control pair runs: one process's
    allocator state moves the 4 MB case by +-30% (page faults per call vary 1-280).
    """
    base = ["a", "a2"] if "a2" in pairs else ["a"]
    rounds: dict[str, list] = {c: [] for c in base + ["c"]}
    for r in range(p["ser_rounds"]):
        for c in base + ["c"]:
            rounds[c].append(pairs[c].call("ser", n=p["ser_calls"], warmup=p["ser_calls"] // 10))
        print(f"serialization round {r + 1}/{p['ser_rounds']}", flush=True)
    cases = list(rounds["a"][0])
    table = {}
    for case in cases:
        a = [statistics.fmean(rounds[b][i][case]["p50_us"] for b in base) for i in range(len(rounds["a"]))]
        c = [x[case]["p50_us"] for x in rounds["c"]]
        diff = [y - x for x, y in zip(a, c)]
        table[case] = {"a_p50_us": summary(a), "c_p50_us": summary(c), "added_us": summary(diff)}
    micro = pairs["c"].call("pickler", n=p["pickler_calls"])
    lines = [f"| payload (args, echoed back) | ({'+'.join(base)}) p50 us | (c) p50 us | (c)-base per round, median [IQR] us | "
             "pickler only: torch ser+deser us | wrapped us | added us |",
             "|---|---|---|---|---|---|---|"]
    for case in cases:
        t, m = table[case], micro[case]
        lines.append(f"| {case} | {t['a_p50_us']['median']:.0f} | {t['c_p50_us']['median']:.0f} | "
                     f"{t['added_us']['median']:+.1f} [{t['added_us']['q1']:+.1f} .. {t['added_us']['q3']:+.1f}] | "
                     f"{m['torch_us']:.1f} | {m['wrapped_us']:.1f} | {m['added_us']:+.2f} |")
    text = "\n".join(lines)
    print(text, flush=True)
    return {"per_round": rounds, "summary": table, "pickler_micro": micro}, text


# -- memory ---------------------------------------------------------------------------------
MEM_CALLS = 100_000


def run_memory(pairs: dict[str, Pair], sample_every: int = 10_000) -> tuple[dict, str]:
    out = {}
    for c in ("a", "d"):
        t0 = time.perf_counter()
        out[c] = pairs[c].call("memory", calls=MEM_CALLS, sample_every=sample_every)
        print(f"memory {c}: {MEM_CALLS} no-op RPCs in {time.perf_counter() - t0:.0f}s", flush=True)
    mb = 1 / (1 << 20)
    lines = ["| config | process | RSS at 0 MB | RSS at 50k MB | RSS at 100k MB | 100k-0 MB | 100k-50k MB | "
             "VmHWM at 100k MB |", "|---|---|---|---|---|---|---|---|"]
    growth = {}
    for c in ("a", "d"):
        s = {x["calls"]: x for x in out[c]["samples"]}
        for proc in ("caller", "callee"):
            r0, r50, r100 = (s[k][proc]["VmRSS"] for k in (0, 50_000, 100_000))
            hwm = s[100_000][proc]["VmHWM"]
            growth[(c, proc)] = {"rss0": r0, "rss50k": r50, "rss100k": r100, "hwm": hwm,
                                 "growth_0_100k": r100 - r0, "growth_50k_100k": r100 - r50}
            lines.append(f"| {c} | {proc} | {r0 * mb:.1f} | {r50 * mb:.1f} | {r100 * mb:.1f} | "
                         f"{(r100 - r0) * mb:+.1f} | {(r100 - r50) * mb:+.1f} | {hwm * mb:.1f} |")
    checks = []
    for proc in ("caller", "callee"):
        d, a = growth[("d", proc)], growth[("a", proc)]
        extra_peak = d["hwm"] - a["hwm"]
        extra_growth = d["growth_0_100k"] - a["growth_0_100k"]
        checks.append({"process": proc, "peak_d_minus_a_MB": extra_peak * mb,
                       "growth_d_minus_a_MB": extra_growth * mb, "growth_ok": extra_growth * mb < 50,
                       "d_100k_minus_50k_MB": d["growth_50k_100k"] * mb,
                       "steady_ok": abs(d["growth_50k_100k"]) * mb <= 4.0})
    lines.append("")
    lines.append("| process | peak RSS (d)-(a) MB | growth over 100k (d)-(a) MB (< 50) | (d) RSS 100k-50k MB (|x| <= 4) | result |")
    lines.append("|---|---|---|---|---|")
    for ch in checks:
        ok = ch["growth_ok"] and ch["steady_ok"]
        lines.append(f"| {ch['process']} | {ch['peak_d_minus_a_MB']:+.1f} | {ch['growth_d_minus_a_MB']:+.1f} | "
                     f"{ch['d_100k_minus_50k_MB']:+.1f} | {'PASS' if ok else 'FAIL'} |")
    text = "\n".join(lines)
    print(text, flush=True)
    return {"raw": out, "summary": {f"{c}/{p}": v for (c, p), v in growth.items()}, "checks": checks}, text


# -- interpreter start-up ----------------------------------------------------------------------

def _time_commands(variants: dict[str, list[str]], runs: int, env: dict) -> dict[str, list[float]]:
    """Wall time (ms) of each command, interleaved run by run, after one untimed warm-up each."""
    times: dict[str, list[float]] = {k: [] for k in variants}
    for cmd in variants.values():  # warm the page cache
        subprocess.run(cmd, env=env, check=True)
    for _ in range(runs):
        for name, cmd in variants.items():
            s = time.perf_counter()
            subprocess.run(cmd, env=env, check=True)
            times[name].append((time.perf_counter() - s) * 1e3)
    return times

def run_startup(runs: int, torch_runs: int) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if not (k.startswith("RPC_OBSERVE") or k.startswith("OTEL_"))}
    env["BENCH_SITE_DIRS"] = os.pathsep.join(site_dirs())
    add_site = "import os,sys; sys.path += os.environ['BENCH_SITE_DIRS'].split(os.pathsep); "
    # Process-level variants; each is run `runs` times, interleaved.
    skip_ours = ("import site; _a = site.addpackage; "
                 "site.addpackage = lambda d, n, k: None if n == 'rpc_observe.pth' else _a(d, n, k); site.main()")
    keep_ours = ("import site; _a = site.addpackage; "
                 "site.addpackage = lambda d, n, k: None if n == 'no-such.pth' else _a(d, n, k); site.main()")
    variants = {
        "a: python -S -c pass": [sys.executable, "-S", "-c", "pass"],
        "b: python -c pass": [sys.executable, "-c", "pass"],
        "site.main() skipping rpc_observe.pth": [sys.executable, "-S", "-c", skip_ours],
        "site.main() with rpc_observe.pth": [sys.executable, "-S", "-c", keep_ours],
    }
    times = _time_commands(variants, runs, env)
    times.update(_time_commands({
        "a: python -S, import torch": [sys.executable, "-S", "-c", add_site + "import torch"],
        "b: python, import torch": [sys.executable, "-c", "import torch"],
    }, torch_runs, env))
    # In-process: the .pth line itself, as site.py executes it (exec of the line).
    pth = os.path.join(next(d for d in site_dirs() if os.path.exists(os.path.join(d, "rpc_observe.pth"))),
                       "rpc_observe.pth")
    with open(pth) as f:
        line = f.read().strip()
    code = compile(line, pth, "exec")
    import timeit

    n = 20000
    saved = os.environ.pop("RPC_OBSERVE", None)
    try:
        per_exec_us = min(timeit.repeat(lambda: exec(code, {}), number=n, repeat=5)) / n * 1e6
    finally:
        if saved is not None:
            os.environ["RPC_OBSERVE"] = saved
    imported = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], env=env,
                              capture_output=True, text=True).stderr
    rpc_observe_imported_at_start = "rpc_observe" in imported
    res = {"ms": {k: summary(v) for k, v in times.items()}, "pth_line_exec_us": per_exec_us,
           "pth_line": line, "rpc_observe_imported_at_startup": rpc_observe_imported_at_start, "runs": runs}
    lines = ["| interpreter start | median ms | min ms | max ms |", "|---|---|---|---|"]
    for k, s in res["ms"].items():
        lines.append(f"| {k} | {s['median']:.1f} | {s['min']:.1f} | {s['max']:.1f} |")
    d_site = res["ms"]["b: python -c pass"]["median"] - res["ms"]["a: python -S -c pass"]["median"]
    d_ours = (res["ms"]["site.main() with rpc_observe.pth"]["median"]
              - res["ms"]["site.main() skipping rpc_observe.pth"]["median"])
    lines.append("")
    lines.append(f"all site processing (b)-(a): {d_site:+.1f} ms; rpc_observe.pth alone (with-skipping): "
                 f"{d_ours:+.2f} ms; the .pth line executed in-process: {per_exec_us:.2f} us; "
                 f"rpc_observe imported at start-up with RPC_OBSERVE unset: {rpc_observe_imported_at_start}")
    res["site_processing_ms"], res["rpc_observe_pth_ms"] = d_site, d_ours
    text = "\n".join(lines)
    print(text, flush=True)
    return res, text


# -- profiling of (d) ---------------------------------------------------------------------------
def run_profile(pairs: dict[str, Pair], py_spy: str | None, tmp: str, seconds: float) -> tuple[dict, str]:
    """Where the time of (c)/(d) goes, against (a): five views, cheapest first."""
    out: dict = {}
    texts = []
    # 1. Per no-op RPC: context switches and user/sys CPU of caller and callee (no tool needed).
    rows = []
    for rep in range(3):
        for c in ("a", "c", "d"):
            pr = pairs[c]
            pr.resume()
            before = {r: proc_counters(w.pid) for r, w in (("caller", pr.caller), ("callee", pr.callee))}
            res = pr.caller.call("noop", n=2000, warmup=0)
            after = {r: proc_counters(w.pid) for r, w in (("caller", pr.caller), ("callee", pr.callee))}
            pr.pause()
            row = {"config": c, "rep": rep, "p50_us": res["p50_us"]}
            for r in before:
                for k in before[r]:
                    row[f"{r}_{k}"] = (after[r][k] - before[r][k]) / 2000
            rows.append(row)
    out["per_call_counters"] = rows
    lines = ["Per no-op RPC (2000 calls, median of 3 reps): context switches and CPU of each process",
             "| config | p50 us | caller vol. cs | caller invol. cs | caller user us | caller sys us | "
             "callee vol. cs | callee invol. cs | callee user us | callee sys us |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c in ("a", "c", "d"):
        rs = [r for r in rows if r["config"] == c]
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k not in ("config", "rep")}
        lines.append(f"| {c} | {med['p50_us']:.0f} | " + " | ".join(
            f"{med[f'{r}_{k}']:.2f}" if k.endswith("cs") else f"{med[f'{r}_{k}']:.0f}"
            for r in ("caller", "callee") for k in ("vcs", "nvcs", "user_us", "sys_us")) + " |")
    texts.append("\n".join(lines))
    # 2. In situ: each wrapper's own time per no-op RPC, on the thread that runs it (pairs c_t, d_t:
    #    (c), (d) with the worker's self-timer, which adds its own ~1-2 us per wrapper).
    for c in ("c", "d"):
        pr = pairs[c + "_t"]
        pr.resume()
        res = [pr.caller.call("selftime", n=3000) for _ in range(3)]
        pr.pause()
        out[f"selftime {c}"] = res
        lines = [f"rpc_observe's own time per no-op RPC in ({c}), in situ, us (median per call; median of 3 x 3000):",
                 "| process | wrapper @ thread | median us | mean us |", "|---|---|---|---|"]
        totals = {}
        for role in ("caller", "callee"):
            for key in sorted(res[0][role]):
                med = statistics.median(r[role][key]["median_us"] for r in res if key in r[role])
                mean = statistics.median(r[role][key]["mean_us"] for r in res if key in r[role])
                totals[role] = totals.get(role, 0.0) + med
                lines.append(f"| {role} | {key} | {med:.1f} | {mean:.1f} |")
        lines.append(f"| both | sum of medians | {sum(totals.values()):.1f} | |")
        texts.append("\n".join(lines))
    # 3. perf (if installed): CPU per RPC by shared object, (a) vs (d).
    perf = shutil.which("perf")
    if perf:
        per_dso = {}
        for c in ("a", "d"):
            pr = pairs[c]
            pr.resume()
            datas = {}
            procs = []
            for role, w in (("caller", pr.caller), ("callee", pr.callee)):
                datas[role] = os.path.join(tmp, f"perf-{c}-{role}.data")
                procs.append(subprocess.Popen([perf, "record", "-e", "cpu-clock", "-F", "1000", "-p", str(w.pid),
                                               "-o", datas[role], "--", "sleep", str(int(seconds))],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            time.sleep(0.3)
            calls = pr.caller.call("loop", seconds=seconds - 0.6)["calls"]
            for pp in procs:
                pp.wait(60)
            pr.pause()
            for role, data in datas.items():
                rep = subprocess.run([perf, "report", "-i", data, "--sort", "dso", "-g", "none", "--stdio",
                                      "-F", "sample,dso"], capture_output=True, text=True).stdout
                for line in rep.splitlines():
                    parts = line.split()
                    if len(parts) == 2 and parts[0].isdigit():
                        # 1000 Hz: one sample is 1000 us of CPU
                        per_dso.setdefault((role, parts[1]), {})[c] = int(parts[0]) * 1000 / calls
        out["perf_us_per_call"] = {f"{r}|{d}": v for (r, d), v in per_dso.items()}
        lines = ["perf (cpu-clock, 1000 Hz) CPU per no-op RPC by shared object, us (a) vs (d):",
                 "| process | shared object | (a) | (d) | (d)-(a) |", "|---|---|---|---|---|"]
        for (role, dso), v in sorted(per_dso.items(), key=lambda kv: -(kv[1].get("d", 0) - kv[1].get("a", 0))):
            if max(v.values()) >= 3:
                lines.append(f"| {role} | {dso} | {v.get('a', 0):.0f} | {v.get('d', 0):.0f} | "
                             f"{v.get('d', 0) - v.get('a', 0):+.0f} |")
        texts.append("\n".join(lines))
    # 4. py-spy: share of samples in rpc_observe functions, (d) caller and callee.
    d = pairs["d"]
    d.resume()
    if py_spy:
        raws = {}
        procs = []
        for role, w in (("caller", d.caller), ("callee", d.callee)):
            path = os.path.join(tmp, f"pyspy-d-{role}.txt")
            raws[role] = path
            procs.append(subprocess.Popen([py_spy, "record", "--pid", str(w.pid), "--duration", str(int(seconds)),
                                           "--rate", "250", "--format", "raw", "--threads", "--nonblocking",
                                           "-o", path], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        time.sleep(1.0)
        d.caller.call("loop", seconds=seconds - 1.5)
        for pr in procs:
            pr.wait(60)
        for role, path in raws.items():
            if not os.path.exists(path):
                continue
            res = analyse_collapsed(path)
            out[f"py-spy {role}"] = res
            texts.append(format_profile(f"py-spy (250 Hz, non-blocking), (d) {role}", res))
    # 5. cProfile of the caller's main thread.
    prof_path = os.path.join(tmp, "cprofile-d-caller.prof")
    d.caller.call("cprofile", n=3000, out=prof_path)
    d.pause()
    out["cprofile caller"] = cprofile_summary(prof_path)
    texts.append(out["cprofile caller"]["text"])
    text = "\n\n".join(texts)
    print(text, flush=True)
    return out, text


def proc_counters(pid: int) -> dict:
    """Context switches (all live threads) and user/sys CPU (whole process) of a process."""
    vcs = nvcs = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches"):
                        vcs += int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches"):
                        nvcs += int(line.split()[1])
        except OSError:
            pass
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return {"vcs": vcs, "nvcs": nvcs, "user_us": int(fields[11]) * _TICK_US, "sys_us": int(fields[12]) * _TICK_US}


def analyse_collapsed(path: str) -> dict:
    """Inclusive share of samples per rpc_observe function, over the threads doing RPC work."""
    total = 0
    busy = 0
    incl: dict[str, int] = {}
    self_: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            n = int(count)
            frames = stack.split(";")
            total += n
            leaf = frames[-1]
            idle = any(x in leaf for x in ("wait (threading.py", "select", "epoll", "sleep", "readline",
                                           "_wait_for_tstate_lock", "wait (rpc_observe", "(<built-in>)"))
            if idle and not any("rpc_observe" in fr for fr in frames):
                continue
            busy += n
            seen = set()
            for fr in frames:
                if "rpc_observe/" in fr or "rpc_observe\\" in fr:
                    key = short_frame(fr)
                    if key not in seen:
                        incl[key] = incl.get(key, 0) + n
                        seen.add(key)
            if "rpc_observe/" in leaf:
                key = short_frame(leaf)
                self_[key] = self_.get(key, 0) + n
    top = sorted(incl.items(), key=lambda kv: -kv[1])[:20]
    return {"samples": total, "busy_samples": busy,
            "inclusive": [(k, v, v / busy * 100 if busy else 0) for k, v in top],
            "self": sorted(((k, v, v / busy * 100 if busy else 0) for k, v in self_.items()), key=lambda x: -x[1])[:15]}


def short_frame(frame: str) -> str:
    # py-spy raw frames look like "func (path/to/file.py:123)"
    name, _, loc = frame.partition(" (")
    loc = loc.rstrip(")")
    file = loc.rsplit(":", 1)[0]
    file = file[file.find("rpc_observe/"):] if "rpc_observe/" in file else os.path.basename(file)
    return f"{file}:{name}"


def format_profile(title: str, res: dict) -> str:
    lines = [f"{title}: {res['busy_samples']} busy samples of {res['samples']}",
             "| rpc_observe function (inclusive) | samples | % of busy |", "|---|---|---|"]
    lines += [f"| {k} | {v} | {p:.1f} |" for k, v, p in res["inclusive"]]
    lines += ["", "| rpc_observe function (self) | samples | % of busy |", "|---|---|---|"]
    lines += [f"| {k} | {v} | {p:.1f} |" for k, v, p in res["self"]]
    return "\n".join(lines)


def cprofile_summary(path: str) -> dict:
    import pstats

    st = pstats.Stats(path)
    total = st.total_tt
    rows = []
    for (file, line, name), (cc, nc, tt, ct, callers) in st.stats.items():
        if "rpc_observe" in file:
            rows.append((f"{file[file.find('rpc_observe/'):]}:{name}", nc, tt * 1e6 / 3000, ct * 1e6 / 3000,
                         ct / total * 100))
    rows.sort(key=lambda r: -r[3])
    lines = [f"cProfile of 3000 no-op rpc_sync on the (d) caller's thread (total {total * 1e6 / 3000:.0f} us/call "
             f"under cProfile)", "| function | calls | self us/RPC | cumulative us/RPC | % of caller thread |",
             "|---|---|---|---|---|"]
    lines += [f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:.1f} |" for r in rows[:20]]
    return {"rows": rows, "total_s": total, "text": "\n".join(lines)}


# -- main ---------------------------------------------------------------------------------------
def machine() -> dict:
    info = {"cores": os.cpu_count(), "python": sys.version.split()[0], "platform": platform.platform()}
    try:
        import torch

        info["torch"] = torch.__version__
    except Exception:  # noqa: BLE001
        pass
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    try:
        info["loadavg_start"] = open("/proc/loadavg").read().split()[:3]
        info["git_head"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                          text=True).stdout.strip()
        info["rpc_observe_dirty"] = bool(subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "rpc_observe"],
                                                        capture_output=True, text=True).stdout.strip())
    except Exception:  # noqa: BLE001
        pass
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="< 2 minutes: fewer rounds and calls, no memory section")
    ap.add_argument("--memory", action="store_true", help="only the memory section (pairs a and d)")
    ap.add_argument("--profile", action="store_true", help="only profile config (d) (py-spy if --py-spy, cProfile)")
    ap.add_argument("--py-spy", default=shutil.which("py-spy") or (
        "/tmp/h6venv/bin/py-spy" if os.path.exists("/tmp/h6venv/bin/py-spy") else None))
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
    ap.add_argument("--out", help="JSON path (default benchmarks/results/overhead-<date>[-quick].json)")
    args = ap.parse_args()

    p = dict(QUICK if args.quick else FULL)
    for k in ("rounds", "noop_calls", "big_calls", "thr_seconds"):
        if getattr(args, k) is not None:
            p[k] = getattr(args, k)
    mode = "memory" if args.memory else "profile" if args.profile else "quick" if args.quick else "full"
    TRANSPORT[0] = args.transport
    if mode == "memory":
        configs = ["a", "d"]
    elif mode == "profile":
        configs = ["a", "c", "d", "c_t", "d_t"]
    else:
        configs = (["a", "b", "c", "d", "e"] + ([] if args.no_control else ["a2"])
                   + (["ap"] if args.profiler_baseline else []))
    started = time.perf_counter()
    stamp = _dt.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    report: dict = {"mode": mode, "command": " ".join(["python"] + [os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
                    "date": stamp, "machine": machine(), "params": p, "configs": {c: LABELS[c] for c in configs},
                    "env": {c: ENVS[c] for c in configs}, "transport": args.transport,
                    "order": "fixed" if args.fixed_order else "rotating"}
    texts = []
    tmp = tempfile.mkdtemp(prefix="rpc_observe_bench_")
    pairs: dict[str, Pair] = {}
    try:
        pairs = start_pairs(configs, tmp)
        report["workers"] = {c: {"caller": pr.caller.ready, "callee": pr.callee.ready} for c, pr in pairs.items()}
        for c, pr in pairs.items():  # one-time warm-up of every pair, then all paused
            pr.caller.call("noop", n=300, warmup=0)
            pr.caller.call("big", n=5, warmup=0)
            pr.caller.call("thr", threads=8, seconds=0.3)
            pr.pause()
        if mode in ("quick", "full"):
            res = run_rounds(pairs, configs, p, not args.fixed_order)
            report["rounds"] = res
            texts.append(print_rounds(res, configs))
            if not args.no_serialization:
                res, text = run_serialization(pairs, p)
                report["serialization"] = res
                texts.append(text)
        if mode == "full" and not args.no_memory:  # fresh (a) and (d) pairs: peak RSS without the rounds' history
            report["shutdown"] = {c: pr.shutdown() for c, pr in pairs.items()}
            pairs = start_pairs(["a", "d"], tmp)
            for pr in pairs.values():
                pr.pause()
        if mode == "memory" or (mode == "full" and not args.no_memory):
            res, text = run_memory(pairs)
            report["memory"] = res
            texts.append(text)
        if mode == "profile":
            res, text = run_profile(pairs, args.py_spy, tmp, args.profile_seconds)
            report["profile"] = res
            texts.append(text)
        # Sanity: what the instrumented workers produced.
        for c in configs:
            out_dir = os.path.join(tmp, f"out-{c}", "spans")
            if os.path.isdir(out_dir):
                n_lines = sum(sum(1 for _ in open(os.path.join(out_dir, f))) for f in os.listdir(out_dir))
                report.setdefault("span_files", {})[c] = {"files": len(os.listdir(out_dir)), "export_lines": n_lines}
        report.setdefault("shutdown", {}).update({c: pr.shutdown() for c, pr in pairs.items()})
        pairs = {}
        if mode in ("quick", "full") and not args.no_startup:
            res, text = run_startup(p["startup_runs"], p["torch_import_runs"])
            report["startup"] = res
            texts.append(text)
    finally:
        for pr in pairs.values():
            pr.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    report["elapsed_s"] = time.perf_counter() - started
    report["machine"]["loadavg_end"] = open("/proc/loadavg").read().split()[:3]
    report["text"] = "\n\n".join(texts)
    os.makedirs(RESULTS, exist_ok=True)
    path = args.out or os.path.join(RESULTS, f"overhead-{stamp}{'' if mode == 'full' else '-' + mode}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"\n{mode} run took {report['elapsed_s']:.0f}s; results: {os.path.relpath(path, os.getcwd())}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
