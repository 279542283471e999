"""The measured sections: latency/throughput rounds, serialization scaling, memory, start-up.

Each `run_*` returns the section's results (what goes into the JSON); the tables are
bench.report's. Progress lines are printed as the section goes.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
import timeit
from typing import Any

from bench.pairs import Pair, clean_env, cpu_us, site_dirs
from bench.stats import evaluate_targets, quantile, summarise_rounds, summary

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
METRIC_KEYS = [m for m, *_ in METRICS]

QUICK = dict(rounds=3, blocks=3, noop_calls=600, noop_warmup=100, big_calls=20, big_warmup=3, thr_seconds=1.0,
             ser_rounds=3, ser_calls=300, pickler_calls=200, startup_runs=10, torch_import_runs=4)
FULL = dict(rounds=15, blocks=5, noop_calls=2000, noop_warmup=200, big_calls=50, big_warmup=5, thr_seconds=2.0,
            ser_rounds=6, ser_calls=1000, pickler_calls=500, startup_runs=20, torch_import_runs=8)
MEM_CALLS = 100_000


# -- latency / throughput rounds ---------------------------------------------------------------
def measure(pair: Pair, step: str, kwargs: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """One command on the caller; also the CPU time the caller and callee used for it."""
    before = cpu_us(pair.caller.pid) + cpu_us(pair.callee.pid)
    res = pair.call(step, **kwargs)
    return res, cpu_us(pair.caller.pid) + cpu_us(pair.callee.pid) - before


def run_rounds(pairs: dict[str, Pair], configs: list[str], p: dict[str, Any], rotate: bool) -> dict[str, Any]:
    """Each round: every metric for every config, in blocks interleaved across configs.

    A block is short (about 0.1-0.5 s), so the configs of one round see the same
    machine weather; the blocks of one config in a round are pooled.
    """
    blocks = p["blocks"]
    per_round: dict[str, dict[str, list]] = {c: {m: [] for m in METRIC_KEYS} for c in configs}
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
            for m in METRIC_KEYS:
                per_round[c][m].append(row[c][m])
            raw[c].append({"profiler_rpc_events": g["profiler_rpc_events"], **row[c]})
        line = "  ".join(f"{c}:{row[c]['noop_p50']:.0f}us/{row[c]['big_p50'] / 1e3:.2f}ms/"
                         f"{row[c]['thr']:.0f}/s" for c in configs)
        print(f"round {r + 1}/{p['rounds']} ({time.perf_counter() - t0:.1f}s): {line}", flush=True)
    result: dict[str, Any] = {"per_round": per_round, "raw": raw, **summarise_rounds(per_round, configs, METRIC_KEYS)}
    result["targets"] = evaluate_targets(TARGETS, configs, result["ratio_to_a"], result["ratio_to_pooled"])
    return result


# -- serialization scaling -------------------------------------------------------------------
def run_serialization(pairs: dict[str, Pair], p: dict[str, Any]) -> dict[str, Any]:
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
    table = {}
    for case in rounds["a"][0]:
        a = [statistics.fmean(rounds[b][i][case]["p50_us"] for b in base) for i in range(len(rounds["a"]))]
        c = [x[case]["p50_us"] for x in rounds["c"]]
        diff = [y - x for x, y in zip(a, c, strict=True)]
        table[case] = {"a_p50_us": summary(a), "c_p50_us": summary(c), "added_us": summary(diff)}
    micro = pairs["c"].call("pickler", n=p["pickler_calls"])
    return {"per_round": rounds, "summary": table, "pickler_micro": micro}


# -- memory ---------------------------------------------------------------------------------
def run_memory(pairs: dict[str, Pair], sample_every: int = 10_000) -> dict[str, Any]:
    """MEM_CALLS no-op RPCs on (a) and (d); RSS of caller and callee every `sample_every` calls."""
    out = {}
    for c in ("a", "d"):
        t0 = time.perf_counter()
        out[c] = pairs[c].call("memory", calls=MEM_CALLS, sample_every=sample_every)
        print(f"memory {c}: {MEM_CALLS} no-op RPCs in {time.perf_counter() - t0:.0f}s", flush=True)
    mb = 1 / (1 << 20)
    growth = {}
    for c in ("a", "d"):
        s = {x["calls"]: x for x in out[c]["samples"]}
        for proc in ("caller", "callee"):
            r0, r50, r100 = (s[k][proc]["VmRSS"] for k in (0, 50_000, 100_000))
            growth[(c, proc)] = {"rss0": r0, "rss50k": r50, "rss100k": r100, "hwm": s[100_000][proc]["VmHWM"],
                                 "growth_0_100k": r100 - r0, "growth_50k_100k": r100 - r50}
    checks = []
    for proc in ("caller", "callee"):
        d, a = growth[("d", proc)], growth[("a", proc)]
        extra_peak = d["hwm"] - a["hwm"]
        extra_growth = d["growth_0_100k"] - a["growth_0_100k"]
        checks.append({"process": proc, "peak_d_minus_a_MB": extra_peak * mb,
                       "growth_d_minus_a_MB": extra_growth * mb, "growth_ok": extra_growth * mb < 50,
                       "d_100k_minus_50k_MB": d["growth_50k_100k"] * mb,
                       "steady_ok": abs(d["growth_50k_100k"]) * mb <= 4.0})
    return {"raw": out, "summary": {f"{c}/{p}": v for (c, p), v in growth.items()}, "checks": checks}


# -- interpreter start-up ----------------------------------------------------------------------
def _time_commands(variants: dict[str, list[str]], runs: int, env: dict[str, str]) -> dict[str, list[float]]:
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


def run_startup(runs: int, torch_runs: int) -> dict[str, Any]:
    """Interpreter start-up with and without site processing and rpc_observe.pth, and `import torch`."""
    env = clean_env()
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
    n = 20000
    saved = os.environ.pop("RPC_OBSERVE", None)
    try:
        per_exec_us = min(timeit.repeat(lambda: exec(code, {}), number=n, repeat=5)) / n * 1e6
    finally:
        if saved is not None:
            os.environ["RPC_OBSERVE"] = saved
    imported = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], env=env,
                              capture_output=True, text=True).stderr
    ms = {k: summary(v) for k, v in times.items()}
    return {"ms": ms, "pth_line_exec_us": per_exec_us, "pth_line": line,
            "rpc_observe_imported_at_startup": "rpc_observe" in imported, "runs": runs,
            "site_processing_ms": ms["b: python -c pass"]["median"] - ms["a: python -S -c pass"]["median"],
            "rpc_observe_pth_ms": (ms["site.main() with rpc_observe.pth"]["median"]
                                   - ms["site.main() skipping rpc_observe.pth"]["median"])}
