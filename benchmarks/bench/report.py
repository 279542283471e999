"""The tables each section prints, and the JSON result file of a run.

Every result records the machine, the git commit (and whether rpc_observe/ had uncommitted
changes), and the command: both as `python benchmarks/overhead.py ...` (to re-run it) and
exactly as this process was started (interpreter, options, arguments and directory).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
from typing import Any

from bench.pairs import LABELS
from bench.procstat import THREAD_CLOCK
from bench.sections import CPU_METRICS, METRICS, SAT_METRICS, VS_HANDWRITTEN_LIMIT

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def fmt(x: float) -> str:
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def _metric_header(metrics: list[tuple[str, str, float, bool]]) -> list[str]:
    return [f"| {'config':<42} |" + "".join(f" {title:>26} |" for _, title, _, _ in metrics),
            "|" + "-" * 44 + "|" + "".join("-" * 28 + "|" for _ in metrics)]


def values_and_ratios(res: dict[str, Any], configs: list[str], metrics: list[tuple[str, str, float, bool]]) -> str:
    """Per config: each metric's median [min-max] over rounds, then the per-round ratios to (a)."""
    lines = _metric_header(metrics)
    for c in configs:
        row = f"| {LABELS[c]:<42} |"
        for m, _, scale, _ in metrics:
            s = res["summary"][c][m]
            row += f" {fmt(s['median'] * scale)} [{fmt(s['min'] * scale)}-{fmt(s['max'] * scale)}] |".rjust(28)
        lines.append(row)
    lines += ["", "Ratio to (a), per round then median [IQR]:", ""]
    lines += _metric_header(metrics)
    for c in configs:
        row = f"| {LABELS[c]:<42} |"
        for m, *_ in metrics:
            s = res["ratio_to_a"][c][m]
            row += f" {s['median']:.3f} [{s['q1']:.3f}-{s['q3']:.3f}] |".rjust(28)
        lines.append(row)
    return "\n".join(lines)


def _background(rows: list[dict[str, Any]], proc: int) -> float:
    """Median over rounds of a process's background threads' CPU per call (CpuAccount)."""
    return statistics.median(sum(r["background_per_call"][proc].values()) for r in rows)


def rounds_table(res: dict[str, Any], configs: list[str]) -> str:
    """The rounds' values and ratios, and CPU per call by process, with two cross-checks."""
    lines = [values_and_ratios(res, configs, METRICS), "",
             "CPU per call by process (us, median over rounds): every thread's run time over the measured calls "
             "(/proc/<pid>/task/*/schedstat), with the threads off the RPC path (rpc_observe's, the OTel SDK's "
             "batch processor) counted over the whole round instead of the short windows; their share is the "
             "'background' column. Cross-checks, all-process ratio to (a): the windows alone (background "
             "threads as caught in the windows) and utime+stime of /proc/<pid>/stat alone (10 ms ticks):", "",
             "| config | no-op caller | no-op callee | 8-thr caller | 8-thr callee | background caller / callee | "
             "no-op ratio: windows / stat | 8-thr ratio: windows / stat |", "|---|---|---|---|---|---|---|---|"]
    for c in configs:
        s, r = res["summary"][c], res["ratio_to_a"][c]
        lines.append(f"| ({c}) | {s['noop_cpu_caller']['median']:.0f} | {s['noop_cpu_callee']['median']:.0f} | "
                     f"{s['thr_cpu_caller']['median']:.0f} | {s['thr_cpu_callee']['median']:.0f} | "
                     f"{_background(res['raw'][c], 0):.1f} / {_background(res['raw'][c], 1):.1f} | "
                     f"{r['noop_cpu_window']['median']:.3f} / {r['noop_cpu_stat']['median']:.3f} | "
                     f"{r['thr_cpu_window']['median']:.3f} / {r['thr_cpu_stat']['median']:.3f} |")
    inexact = sum(x["cpu_windows_inexact"] for rows in res["raw"].values() for x in rows)
    snap = max(x["snap_ms_max"] for rows in res["raw"].values() for x in rows)
    lines.append(f"\nCPU windows where a thread ended (stat used): {inexact}; longest /proc reading: {snap:.1f} ms")
    return "\n".join(lines)


