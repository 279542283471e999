"""--profile: where the time of (c)/(d)/(e) goes, against (a). Four views, cheapest first:

1. per no-op RPC: context switches and user/sys CPU of caller and callee (/proc, no tool);
2. in situ: each rpc_observe wrapper's own time per call, on the thread that runs it
   (pairs c_t, d_t, e_t: the worker's self-timer, BENCH_SELF_TIME=1);
3. perf, if installed: CPU per RPC by shared object and the symbols that grew most, (a) vs (d); then, with
   call stacks, the CPU per RPC in rpc_observe's own C code, by thread and by function, (d) (vs (d0));
4. py-spy, if found: share of samples in rpc_observe functions, (d) caller and callee.
(A cProfile of the caller's thread was dropped: its whole path is C, so it listed no function.)
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import time
from typing import Any

from bench.pairs import Pair, proc_counters

OWN_CODE_SECONDS = 5.0  # a turn; dwarf call stacks are ~3 MB a second a process, and slow to read back
_OWN_MODULES = ("_core", "_spanjson")  # rpc_observe's C modules (shared objects "<name>.cpython-...so")
_OWN_TAGS = tuple(f" [{m}]" for m in _OWN_MODULES)  # how perf_stacks marks their frames
_PY_EVAL = ("_PyEval_EvalFrameDefault", "_PyEval_Vector")
_THREADS = {"TP_UV_loop": "uv loop", "pt_thread_pool": "RPC pool"}
_IDLE_LEAVES = ("wait (threading.py", "select", "epoll", "sleep", "readline", "_wait_for_tstate_lock",
                "wait (rpc_observe", "(<built-in>)")


def run_profile(pairs: dict[str, Pair], py_spy: str | None, tmp: str, seconds: float) -> tuple[dict[str, Any], str]:
    """All four views; the results for the JSON and their tables (also printed)."""
    out: dict[str, Any] = {}
    texts = [per_call_counters(pairs, out)]
    texts += self_times(pairs, out)
    perf = shutil.which("perf")
    if perf:
        texts.append(perf_by_dso(pairs, perf, tmp, seconds, out))
        texts.append(perf_own_code(pairs, perf, tmp, min(seconds, OWN_CODE_SECONDS), out))
    else:
        print("perf: not found on PATH (apt-get install linux-perf); skipping the perf view", flush=True)
    d = pairs["d"]
    d.resume()  # (d) runs through py-spy
    if py_spy and shutil.which(py_spy):
        texts += py_spy_shares(d, py_spy, tmp, seconds, out)
    else:
        msg = (f"py-spy: {py_spy} is not an executable" if py_spy
               else "py-spy: not found on PATH (pip install py-spy, or pass --py-spy PATH)")
        out["py-spy skipped"] = msg
        print(f"{msg}; skipping the py-spy view", flush=True)
    d.pause()
    text = "\n\n".join(texts)
    print(text, flush=True)
    return out, text


# -- 1. /proc counters ---------------------------------------------------------------------------
def per_call_counters(pairs: dict[str, Pair], out: dict[str, Any], n: int = 2000) -> str:
    rows = []
    configs = [c for c in ("a", "c", "d", "dn") if c in pairs]
    for rep in range(3):
        for c in configs:
            pr = pairs[c]
            pr.resume()
            before = {r: proc_counters(w.pid) for r, w in (("caller", pr.caller), ("callee", pr.callee))}
            res = pr.caller.call("noop", n=n, warmup=0)
            after = {r: proc_counters(w.pid) for r, w in (("caller", pr.caller), ("callee", pr.callee))}
            pr.pause()
            row = {"config": c, "rep": rep, "p50_us": res["p50_us"]}
            for r in before:
                for k in before[r]:
                    row[f"{r}_{k}"] = (after[r][k] - before[r][k]) / n
            rows.append(row)
    out["per_call_counters"] = rows
    lines = [f"Per no-op RPC ({n} calls, median of 3 reps): context switches, minor page faults and CPU of each "
             "process",
             "| config | p50 us | caller vol. cs | caller invol. cs | caller faults | caller user us | caller sys us | "
             "callee vol. cs | callee invol. cs | callee faults | callee user us | callee sys us |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in configs:
        rs = [r for r in rows if r["config"] == c]
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k not in ("config", "rep")}
        lines.append(f"| {c} | {med['p50_us']:.0f} | " + " | ".join(
            f"{med[f'{r}_{k}']:.2f}" if k.endswith(("cs", "flt")) else f"{med[f'{r}_{k}']:.0f}"
            for r in ("caller", "callee") for k in ("vcs", "nvcs", "minflt", "user_us", "sys_us")) + " |")
    return "\n".join(lines)


# -- 2. in-situ self times -----------------------------------------------------------------------
def self_times(pairs: dict[str, Pair], out: dict[str, Any], n: int = 1500, reps: int = 6) -> list[str]:
    """(c), (d), (dn) and (e) (and, with --baseline, (c0), (d0) and (e0)) with the worker's self-timer, which adds its
    own ~1-2 us per wrapper; the configs take turns, rep by rep, so a slow phase of the machine hits them all."""
    configs = [c for c in ("c", "d", "dn", "e", "c0", "d0", "e0") if c + "_t" in pairs]
    res: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    for _ in range(reps):
        for c in configs:
            pr = pairs[c + "_t"]
            pr.resume()
            res[c].append(pr.caller.call("selftime", n=n))
            pr.pause()
    texts = []
    for c in configs:
        out[f"selftime {c}"] = res[c]
        lines = [f"rpc_observe's own time per no-op RPC in ({c}), in situ, us (median per call; median of "
                 f"{reps} x {n}, the configs taking turns):",
                 "| process | wrapper @ thread | median us | mean us |", "|---|---|---|---|"]
        totals: dict[str, float] = {}
        for role in ("caller", "callee"):
            for key in sorted(res[c][0][role]):
                med = statistics.median(r[role][key]["median_us"] for r in res[c] if key in r[role])
                mean = statistics.median(r[role][key]["mean_us"] for r in res[c] if key in r[role])
                totals[role] = totals.get(role, 0.0) + med
                lines.append(f"| {role} | {key} | {med:.1f} | {mean:.1f} |")
        lines.append(f"| both | sum of medians | {sum(totals.values()):.1f} | |")
        texts.append("\n".join(lines))
    return texts


# -- 3. perf -------------------------------------------------------------------------------------
def perf_record(pr: Pair, perf: str, prefix: str, seconds: float, options: tuple[str, ...] = ()
                ) -> tuple[dict[str, str], int]:
    """`perf record` (cpu-clock, 1000 Hz, `options`) on both processes of a pair while its caller loops
    no-op RPCs: the data file of each role, and the number of calls."""
    pr.resume()
    datas = {}
    procs = []
    for role, w in (("caller", pr.caller), ("callee", pr.callee)):
        datas[role] = f"{prefix}-{role}.data"
        procs.append(subprocess.Popen([perf, "record", "-e", "cpu-clock", "-F", "1000", *options, "-p", str(w.pid),
                                       "-o", datas[role], "--", "sleep", str(int(seconds))],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(0.3)
    calls = pr.caller.call("loop", seconds=seconds - 0.6)["calls"]
    for pp in procs:
        pp.wait(120)
    pr.pause()
    return datas, calls


def perf_by_dso(pairs: dict[str, Pair], perf: str, tmp: str, seconds: float, out: dict[str, Any]) -> str:
    per_dso: dict[tuple[str, str], dict[str, float]] = {}
    per_sym: dict[tuple[str, str], dict[str, float]] = {}  # (role, "dso symbol")
    for c in ("a", "d"):
        datas, calls = perf_record(pairs[c], perf, os.path.join(tmp, f"perf-{c}"), seconds)
        for role, data in datas.items():
            rep = subprocess.run([perf, "report", "-i", data, "--sort", "dso", "-g", "none", "--stdio",
                                  "-F", "sample,dso"], capture_output=True, text=True).stdout
            for line in rep.splitlines():
                parts = line.split()
                if len(parts) == 2 and parts[0].isdigit():
                    # 1000 Hz: one sample is 1000 us of CPU
                    per_dso.setdefault((role, parts[1]), {})[c] = int(parts[0]) * 1000 / calls
            rep = subprocess.run([perf, "report", "-i", data, "--sort", "dso,sym", "-g", "none", "--stdio",
                                  "-F", "sample,dso,sym"], capture_output=True, text=True).stdout
            for line in rep.splitlines():
                parts = line.split(None, 2)
                if len(parts) == 3 and parts[0].isdigit():
                    per_sym.setdefault((role, f"{parts[1]} {parts[2].strip()}"), {})[c] = int(parts[0]) * 1000 / calls
    out["perf_us_per_call"] = {f"{r}|{d}": v for (r, d), v in per_dso.items()}
    out["perf_sym_us_per_call"] = {f"{r}|{s}": v for (r, s), v in per_sym.items()}
    lines = ["perf (cpu-clock, 1000 Hz) CPU per no-op RPC by shared object, us (a) vs (d):",
             "| process | shared object | (a) | (d) | (d)-(a) |", "|---|---|---|---|---|"]
    for (role, dso), v in sorted(per_dso.items(), key=lambda kv: -(kv[1].get("d", 0) - kv[1].get("a", 0))):
        if max(v.values()) >= 3:
            lines.append(f"| {role} | {dso} | {v.get('a', 0):.0f} | {v.get('d', 0):.0f} | "
                         f"{v.get('d', 0) - v.get('a', 0):+.0f} |")
    lines += ["", "the 20 symbols whose CPU grew most, us per no-op RPC:",
              "| process | shared object and symbol | (a) | (d) | (d)-(a) |", "|---|---|---|---|---|"]
    grown = sorted(per_sym.items(), key=lambda kv: -(kv[1].get("d", 0) - kv[1].get("a", 0)))
    for (role, sym), v in grown[:20]:
        lines.append(f"| {role} | {sym} | {v.get('a', 0):.1f} | {v.get('d', 0):.1f} | "
                     f"{v.get('d', 0) - v.get('a', 0):+.1f} |")
    return "\n".join(lines)


def perf_own_code(pairs: dict[str, Pair], perf: str, tmp: str, seconds: float, out: dict[str, Any]) -> str:
    """perf with DWARF call stacks on (d) and (d0), taking turns (d, d0, d0, d: a drift of the machine falls on
    both): a sample is the add-on's own if a frame of its C modules is on the stack and no Python frame lies
    between it and the leaf (else it is the call the hook wraps: torch's code, or the UDF). CPU per RPC of each
    process, the own part by thread, and the leaf functions of the own part."""
    configs = [c for c in ("d", "d0") if c in pairs]
    samples: dict[str, dict[str, int]] = {c: {} for c in configs}  # config -> "role|part" -> samples
    calls = dict.fromkeys(configs, 0)
    for turn, c in enumerate(configs + configs[::-1]):
        datas, n = perf_record(pairs[c], perf, os.path.join(tmp, f"perf-own-{c}-{turn}"), seconds,
                               ("--call-graph", "dwarf,16384"))
        calls[c] += n
        counts = samples[c]
        for role, data in datas.items():
            script = subprocess.run([perf, "script", "-i", data, "-F", "comm,pid,tid,ip,sym,dso", "--no-inline"],
                                    capture_output=True, text=True).stdout
            for thread, frames in perf_stacks(script):
                kind = own_kind(frames)
                for key in (f"{role}|all", f"{role}|{kind}") + ((f"{role}|own on {thread}", f"{role}|leaf {frames[0]}")
                                                                 if kind == "own" else ()):
                    counts[key] = counts.get(key, 0) + 1
    # 1000 Hz: one sample is 1000 us of CPU
    own = {c: {k: n * 1000 / max(calls[c], 1) for k, n in samples[c].items()} for c in configs}
    out["perf_own_us_per_call"] = own
    out["perf_own_calls"] = calls
    head = " | ".join(f"({c})" for c in configs)
    lines = [f"perf with call stacks (cpu-clock, 1000 Hz, DWARF; (d) and (d0) taking turns, {len(configs) * 2} x "
             f"{seconds:.0f} s): CPU per no-op RPC, us. 'own': in rpc_observe's C code, or what it calls without a "
             "Python frame between; 'under a hook': the call a hook wraps (torch's Python and the UDF)",
             f"| process | part | {head} |", "|---|---|" + "---|" * len(configs)]
    for role in ("caller", "callee"):
        parts = sorted({k for v in own.values() for k in v if k.startswith(role + "|")},
                       key=lambda k: -own["d"].get(k, 0.0))
        for prefix in ("all", "rest", "under a hook", "own", "own on ", "leaf "):
            chosen = [k for k in parts if (k.split("|", 1)[1].startswith(prefix) if prefix.endswith(" ")
                                           else k.split("|", 1)[1] == prefix)]
            for k in chosen[:12]:  # the leaves' tail left out
                lines.append(f"| {role} | {k.split('|', 1)[1]} | " + " | ".join(f"{own[c].get(k, 0.0):.1f}"
                                                                             for c in configs) + " |")
    return "\n".join(lines)


def perf_stacks(script: str) -> list[tuple[str, list[str]]]:
    """`perf script -F comm,pid,tid,ip,sym,dso` as (thread, frames leaf first); a frame is its symbol, and
    "symbol [module]" in one of the add-on's C modules."""
    stacks: list[tuple[str, list[str]]] = []
    for block in script.split("\n\n"):
        rows = block.strip("\n").split("\n")
        if not rows or not rows[0] or rows[0].startswith(("\t", " ")):
            continue
        *comm_words, ids = rows[0].split()
        comm = " ".join(comm_words)
        pid, _, tid = ids.partition("/")
        thread = _THREADS.get(comm, "main" if pid == tid else f"other ({comm})")
        frames = []
        for row in rows[1:]:
            _ip, _, rest = row.strip().partition(" ")
            sym, _, dso = rest.rpartition(" (")
            module = os.path.basename(dso.rstrip(")")).split(".")[0]
            frames.append(f"{sym} [{module}]" if module in _OWN_MODULES else sym)
        if frames:
            stacks.append((thread, frames))
    return stacks


def own_kind(frames: list[str]) -> str:
    """"own" (leaf in the add-on's C code or below it without Python), "under a hook", or "rest"."""
    for i, frame in enumerate(frames):
        if frame.endswith(_OWN_TAGS):
            return "under a hook" if any(f in _PY_EVAL for f in frames[:i]) else "own"
    return "rest"


# -- 4. py-spy -----------------------------------------------------------------------------------
def py_spy_shares(d: Pair, py_spy: str, tmp: str, seconds: float, out: dict[str, Any]) -> list[str]:
    """py-spy on both (d) processes (already resumed) while the caller loops no-op RPCs."""
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
    texts = []
    for role, path in raws.items():
        if not os.path.exists(path):
            continue
        res = analyse_collapsed(path)
        out[f"py-spy {role}"] = res
        texts.append(format_profile(f"py-spy (250 Hz, non-blocking), (d) {role}", res))
    return texts


def analyse_collapsed(path: str) -> dict[str, Any]:
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
            idle = any(x in leaf for x in _IDLE_LEAVES)
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


def format_profile(title: str, res: dict[str, Any]) -> str:
    lines = [f"{title}: {res['busy_samples']} busy samples of {res['samples']}",
             "| rpc_observe function (inclusive) | samples | % of busy |", "|---|---|---|"]
    lines += [f"| {k} | {v} | {p:.1f} |" for k, v, p in res["inclusive"]]
    lines += ["", "| rpc_observe function (self) | samples | % of busy |", "|---|---|---|"]
    lines += [f"| {k} | {v} | {p:.1f} |" for k, v, p in res["self"]]
    return "\n".join(lines)
