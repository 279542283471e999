"""The measured sections: latency/throughput rounds, server saturation, serialization scaling, memory, start-up.

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
from collections.abc import Callable
from typing import Any

from bench.pairs import Pair, clean_env, kill_all, shutdown_all, site_dirs, start_pairs
from bench.procstat import grouped, snapshot, window
from bench.stats import evaluate_targets, quantile, summarise_rounds, summary

# (config, metric, comparison, threshold) on the median of per-round ratios to (a). The first two
# and (d) 4 MB are issue 6's; the others this issue's (CPU: utime+stime of every process).
TARGETS = [
    ("b", "noop_p50", "<=", 1.01),
    ("c", "noop_p50", "<=", 1.03),
    ("c", "noop_cpu", "<=", 1.03),
    ("c", "thr_cpu", "<=", 1.03),
    ("c", "thr", ">=", 0.95),
    ("d", "noop_p50", "<=", 1.05),
    ("d", "noop_cpu", "<=", 1.06),
    ("d", "thr_cpu", "<=", 1.06),
    ("d", "thr", ">=", 0.90),
    ("d", "big_p50", "<=", 1.01),
    ("e", "noop_p50", "<=", 1.10),
]
SAT_TARGETS = [("d", "sat_rate", ">=", 0.90)]
VS_HANDWRITTEN_LIMIT = 0.25  # (d) added CPU per call <= 1/4 of (h)'s
METRICS = [  # key, title, unit scale, lower is better
    ("noop_p50", "no-op p50 us", 1.0, True),
    ("noop_p99", "no-op p99 us", 1.0, True),
    ("big_p50", "4MB p50 ms", 1e-3, True),
    ("thr", "8-thr calls/s", 1.0, False),
    ("noop_cpu", "no-op CPU us/call", 1.0, True),  # utime+stime of caller + callee over the timed calls
    ("thr_cpu", "8-thr CPU us/call", 1.0, True),
]
# CPU by process, and from /proc/<pid>/stat's utime+stime alone (clock ticks) as a cross-check
CPU_SPLIT = ["noop_cpu_caller", "noop_cpu_callee", "thr_cpu_caller", "thr_cpu_callee", "noop_cpu_window",
             "thr_cpu_window", "noop_cpu_stat", "thr_cpu_stat"]
METRIC_KEYS = [m for m, *_ in METRICS] + CPU_SPLIT
SAT_METRICS = [
    ("sat_rate", "server calls/s", 1.0, False),
    ("sat_server_cpu", "server CPU us/call", 1.0, True),
    ("sat_all_cpu", "all 5 processes CPU us/call", 1.0, True),
]
SAT_KEYS = [m for m, *_ in SAT_METRICS]
CPU_METRICS = ["noop_cpu", "thr_cpu", "sat_server_cpu", "sat_all_cpu"]  # compared with (h)

QUICK = dict(rounds=3, blocks=2, noop_calls=400, noop_warmup=60, big_calls=10, big_warmup=2, thr_seconds=0.8,
             sat_rounds=1, sat_blocks=2, sat_seconds=1.5, sat_warmup=0.5,
             ser_rounds=3, ser_calls=300, pickler_calls=200, startup_runs=10, torch_import_runs=4)
FULL = dict(rounds=8, blocks=4, noop_calls=1600, noop_warmup=160, big_calls=40, big_warmup=4, thr_seconds=2.0,
            sat_rounds=3, sat_blocks=2, sat_seconds=2.0, sat_warmup=0.5,
            ser_rounds=4, ser_calls=1000, pickler_calls=500, startup_runs=20, torch_import_runs=8)
MEM_CALLS = 100_000
SAT_CLIENTS, SAT_THREADS = 4, 4


def rotated(configs: list[str], r: int, rotate: bool) -> list[str]:
    k = r % len(configs) if rotate else 0
    return configs[k:] + configs[:k]


def warm_up(pairs: dict[str, Pair]) -> None:
    """A fresh pair's first calls are slow (allocations, caches): each pair runs some, then all are paused."""
    for pr in pairs.values():
        pr.pause()
    for pr in pairs.values():
        pr.resume()
        pr.caller.call("noop", n=200, warmup=0)
        pr.caller.call("big", n=3, warmup=0)
        pr.caller.call("thr", threads=8, seconds=0.2, warmup_s=0.1)
        pr.pause()