def saturation_table(res: dict[str, Any], configs: list[str]) -> str:
    head = (f"Server saturation: {res['clients']} client processes x {res['threads_per_client']} threads of "
            "rpc_async(...).wait() on one server, no-op UDF, for a fixed time; calls counted by the server's UDF; "
            "CPU (every thread's run time, read from the driver) of the server / of all 5 processes over the same "
            "window. Median [min-max] over rounds, then ratios:")
    return head + "\n\n" + values_and_ratios(res, configs, SAT_METRICS)


def _median0(rounds: list[dict[str, float]], key: str) -> float:
    return statistics.median(r.get(key, 0.0) for r in rounds) if rounds else float("nan")


def threads_table(title: str, threads: dict[str, list[dict[str, float]]], configs: list[str],
                  diff: tuple[str, ...] = ("c", "c0", "d", "dn", "d0", "h")) -> str:
    """CPU us per call by thread group of one process, median over rounds, and the configs' excess over (a)."""
    configs = [c for c in configs if c in threads and threads[c]]
    diff = tuple(c for c in diff if c in configs and c != "a")
    groups: dict[str, float] = {}
    for c in configs:
        for rnd in threads[c]:
            for k, v in rnd.items():
                groups[k] = max(groups.get(k, 0.0), v)
    keys = sorted((k for k, v in groups.items() if v >= 0.05), key=lambda k: -groups[k])
    med = {c: {k: _median0(threads[c], k) for k in keys} for c in configs}
    lines = [f"{title} (thread CPU from {THREAD_CLOCK}; us per call, median over rounds; rpc_observe's and the "
             "SDK's threads over the whole round):", "",
             "| thread group | " + " | ".join(f"({c})" for c in configs) + " | "
             + " | ".join(f"({c})-(a)" for c in diff) + " |",
             "|---" * (1 + len(configs) + len(diff)) + "|"]
    for k in keys:
        lines.append(f"| {k} | " + " | ".join(f"{med[c][k]:.1f}" for c in configs) + " | "
                     + " | ".join(f"{med[c][k] - med['a'][k]:+.1f}" for c in diff) + " |")
    tot = {c: sum(med[c].values()) for c in configs}
    lines.append("| **sum of live threads** | " + " | ".join(f"{tot[c]:.1f}" for c in configs) + " | "
                 + " | ".join(f"{tot[c] - tot['a']:+.1f}" for c in diff) + " |")
    return "\n".join(lines)


def added_table(result: dict[str, Any]) -> str:
    """Added CPU per call over plain torch, per config and measure, and (d) against (h)."""
    lines = ["Added CPU per call over plain torch (config minus the mean of (a) and (a2) of the same round, "
             "median over rounds), us:", "",
             "| config | no-op, all processes | 8-thread, all processes | saturation, server | saturation, all |",
             "|---|---|---|---|---|"]
    added = result.get("added_cpu", {})
    for c in ("b", "c", "c0", "d", "dn", "d0", "e", "e0", "h", "l"):
        cells = [added.get(m, {}).get(c) for m in CPU_METRICS]
        if any(x is not None for x in cells):
            lines.append(f"| ({c}) | " + " | ".join("-" if x is None else f"{x['median']:+.1f}" for x in cells) + " |")
    vs = result.get("vs_handwritten", {})
    if vs:
        lines += ["", f"(d) added CPU per call / (h) added CPU per call (target <= {VS_HANDWRITTEN_LIMIT}): per round "
                  "then median [IQR], and median(d added) / median(h added); base (a) | base mean of (a),(a2):", "",
                  "| measure | (d) added us | (h) added us | per-round ratio, base (a) | ratio of medians, base (a) | "
                  "per-round ratio, base (a)+(a2) | ratio of medians, base (a)+(a2) |", "|---|---|---|---|---|---|---|"]
        for m, v in vs.items():
            a, pl = v["a"], v.get("pooled", v["a"])
            lines.append(f"| {m} | {pl['added_num']['median']:+.1f} | {pl['added_den']['median']:+.1f} | "
                         f"{a['summary']['median']:.3f} [{a['summary']['q1']:.3f}-{a['summary']['q3']:.3f}] | "
                         f"{a['ratio_of_medians']:.3f} | "
                         f"{pl['summary']['median']:.3f} [{pl['summary']['q1']:.3f}-{pl['summary']['q3']:.3f}] | "
                         f"{pl['ratio_of_medians']:.3f} |")
    return "\n".join(lines)


