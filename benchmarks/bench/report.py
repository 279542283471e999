"""The tables each section prints, and the JSON result file of a run.

Every result records the machine, the git commit (and whether rpc_observe/ had uncommitted
changes), and the command: both as `python benchmarks/overhead.py ...` (to re-run it) and
exactly as this process was started (interpreter, options, arguments and directory).
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
from typing import Any

from bench.pairs import LABELS
from bench.sections import METRICS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def fmt(x: float) -> str:
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def _metric_header() -> list[str]:
    return [f"| {'config':<42} |" + "".join(f" {title:>26} |" for _, title, _, _ in METRICS),
            "|" + "-" * 44 + "|" + "".join("-" * 28 + "|" for _ in METRICS)]


def rounds_table(res: dict[str, Any], configs: list[str]) -> str:
    """Per config: each metric's median [min-max] over rounds; the ratios to (a); the targets."""
    lines = _metric_header()
    for c in configs:
        row = f"| {LABELS[c]:<42} |"
        for m, _, scale, _ in METRICS:
            s = res["summary"][c][m]
            row += f" {fmt(s['median'] * scale)} [{fmt(s['min'] * scale)}-{fmt(s['max'] * scale)}] |".rjust(28)
        lines.append(row)
    lines += ["", "Ratio to (a), per round then median [IQR]:", ""]
    lines += _metric_header()
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