def thread_names(pr: Pair, w: Any) -> dict[str, str]:
    """The Python thread names of worker `w` of pair `pr` (resumed for the question)."""
    pr.resume()
    try:
        return w.call("threads")
    finally:
        pr.pause()


DRAIN_S = 1.2  # > the span exporters' 1 s schedule delay and the 0.1 s housekeeping period


def drained_snapshot(pairs: list[Pair]) -> list[list[dict[str, Any]]]:
    """All pairs resumed, idle, for DRAIN_S (the background threads export and fold what is queued),
    then paused; every process's and thread's CPU of each pair."""
    for pr in pairs:
        pr.resume()
    time.sleep(DRAIN_S)
    for pr in pairs:
        pr.pause()
    return [snapshot(pr.pids) for pr in pairs]


def is_background(group: str) -> bool:
    """Thread groups that work off the RPC path: rpc_observe's threads (housekeeping, span export, the
    metrics endpoint) and the OpenTelemetry SDK's batch processor; not torch's, not the benchmark's."""
    return (group.startswith(("rpc_observe-", "OtelBatch"))
            or (group.startswith("python: ") and not group.startswith("python: bench")))


class CpuAccount:
    """One config's CPU in one round, so that work moved off the RPC path is counted.

    The measured windows give each process's CPU and each thread's; threads off the RPC path
    (`is_background`) run on their own schedules (span export every 1 s, housekeeping every 0.1 s),
    so a short window catches their work for its calls only by chance (a paused pair exports at
    resume, before the window). Their share is therefore taken over the whole round instead (from
    a drained snapshot before the first block to one after the last, all of the round's calls
    between them): CPU per call = (window CPU - window background CPU) / window calls +
    round background CPU / round calls, per process."""

    def __init__(self, pids: list[int], steps: tuple[str, ...]) -> None:
        self.pids = pids
        self.win_us = {s: [0.0] * len(pids) for s in steps}
        self.win_threads: dict[str, list[list[dict[str, Any]]]] = {s: [[] for _ in pids] for s in steps}
        self.calls = {s: 0 for s in steps}
        self.calls_all = 0

    def add(self, step: str, cpu_us: list[float], thread_cpu: list[dict[str, Any]], calls: int) -> None:
        self.win_us[step] = [x + y for x, y in zip(self.win_us[step], cpu_us)]
        for i, d in enumerate(thread_cpu):
            self.win_threads[step][i].append(d)
        self.calls[step] += calls

    def finish(self, before: list[dict[str, Any]], after: list[dict[str, Any]],
               names: list[dict[str, str]]) -> dict[str, Any]:
        """Per step: CPU us per call of each process (as above), the windows' alone, and the thread groups
        of each process per call (foreground from the windows, background from the round)."""
        rnd = [grouped(w["threads"], pid, nm) for w, pid, nm in zip(window(before, after), self.pids, names)]
        bg_round = [{k: v / self.calls_all for k, v in g.items() if is_background(k)} for g in rnd]
        out: dict[str, Any] = {"background_per_call": bg_round, "calls_all": self.calls_all}
        for step, calls in self.calls.items():
            groups = []
            for i, pid in enumerate(self.pids):
                us: dict[str, float] = {}
                for d in self.win_threads[step][i]:
                    for k, v in grouped(d, pid, names[i]).items():
                        us[k] = us.get(k, 0.0) + v
                fg = {k: v / calls for k, v in us.items() if not is_background(k)}
                win_bg = sum(v for k, v in us.items() if is_background(k)) / calls
                groups.append({**fg, **bg_round[i]})
                out.setdefault(step, []).append(self.win_us[step][i] / calls - win_bg + sum(bg_round[i].values()))
                out.setdefault(step + "_window", []).append(self.win_us[step][i] / calls)
            out[step + "_groups"] = groups
        return out