def targets_table(result: dict[str, Any]) -> str:
    """Every target of the sections that ran: PASS/FAIL on the median per-round ratio to (a), and on the
    ratio to the mean of (a) and (a2), with the A/A control's own ratio beside them as the noise level."""
    lines = ["| target | ratio to (a): median | IQR | result | A/A control (a2)/(a): median [IQR] | "
             "ratio to mean of (a),(a2): median | result |", "|---|---|---|---|---|---|---|"]
    targets = result.get("rounds", {}).get("targets", []) + result.get("saturation", {}).get("targets", [])
    for t in targets:
        noise = (f"{t['a2_ratio']:.3f} [{t['a2_iqr'][0]:.3f}-{t['a2_iqr'][1]:.3f}]" if t["a2_ratio"] is not None
                 else "-")
        lines.append(f"| ({t['config']}) {t['metric']} {t['target']} | {t['ratio']:.3f} | "
                     f"{t['ratio_iqr'][0]:.3f}-{t['ratio_iqr'][1]:.3f} | {'PASS' if t['pass'] else 'FAIL'} | {noise} | "
                     f"{t['pooled_ratio']:.3f} | {'PASS' if t['pooled_pass'] else 'FAIL'} |")
    for m, v in result.get("vs_handwritten", {}).items():  # on the ratio of the median added values
        a, pl = v["a"], v.get("pooled", v["a"])
        ok_a, ok_p = a["ratio_of_medians"] <= VS_HANDWRITTEN_LIMIT, pl["ratio_of_medians"] <= VS_HANDWRITTEN_LIMIT
        lines.append(f"| (d) added / (h) added CPU, {m} <= {VS_HANDWRITTEN_LIMIT} (*) | {a['ratio_of_medians']:.3f} | "
                     f"{a['summary']['q1']:.3f}-{a['summary']['q3']:.3f} | {'PASS' if ok_a else 'FAIL'} | - | "
                     f"{pl['ratio_of_medians']:.3f} | {'PASS' if ok_p else 'FAIL'} |")
    if result.get("vs_handwritten"):
        lines.append("\n(*) median of (d)'s added CPU per call / median of (h)'s, over the rounds; the IQR column is "
                     "that of the per-round ratios, which are unstable where (d)'s added CPU is near the noise.")
    return "\n".join(lines)


def serialization_table(res: dict[str, Any]) -> str:
    base = [c for c in res["per_round"] if c != "c"]
    lines = [f"| payload (args, echoed back) | ({'+'.join(base)}) p50 us | (c) p50 us | "
             "(c)-base per round, median [IQR] us | pickler only: torch ser+deser us | wrapped us | added us |",
             "|---|---|---|---|---|---|---|"]
    for case, t in res["summary"].items():
        m = res["pickler_micro"][case]
        lines.append(f"| {case} | {t['a_p50_us']['median']:.0f} | {t['c_p50_us']['median']:.0f} | "
                     f"{t['added_us']['median']:+.1f} [{t['added_us']['q1']:+.1f} .. {t['added_us']['q3']:+.1f}] | "
                     f"{m['torch_us']:.1f} | {m['wrapped_us']:.1f} | {m['added_us']:+.2f} |")
    return "\n".join(lines)


def memory_table(res: dict[str, Any]) -> str:
    mb = 1 / (1 << 20)
    lines = ["| config | process | RSS at 0 MB | RSS at 50k MB | RSS at 100k MB | 100k-0 MB | 100k-50k MB | "
             "VmHWM at 100k MB |", "|---|---|---|---|---|---|---|---|"]
    for key, g in res["summary"].items():
        c, proc = key.split("/")
        lines.append(f"| {c} | {proc} | {g['rss0'] * mb:.1f} | {g['rss50k'] * mb:.1f} | {g['rss100k'] * mb:.1f} | "
                     f"{g['growth_0_100k'] * mb:+.1f} | {g['growth_50k_100k'] * mb:+.1f} | {g['hwm'] * mb:.1f} |")
    lines.append("")
    lines.append("| process | peak RSS (d)-(a) MB | growth over 100k (d)-(a) MB (< 50) | "
                 "(d) RSS 100k-50k MB (|x| <= 4) | result |")
    lines.append("|---|---|---|---|---|")
    for ch in res["checks"]:
        ok = ch["growth_ok"] and ch["steady_ok"]
        lines.append(f"| {ch['process']} | {ch['peak_d_minus_a_MB']:+.1f} | {ch['growth_d_minus_a_MB']:+.1f} | "
                     f"{ch['d_100k_minus_50k_MB']:+.1f} | {'PASS' if ok else 'FAIL'} |")
    return "\n".join(lines)


def startup_table(res: dict[str, Any]) -> str:
    lines = ["| interpreter start | median ms | min ms | max ms |", "|---|---|---|---|"]
    for k, s in res["ms"].items():
        lines.append(f"| {k} | {s['median']:.1f} | {s['min']:.1f} | {s['max']:.1f} |")
    lines.append("")
    lines.append(f"all site processing (b)-(a): {res['site_processing_ms']:+.1f} ms; rpc_observe.pth alone "
                 f"(with-skipping): {res['rpc_observe_pth_ms']:+.2f} ms; the .pth line executed in-process: "
                 f"{res['pth_line_exec_us']:.2f} us; rpc_observe imported at start-up with RPC_OBSERVE unset: "
                 f"{res['rpc_observe_imported_at_startup']}")
    return "\n".join(lines)


def show(text: str) -> str:
    """Prints a section's table as soon as it is ready; returns it for the result file."""
    print(text, flush=True)
    return text


# -- the result file ---------------------------------------------------------------------------
def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_info() -> dict[str, Any]:
    """The commit measured, and whether rpc_observe/ differed from it (None where git could not tell)."""
    dirty = _git("status", "--porcelain", "rpc_observe")
    return {"commit": _git("rev-parse", "HEAD"), "commit_short": _git("rev-parse", "--short", "HEAD"),
            "rpc_observe_dirty": None if dirty is None else bool(dirty)}


def code_state() -> dict[str, Any]:
    """What the workers started now import: HEAD, and a hash of the working copy of rpc_observe/ (the
    package is installed editable, so uncommitted edits by others are what runs): its Python and C
    sources and the C modules built from them, which a change to C alone changes."""
    pkg = os.path.join(ROOT, "rpc_observe")
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(pkg):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith((".py", ".c", ".h", ".so")):
                path = os.path.join(dirpath, name)
                digest.update(os.path.relpath(path, pkg).encode())
                try:
                    with open(path, "rb") as f:
                        digest.update(f.read())
                except OSError:
                    pass
    dirty = _git("status", "--porcelain", "rpc_observe")
    return {"head": _git("rev-parse", "--short", "HEAD"), "rpc_observe_tree_sha": digest.hexdigest()[:12],
            "rpc_observe_changed_files": None if dirty is None else len(dirty.splitlines())}


def loadavg() -> list[str]:
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


def machine(git: dict[str, Any]) -> dict[str, Any]:
    info: dict[str, Any] = {"cores": os.cpu_count(), "python": sys.version.split()[0],
                            "platform": platform.platform()}
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
        info["loadavg_start"] = loadavg()
    except OSError:
        pass
    info["git_head"], info["rpc_observe_dirty"] = git["commit_short"], git["rpc_observe_dirty"]
    return info


def new_result(mode: str, stamp: str, argv: list[str]) -> dict[str, Any]:
    """The head of a result: what was run, where, and from which commit."""
    git = git_info()
    git["code_at_start"] = code_state()
    return {"mode": mode,
            "command": shlex.join(["python", os.path.relpath(argv[0], ROOT), *argv[1:]]),
            "command_line": shlex.join(getattr(sys, "orig_argv", [sys.executable, *argv])),
            "cwd": os.getcwd(), "git": git, "date": stamp, "machine": machine(git)}


def result_path(out: str | None, stamp: str, mode: str) -> str:
    return out or os.path.join(RESULTS, f"overhead-{stamp}{'' if mode == 'full' else '-' + mode}.json")


def write_result(result: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