# -- latency / throughput rounds ---------------------------------------------------------------
def run_rounds(configs: list[str], p: dict[str, Any], rotate: bool, fresh: bool, tmp: str, transport: str,
               channels: str, code_state: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Each round: every metric for every config, in blocks interleaved across configs.

    With `fresh` (the default), every round starts a new pair per config (in the round's
    rotated order) and ends them all at its end, so no pair's own layout (allocator,
    caches, thread placement) stays with one config for the whole run; without it the pairs
    of the first round serve every round. A block is short (about 0.1-0.5 s), so the configs
    of one round see the same machine weather; the blocks of one config in a round are pooled.
    CPU per call: see CpuAccount.
    """
    blocks = p["blocks"]
    per_round: dict[str, dict[str, list]] = {c: {m: [] for m in METRIC_KEYS} for c in configs}
    raw: dict[str, list] = {c: [] for c in configs}
    threads: dict[str, dict[str, list]] = {c: {"noop": [], "thr": []} for c in configs}
    rounds_info: list[dict[str, Any]] = []
    steps = [
        ("noop", dict(n=p["noop_calls"] // blocks, warmup=max(10, p["noop_warmup"] // blocks), raw=True)),
        ("big", dict(n=max(2, p["big_calls"] // blocks), warmup=1, raw=True)),
        ("thr", dict(threads=8, seconds=p["thr_seconds"] / blocks, warmup_s=0.1)),
    ]
    kept: dict[str, Pair] | None = None
    shutdown: dict[str, Any] = {}
    try:
        if not fresh:
            kept = start_pairs(configs, tmp, transport, channels)
            warm_up(kept)
        for r in range(p["rounds"]):
            t0 = time.perf_counter()
            order = rotated(configs, r, rotate)
            info = {"round": r + 1, "order": order, "code": code_state()}
            pairs = kept if kept is not None else start_pairs(order, tmp, transport, channels, verbose=r == 0)
            try:
                if kept is None:
                    warm_up(pairs)
                info["pids"] = {c: pairs[c].pids for c in order}
                t_measure = time.perf_counter()
                before = dict(zip(order, drained_snapshot([pairs[c] for c in order])))
                got = {c: {"noop": [], "big": [], "thr": [], "cpu_stat": {"noop": 0.0, "thr": 0.0}, "inexact": 0,
                           "snap_ms": [], "account": CpuAccount(pairs[c].pids, ("noop", "thr")),
                           "profiler_rpc_events": None} for c in order}
                for step, kwargs in steps:  # each metric across all configs, back to back, block by block
                    for _b in range(blocks):
                        for c in order:
                            pr = pairs[c]
                            extra = {"pids": pr.pids} if step != "big" else {}
                            res = pr.call(step, **kwargs, **extra)
                            g = got[c]
                            every = res["calls_total"] if step == "thr" else res["n"] + kwargs["warmup"]
                            g["account"].calls_all += every
                            if step != "big":
                                calls = res["calls" if step == "thr" else "n"]
                                g["account"].add(step, res["cpu_us"], res["thread_cpu"], calls)
                                g["cpu_stat"][step] += sum(res["cpu_stat_us"])
                                g["inexact"] += res["cpu_exact"].count(False)
                                g["snap_ms"] += res["snap_ms"]
                            if step == "thr":
                                g["thr"].append((res["calls"], res["seconds"]))
                            else:
                                g[step].extend(res["lat_us"])
                                if step == "noop":
                                    g["profiler_rpc_events"] = res.get("profiler_rpc_events")
                after = dict(zip(order, drained_snapshot([pairs[c] for c in order])))
                info["measure_s"] = time.perf_counter() - t_measure
                for c in order:
                    pr = pairs[c]
                    names = [thread_names(pr, pr.caller), thread_names(pr, pr.callee)]
                    got[c]["cpu"] = got[c]["account"].finish(before[c], after[c], names)
                    threads[c]["noop"].append(got[c]["cpu"]["noop_groups"][1])
                    threads[c]["thr"].append(got[c]["cpu"]["thr_groups"][1])
            finally:
                if kept is None and r == p["rounds"] - 1:  # the last round's pairs end as users' do
                    shutdown = shutdown_all(list(pairs.values()))
                elif kept is None:
                    kill_all(list(pairs.values()))
            row = {}
            for c in configs:
                g = got[c]
                cpu, acct = g["cpu"], g["account"]
                calls = sum(n for n, _ in g["thr"])
                row[c] = {
                    "noop_p50": quantile(g["noop"], 0.5), "noop_p99": quantile(g["noop"], 0.99),
                    "big_p50": quantile(g["big"], 0.5),
                    "thr": calls / sum(t for _, t in g["thr"]),
                    "noop_cpu": sum(cpu["noop"]), "thr_cpu": sum(cpu["thr"]),
                    "noop_cpu_caller": cpu["noop"][0], "noop_cpu_callee": cpu["noop"][1],
                    "thr_cpu_caller": cpu["thr"][0], "thr_cpu_callee": cpu["thr"][1],
                    "noop_cpu_window": sum(cpu["noop_window"]), "thr_cpu_window": sum(cpu["thr_window"]),
                    "noop_cpu_stat": g["cpu_stat"]["noop"] / acct.calls["noop"],
                    "thr_cpu_stat": g["cpu_stat"]["thr"] / acct.calls["thr"],
                }
                for m in METRIC_KEYS:
                    per_round[c][m].append(row[c][m])
                raw[c].append({"profiler_rpc_events": g["profiler_rpc_events"], "cpu_windows_inexact": g["inexact"],
                               "snap_ms_max": max(g["snap_ms"], default=0.0), "round_calls": acct.calls_all,
                               "background_per_call": cpu["background_per_call"], **row[c]})
            info["elapsed_s"] = time.perf_counter() - t0
            rounds_info.append(info)
            line = "  ".join(f"{c}:{row[c]['noop_p50']:.0f}us/{row[c]['noop_cpu']:.0f}cpu/{row[c]['thr']:.0f}/s"
                             for c in configs)
            print(f"round {r + 1}/{p['rounds']} ({info['elapsed_s']:.0f}s, measuring {info['measure_s']:.0f}s): "
                  f"{line}", flush=True)
    finally:
        if kept is not None:
            shutdown = shutdown_all(list(kept.values()))
    result: dict[str, Any] = {"per_round": per_round, "raw": raw, "threads": threads, "rounds_info": rounds_info,
                              "fresh_pairs": fresh, "shutdown_last": shutdown,
                              **summarise_rounds(per_round, configs, METRIC_KEYS)}
    result["targets"] = evaluate_targets(TARGETS, configs, result["ratio_to_a"], result["ratio_to_pooled"])
    return result


# -- server saturation ---------------------------------------------------------------------------
def _sat_snapshot(g: Pair) -> dict[str, Any]:
    """The server's call count and time (asked first), then every process's and thread's CPU (read from here)."""
    served = g.server.call("served")
    return {"served": served, "cpu": snapshot(g.pids)}


def sat_block(g: Pair, threads: int, seconds: float, warmup_s: float) -> dict[str, Any]:
    """`threads` threads in each client process calling the server's no-op UDF; measured over `seconds`
    after `warmup_s`, on the server (its UDF counts calls) and from /proc (every process's CPU)."""
    g.resume()
    try:
        for w in g.clients:
            w.send("sat_start", threads=threads)
        for w in g.clients:
            w.recv()
        time.sleep(warmup_s)
        s0 = _sat_snapshot(g)
        time.sleep(seconds)
        s1 = _sat_snapshot(g)
        for w in g.clients:
            w.send("sat_stop")
        clients = [w.recv()["result"] for w in g.clients]
    finally:
        g.pause()
    calls = s1["served"]["count"] - s0["served"]["count"] - 1  # each `served` takes one count
    win = window(s0["cpu"], s1["cpu"])
    return {"calls": calls, "seconds": s1["served"]["t"] - s0["served"]["t"], "cpu_us": [w["us"] for w in win],
            "cpu_stat_us": [w["stat_us"] for w in win], "cpu_exact": [w["exact"] for w in win],
            "thread_cpu": [w["threads"] for w in win], "clients": clients}


def _served(groups: list[Pair]) -> list[int]:
    """Each group's server count so far (each group resumed for the question)."""
    out = []
    for g in groups:
        g.resume()
        try:
            out.append(g.server.call("served")["count"])
        finally:
            g.pause()
    return out


def run_saturation(configs: list[str], p: dict[str, Any], rotate: bool, tmp: str, transport: str, channels: str,
                   code_state: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """SAT_CLIENTS client processes x SAT_THREADS threads against one server, per config; fresh groups
    every round, blocks interleaved across configs as in the rounds; CPU per call as in CpuAccount."""
    per_round: dict[str, dict[str, list]] = {c: {m: [] for m in SAT_KEYS} for c in configs}
    threads: dict[str, list] = {c: [] for c in configs}
    client_threads: dict[str, list] = {c: [] for c in configs}  # the client processes' groups, summed
    raw: dict[str, list] = {c: [] for c in configs}
    rounds_info = []
    for r in range(p["sat_rounds"]):
        t0 = time.perf_counter()
        order = rotated(configs, r, rotate)
        info = {"round": r + 1, "order": order, "code": code_state()}
        groups = start_pairs(order, tmp, transport, channels, world=SAT_CLIENTS + 1, verbose=False)
        try:
            for c in order:  # warm-up
                sat_block(groups[c], SAT_THREADS, 0.3, 0.3)
            t_measure = time.perf_counter()
            glist = [groups[c] for c in order]
            before = dict(zip(order, drained_snapshot(glist)))
            served0 = dict(zip(order, _served(glist)))
            got: dict[str, list] = {c: [] for c in configs}
            acct = {c: CpuAccount(groups[c].pids, ("sat",)) for c in order}
            for _b in range(p["sat_blocks"]):
                for c in order:
                    b = sat_block(groups[c], SAT_THREADS, p["sat_seconds"], p["sat_warmup"])
                    got[c].append(b)
                    acct[c].add("sat", b["cpu_us"], b["thread_cpu"], b["calls"])
            served1 = dict(zip(order, _served(glist)))
            after = dict(zip(order, drained_snapshot(glist)))
            info["measure_s"] = time.perf_counter() - t_measure
            cpu = {}
            for c in order:
                g = groups[c]
                acct[c].calls_all = served1[c] - served0[c] - 1
                names = [thread_names(g, w) for w in g.workers]
                cpu[c] = acct[c].finish(before[c], after[c], names)
                threads[c].append(cpu[c]["sat_groups"][g.workers.index(g.server)])
                clients: dict[str, float] = {}
                for i, groups_of in enumerate(cpu[c]["sat_groups"]):
                    if i != g.workers.index(g.server):
                        for k, v in groups_of.items():
                            clients[k] = clients.get(k, 0.0) + v
                client_threads[c].append(clients)
        finally:
            kill_all(list(groups.values()))
        for c in configs:
            blocks = got[c]
            calls = sum(b["calls"] for b in blocks)
            server = groups[c].workers.index(groups[c].server)
            per_round[c]["sat_rate"].append(calls / sum(b["seconds"] for b in blocks))
            per_round[c]["sat_server_cpu"].append(cpu[c]["sat"][server])
            per_round[c]["sat_all_cpu"].append(sum(cpu[c]["sat"]))
            raw[c].append({"blocks": [{k: v for k, v in b.items() if k != "thread_cpu"} for b in blocks],
                           "server_cpu_window": cpu[c]["sat_window"][server],
                           "all_cpu_window": sum(cpu[c]["sat_window"]), "round_calls": acct[c].calls_all,
                           "background_per_call": cpu[c]["background_per_call"]})
        info["elapsed_s"] = time.perf_counter() - t0
        rounds_info.append(info)
        line = "  ".join(f"{c}:{per_round[c]['sat_rate'][-1]:.0f}/s/{per_round[c]['sat_server_cpu'][-1]:.0f}us"
                         for c in configs)
        print(f"saturation round {r + 1}/{p['sat_rounds']} ({info['elapsed_s']:.0f}s): {line}", flush=True)
    result: dict[str, Any] = {"per_round": per_round, "threads": threads, "client_threads": client_threads,
                              "raw": raw, "rounds_info": rounds_info, "clients": SAT_CLIENTS,
                              "threads_per_client": SAT_THREADS,
                              **summarise_rounds(per_round, configs, SAT_KEYS)}
    result["targets"] = evaluate_targets(SAT_TARGETS, configs, result["ratio_to_a"], result["ratio_to_pooled"])
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
