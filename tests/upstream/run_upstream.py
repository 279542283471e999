#!/usr/bin/env python
"""Runs torch's own RPC test suite with the add-on off and on, and compares the outcomes.

torch ships its RPC tests in the wheel (`torch.testing._internal.distributed.rpc`);
`rpc_utils.generate_tests` mixes them with the TensorPipe fixture, exactly as torch's
`test/distributed/rpc/test_tensorpipe_agent.py` does. Each test is a
`MultiProcessTestCase`: the pytest process spawns one process per rank
(multiprocessing "spawn", file:// init), and every spawned rank inherits the
environment of the pytest process, so `RPC_OBSERVE=1` instruments each rank through
the installed `rpc_observe.pth` before its `init_rpc`.

    python tests/upstream/run_upstream.py [--full] [--addon on|off|both] [-k EXPR] [--junit DIR]

Without --full the curated SUBSET below runs (a few minutes); --full runs every
generated TensorPipe test (hundreds; long). With --addon both (the default) the
subset runs twice, once without the add-on and once with it, in a pytest subprocess
each, and the outcomes are compared test by test: a test that passes without the
add-on and fails with it is a regression (exit status 1). Tests that fail or skip
even without the add-on are listed as "not ours". The add-on is proven active in the
ranks by the span files they write to RPC_OBSERVE_DIR; the off run must write none.

This same file is also the test module that the inner pytest collects: imported
under its module name (not run as a script), it defines the generated test classes.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
THIS = Path(__file__).resolve()
PREFIX = "TensorPipe"
START_METHOD_ENV = "RPC_UPSTREAM_START_METHOD"  # spawn | forkserver | auto
PIDS_ENV = "RPC_UPSTREAM_PIDS"  # a file: one JSON line per test, with its ranks' pids

# The curated subset: "<generated class>.<test method>". Chosen to cover what the
# add-on wraps (the client calls, the pickler, the UDF runner, remote/RRef proxies,
# init_rpc/shutdown, the profiler) with tests that are quick (~1-3 s each on 2 cores).
SUBSET = [
    # Python UDFs: sync/async, kwargs, classes, tensors, nested pickling, nested RPCs.
    "TensorPipeRpcTest.test_py_user_defined",
    "TensorPipeRpcTest.test_py_built_in",
    "TensorPipeRpcTest.test_py_class_instance_method",
    "TensorPipeRpcTest.test_py_class_static_method",
    "TensorPipeRpcTest.test_py_no_return_result",
    "TensorPipeRpcTest.test_py_tensors_in_container",
    "TensorPipeRpcTest.test_py_nested_pickle",
    "TensorPipeRpcTest.test_nested_rpc",
    "TensorPipeRpcTest.test_multi_layer_nested_async_rpc",
    "TensorPipeRpcTest.test_use_rpc_pickler",
    "TensorPipeRpcTest.test_non_cont_tensors",
    "TensorPipeTensorPipeAgentRpcTest.test_send_to_rank_sparse",
    # Builtins (C++ ops: no Python UDF, no pickled request).
    "TensorPipeRpcTest.test_add",
    "TensorPipeRpcTest.test_async_add",
    "TensorPipeRpcTest.test_scalar_add",
    "TensorPipeRpcTest.test_self_add",
    "TensorPipeRpcTest.test_rpc_barrier_all",
    # TorchScript functions and modules over RPC.
    "TensorPipeJitRpcTest.test_torchscript_function",
    "TensorPipeJitRpcTest.test_torchscript_functions_not_supported",
    "TensorPipeJitRpcTest.test_rref_as_arg_and_return",
    "TensorPipeJitRpcTest.test_async_script_udf",
    "TensorPipeJitRpcTest.test_remote_script_module",
    "TensorPipeJitRpcTest.test_call_rpc_with_profiling",
    "TensorPipeJitDistAutogradTest.test_get_gradients",
    # RRefs: remote(), owner/user RRefs, forwarding, and the RRef proxies.
    "TensorPipeRpcTest.test_py_udf_remote",
    "TensorPipeRpcTest.test_builtin_remote_ret",
    "TensorPipeRpcTest.test_nested_remote",
    "TensorPipeRpcTest.test_nested_rref",
    "TensorPipeRpcTest.test_rref_forward_chain",
    "TensorPipeRpcTest.test_py_rref_args_user_share",
    "TensorPipeRpcTest.test_self_remote_rref_as_rpc_arg",
    "TensorPipeRpcTest.test_rref_proxy_tensor",
    "TensorPipeRpcTest.test_rref_proxy_class",
    "TensorPipeTensorPipeAgentRpcTest.test_rref_proxy_timeout",
    "TensorPipeRpcTest.test_rref_type_blocking",
    "TensorPipeRpcTest.test_rref_get_future",
    "TensorPipeRpcTest.test_owner_rref_backward",
    # @rpc.functions.async_execution (the UDF returns a Future; the server span ends with it).
    "TensorPipeRpcTest.test_async_function_simple",
    "TensorPipeRpcTest.test_async_function_chained_remote",
    "TensorPipeRpcTest.test_async_function_nested",
    "TensorPipeRpcTest.test_async_function_raise",
    "TensorPipeRpcTest.test_async_function_wrong_return_type",
    "TensorPipeRpcTest.test_async_class_rref_proxy_async",
    "TensorPipeRpcTest.test_async_function_multi_fanout",
    "TensorPipeRpcTest.test_return_future",
    # Exceptions (remote, in user code, during unpickling) and timeouts.
    "TensorPipeRpcTest.test_py_function_exception",
    "TensorPipeRpcTest.test_py_raise_in_user_func",
    "TensorPipeRpcTest.test_py_raise_in_user_func_escaped_str",
    "TensorPipeRpcTest.test_remote_with_exception",
    "TensorPipeRpcTest.test_custom_exception_throw_during_reconstruction",
    "TensorPipeRpcTest.test_function_not_on_callee",
    "TensorPipeRpcTest.test_wait_all_raise_in_user_func",
    "TensorPipeRpcTest.test_callback_with_error",
    "TensorPipeRpcTest.test_rpc_timeouts",
    "TensorPipeRpcTest.test_default_timeout_used",
    "TensorPipeRpcTest.test_rref_timeout",
    "TensorPipeTensorPipeAgentRpcTest.test_tensorpipe_set_default_timeout",
    # The legacy (autograd) profiler over RPC: remote events, keys, exported traces.
    "TensorPipeRpcTest.test_profiler_with_sync_rpc_udf",
    "TensorPipeRpcTest.test_profiler_with_async_rpc_builtin",
    "TensorPipeRpcTest.test_profiler_with_remote_udf",
    "TensorPipeRpcTest.test_profiler_with_script_async_rpc",
    "TensorPipeRpcTest.test_profiler_remote_events_profiled",
    "TensorPipeRpcTest.test_profiler_export_trace",
    "TensorPipeRpcTest.test_profiler_rpc_record_shapes",
    "TensorPipeRpcTest.test_rpc_profiling_remote_record_function",
    "TensorPipeRpcTest.test_rpc_profiling_async_function",
    "TensorPipeRpcTest.test_async_record_function_cbs_jit_call",
    "TensorPipeRpcTest.test_server_process_global_profiler",
    "TensorPipeRpcTest.test_profiler_rpc_key_names",  # skipped on Linux by torch (issue 125365)
    # Distributed autograd (its messages go through the same agent and pickler).
    "TensorPipeDistAutogradTest.test_backward_simple_python_udf",
    "TensorPipeDistAutogradTest.test_backward_multiple_round_trips",
    "TensorPipeDistAutogradTest.test_rpc_complex_args",
    "TensorPipeDistAutogradTest.test_backward_rref",
    # The examples: batch-updating parameter server, and reinforcement learning.
    "TensorPipeParameterServerTest.test_batch_updating_parameter_server",
    "TensorPipeReinforcementLearningRpcTest.test_rl_rpc",
]

# In the default start-method mode ("auto") these still start their ranks with torch's
# "spawn" (a fresh interpreter per rank, which must pick RPC_OBSERVE=1 up through the
# .pth hook on its own); the others fork their ranks from a forkserver (see
# _spawn_processes). Each must init_rpc on every rank.
SPAWN_TESTS = [
    "TensorPipeRpcTest.test_py_user_defined",
    "TensorPipeRpcTest.test_rref_proxy_class",
    "TensorPipeParameterServerTest.test_batch_updating_parameter_server",
]

# The generated classes --full runs: every suite of torch's test_tensorpipe_agent.py
# (GENERIC_TESTS + TENSORPIPE_TESTS), CPU only.
FULL_CLASSES = [
    "TensorPipeRpcTest",
    "TensorPipeTensorPipeAgentRpcTest",
    "TensorPipeDistAutogradTest",
    "TensorPipeTensorPipeAgentDistAutogradTest",
    "TensorPipeJitRpcTest",
    "TensorPipeJitDistAutogradTest",
    "TensorPipeParameterServerTest",
    "TensorPipeReinforcementLearningRpcTest",
    "TensorPipeDistOptimizerTest",
    "TensorPipeRemoteModuleTest",
    "TensorPipeThreeWorkersRemoteModuleTest",
    "TensorPipeDdpUnderDistAutogradTest",
    "TensorPipeDdpComparisonTest",
]

ADDON_WARNING = re.compile(r"^.*rpc_observe: .*$", re.MULTILINE)


def _generate_suites(namespace: dict) -> None:
    """What torch's test/distributed/rpc/test_tensorpipe_agent.py does, plus the start-method hook."""
    from torch.testing._internal.distributed.rpc.tensorpipe_rpc_agent_test_fixture import (
        TensorPipeRpcAgentTestFixture,
    )
    from torch.testing._internal.distributed.rpc_utils import GENERIC_TESTS, TENSORPIPE_TESTS, generate_tests

    classes = generate_tests(PREFIX, TensorPipeRpcAgentTestFixture, GENERIC_TESTS + TENSORPIPE_TESTS,
                             namespace["__name__"])
    for cls in classes.values():
        cls._spawn_processes = _spawn_processes
    namespace.update(classes)


def _spawn_processes(self) -> None:
    """MultiProcessTestCase._spawn_processes, with a choice of start method; records the ranks' pids.

    torch starts every rank with "spawn": a fresh interpreter that imports torch and the
    test module (~2.5 CPU-seconds; ~6 s a test on 2 cores). "forkserver" starts one fresh
    interpreter per pytest run, with the same environment (so the .pth hook runs in it
    and patches torch.distributed.rpc when the preloaded test module imports it), and
    forks each rank from it: ~0.5 s a test. In "auto" mode the SPAWN_TESTS still use
    "spawn", to keep torch's exact set-up covered.
    """
    import torch.multiprocessing as mp

    test_id = f"{type(self).__name__}.{self._current_test_name()}"
    method = os.environ.get(START_METHOD_ENV, "spawn")
    if method == "auto":
        method = "spawn" if test_id in SPAWN_TESTS else "forkserver"
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload([type(self).__module__])
    self._start_processes(ctx.Process)
    pids_file = os.environ.get(PIDS_ENV)
    if pids_file:
        with open(pids_file, "a", encoding="utf-8") as f:
            f.write(json.dumps({"id": test_id, "start_method": method,
                                "pids": [p.pid for p in self.processes]}) + "\n")


if __name__ != "__main__":  # imported by the inner pytest, or by a spawned rank
    _generate_suites(globals())


# ---------------------------------------------------------------------------------------
# The runner (when run as a script)


def _base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RPC_OBSERVE", "OTEL_", "PYTEST_ADDOPTS"))}
    env.pop("RPC_INIT_WITH_TCP", None)  # file:// init, as torch's default
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    # common_distributed reads this when imported: a hung test fails after it, not after 300 s.
    env.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "120")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def mode_env(mode: str, out_dir: Path, start_method: str, pids_file: Path) -> dict[str, str]:
    env = _base_env()
    env[START_METHOD_ENV] = start_method
    env[PIDS_ENV] = str(pids_file)
    if mode == "on":
        env["RPC_OBSERVE"] = "1"
        env["OTEL_TRACES_EXPORTER"] = "file"
    env["RPC_OBSERVE_DIR"] = str(out_dir)  # harmless when off: nothing may write there
    return env


def pytest_command(selection: list[str], junit: Path, k_expr: str | None, verbose: bool) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", *selection,
           "-c", os.devnull, "--rootdir", str(HERE), "--confcutdir", str(HERE),
           "-p", "no:cacheprovider", f"--junitxml={junit}", "-o", "junit_logging=out-err",
           "-o", "junit_family=xunit1", "-rN", "--tb=no", "-q" if not verbose else "-v"]
    if k_expr:
        cmd += ["-k", k_expr]
    return cmd


def selection_args(full: bool) -> list[str]:
    if full:
        return [f"{THIS}::{cls}" for cls in FULL_CLASSES]
    return [f"{THIS}::{tid.replace('.', '::')}" for tid in SUBSET]


def run_mode(mode: str, workdir: Path, full: bool, k_expr: str | None, timeout: float | None,
             verbose: bool, start_method: str) -> dict:
    out_dir = workdir / f"observe-{mode}"
    shutil.rmtree(out_dir, ignore_errors=True)
    junit = workdir / f"{mode}.xml"
    log = workdir / f"{mode}.log"
    pids_file = workdir / f"{mode}-ranks.jsonl"
    for stale in (junit, pids_file):
        stale.unlink(missing_ok=True)
    cmd = pytest_command(selection_args(full), junit, k_expr, verbose)
    start = time.monotonic()
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, env=mode_env(mode, out_dir, start_method, pids_file), cwd=str(HERE), stdout=log_file,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            code = None
    seconds = time.monotonic() - start
    outcomes = parse_junit(junit) if junit.exists() else {}
    return {"mode": mode, "exit_code": code, "timed_out": code is None, "seconds": round(seconds, 1),
            "junit": str(junit), "log": str(log), "observe_dir": str(out_dir),
            "outcomes": outcomes, "telemetry": inspect_observe_dir(out_dir, pids_file, outcomes)}


def _kill_group(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)  # pytest and the rank processes it spawned
    except ProcessLookupError:
        pass
    proc.wait()


def parse_junit(path: Path) -> dict[str, dict]:
    """{"Class.test": {"outcome", "message", "seconds", "addon_warnings"}} of a pytest junit xml."""
    outcomes: dict[str, dict] = {}
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        return {"<junit>": {"outcome": "error", "message": f"unreadable junit xml: {e}", "seconds": 0.0,
                            "addon_warnings": []}}
    for case in root.iter("testcase"):
        tid = f"{case.get('classname', '').rsplit('.', 1)[-1]}.{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = node.get("message") or ""
                if tag != "skipped":
                    message = _failure_summary(node.text or message) or message
                break
        output = "".join((n.text or "") for n in case.iter() if n.tag in ("system-out", "system-err"))
        warnings = sorted(set(ADDON_WARNING.findall(output)))
        outcomes[tid] = {"outcome": outcome, "message": message.strip()[:2000],
                         "seconds": float(case.get("time") or 0.0), "addon_warnings": warnings,
                         "details": (case.find("failure") if case.find("failure") is not None
                                     else case.find("error")).text[:20000]
                         if outcome in ("failed", "error") else ""}
    return outcomes


def _failure_summary(text: str) -> str:
    """The rank exceptions of a MultiProcessTestCase failure, else its last line."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    picked = [ln.strip() for ln in lines
              if re.match(r"^\s*(Process \d+ |[\w.]*(Error|Exception|Timeout)\b)", ln)]
    return " | ".join(dict.fromkeys(picked))[:2000] if picked else (lines[-1] if lines else "")


def inspect_observe_dir(out_dir: Path, pids_file: Path, outcomes: dict[str, dict]) -> dict:
    """The span files of the ranks, matched to their tests by pid.

    The add-on opens `<RPC_OBSERVE_DIR>/spans/<worker>-<pid>.jsonl` when a process calls
    init_rpc, so a rank that ran init_rpc with the add-on active has exactly one.
    """
    spans_dir = out_dir / "spans"
    files = sorted(spans_dir.glob("*.jsonl")) if spans_dir.is_dir() else []
    spans, workers, methods = 0, set(), collections.Counter()
    pids_with_file = set()
    for f in files:
        worker, _, pid = f.stem.rpartition("-")
        workers.add(worker)
        if pid.isdigit():
            pids_with_file.add(int(pid))
        with open(f, encoding="utf-8") as fh:
            for line in fh:
                try:
                    request = json.loads(line)
                except ValueError:
                    continue
                for rs in request.get("resourceSpans", []):
                    for ss in rs.get("scopeSpans", []):
                        for span in ss.get("spans", []):
                            spans += 1
                            for a in span.get("attributes", []):
                                if a["key"] == "rpc.method":
                                    methods[a["value"].get("stringValue", "")] += 1
    entries = sorted(p.name for p in out_dir.rglob("*")) if out_dir.exists() else []
    per_test = {}
    if pids_file.exists():
        for line in pids_file.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            per_test[row["id"]] = {"start_method": row["start_method"], "ranks": len(row["pids"]),
                                   "ranks_observed": sum(p in pids_with_file for p in row["pids"])}
    for tid, info in per_test.items():
        o = outcomes.get(tid)
        if o is not None:
            o["start_method"] = info["start_method"]
            o["ranks_observed"] = f"{info['ranks_observed']}/{info['ranks']}"
    ran = [i for t, i in per_test.items() if outcomes.get(t, {}).get("outcome") == "passed"]
    return {"span_files": len(files), "spans": spans, "workers": sorted(workers),
            "top_methods": methods.most_common(12), "entries": len(entries),
            "tests_started": len(per_test),
            "passed_tests_all_ranks_observed": sum(i["ranks_observed"] == i["ranks"] for i in ran),
            "passed_tests": len(ran),
            "passed_spawn_tests": sum(i["start_method"] == "spawn" for i in ran),
            "passed_spawn_tests_all_ranks_observed": sum(i["start_method"] == "spawn" and
                                                         i["ranks_observed"] == i["ranks"] for i in ran)}


def compare(off: dict | None, on: dict | None) -> dict:
    off_o = off["outcomes"] if off else {}
    on_o = on["outcomes"] if on else {}
    ids = sorted(set(off_o) | set(on_o))
    regressions, not_ours, fixed, warnings = [], [], [], []
    for tid in ids:
        a = off_o.get(tid, {"outcome": "missing", "message": "did not run (pytest crashed or timed out?)"})
        b = on_o.get(tid, {"outcome": "missing", "message": "did not run (pytest crashed or timed out?)"})
        if off is not None and a["outcome"] != "passed":
            not_ours.append({"id": tid, "outcome": a["outcome"], "reason": a["message"]})
        if on is not None and off is not None and a["outcome"] == "passed" and b["outcome"] != "passed":
            regressions.append({"id": tid, "outcome": b["outcome"], "reason": b["message"],
                                "details": b.get("details", "")})
        if on is not None and off is not None and a["outcome"] in ("failed", "error") and b["outcome"] == "passed":
            fixed.append(tid)
        if on is not None and b.get("addon_warnings"):
            warnings.append({"id": tid, "warnings": b["addon_warnings"]})
    return {"regressions": regressions, "not_ours": not_ours, "passed_only_with_addon": fixed,
            "addon_warnings": warnings}


def count(outcomes: dict) -> dict:
    c = collections.Counter(o["outcome"] for o in outcomes.values())
    return {k: c.get(k, 0) for k in ("passed", "failed", "error", "skipped")}


def check_telemetry(off: dict | None, on: dict | None) -> list[str]:
    """Problems with the proof that the add-on was active in the ranks (and only when on)."""
    problems = []
    if off is not None and off["telemetry"]["entries"]:
        problems.append(f"the off run wrote {off['telemetry']['entries']} entries under {off['observe_dir']}")
    if on is not None:
        t = on["telemetry"]
        ran = sum(1 for o in on["outcomes"].values() if o["outcome"] != "skipped")
        if ran and not t["span_files"]:
            problems.append(f"the on run wrote no span files under {on['observe_dir']}/spans: "
                            "the add-on was not active in the rank processes")
        # The spawned ranks are torch's exact set-up: each must have come up instrumented.
        for tid, o in on["outcomes"].items():
            if o.get("start_method") == "spawn" and o["outcome"] == "passed" and tid in SPAWN_TESTS:
                seen, total = o["ranks_observed"].split("/")
                if seen != total:
                    problems.append(f"{tid} (spawned ranks): only {seen} of {total} ranks wrote a span file")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="every generated TensorPipe test (long)")
    parser.add_argument("--addon", choices=("on", "off", "both"), default="both")
    parser.add_argument("-k", dest="k_expr", help="pytest -k expression to narrow the selection")
    parser.add_argument("--junit", type=Path, help="directory for off.xml / on.xml, logs and summary.json "
                        "(default: a temporary directory, removed unless a regression is found)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds per mode before the pytest run is killed (default: 900, none with --full)")
    parser.add_argument("--start-method", choices=("auto", "spawn", "forkserver"), default="auto",
                        help="how ranks start: 'spawn' (torch's way, ~6 s a test here), 'forkserver' "
                        "(~0.5 s a test), or 'auto' (default): forkserver, but spawn for SPAWN_TESTS")
    parser.add_argument("--list", action="store_true", help="print the selected node ids and exit")
    parser.add_argument("-v", "--verbose", action="store_true", help="pytest -v in the logs")
    parser.add_argument("--quiet", action="store_true", help="print only the summary lines")
    args = parser.parse_args(argv)

    if args.list:
        print("\n".join(selection_args(args.full)))
        return 0
    try:
        import expecttest  # noqa: F401  (torch.testing._internal.common_utils imports it)
    except ImportError:
        print("run_upstream: torch's test utilities need the package 'expecttest' (pip install expecttest)",
              file=sys.stderr)
        return 2

    keep = args.junit is not None
    workdir = args.junit.resolve() if keep else Path(tempfile.mkdtemp(prefix="rpc_upstream-"))
    workdir.mkdir(parents=True, exist_ok=True)
    timeout = args.timeout if args.timeout is not None else (None if args.full else 900.0)
    modes = ("off", "on") if args.addon == "both" else (args.addon,)
    results: dict[str, dict] = {}
    for mode in modes:
        if not args.quiet:
            print(f"[{mode}] running {'--full' if args.full else f'{len(SUBSET)} curated tests'}"
                  f"{f' -k {args.k_expr!r}' if args.k_expr else ''} (log: {workdir / (mode + '.log')})",
                  flush=True)
        results[mode] = run_mode(mode, workdir, args.full, args.k_expr, timeout, args.verbose, args.start_method)
        r = results[mode]
        print(f"[{mode}] {r['seconds']:.0f}s exit={r['exit_code']}{' TIMED OUT' if r['timed_out'] else ''} "
              f"{count(r['outcomes'])} telemetry: {r['telemetry']['span_files']} span files, "
              f"{r['telemetry']['spans']} spans", flush=True)

    off, on = results.get("off"), results.get("on")
    verdict = compare(off, on)
    problems = check_telemetry(off, on)
    if on is None and off is not None:  # --addon off: its own failures are the finding
        problems += [f"{x['id']}: {x['outcome']}" for x in verdict["not_ours"] if x["outcome"] != "skipped"]
    if on is not None and off is None:
        problems += [f"{tid}: {o['outcome']}: {o['message'][:300]}" for tid, o in on["outcomes"].items()
                     if o["outcome"] in ("failed", "error")]
    for r in results.values():
        if r["timed_out"]:
            problems.append(f"the {r['mode']} run timed out after {r['seconds']:.0f}s")
        if not r["outcomes"]:
            problems.append(f"the {r['mode']} run reported no test (see {r['log']})")

    summary = {"full": args.full, "k": args.k_expr, "modes": {m: {k: v for k, v in r.items() if k != "outcomes"}
                                                             | {"counts": count(r["outcomes"])}
                                                             for m, r in results.items()},
               "outcomes": {m: {tid: {k: v for k, v in o.items() if k != "details"}
                                for tid, o in r["outcomes"].items()} for m, r in results.items()},
               **verdict, "problems": problems}
    with open(workdir / "summary.json", "w") as f:
        json.dump(summary, f, indent=1)

    if on is not None and off is not None:
        print(f"regressions (passed without the add-on, not with it): {len(verdict['regressions'])}")
        for x in verdict["regressions"]:
            print(f"  REGRESSION {x['id']}: {x['outcome']}: {x['reason'][:500]}")
    if not args.quiet or verdict["regressions"]:
        if verdict["not_ours"]:
            print(f"not ours (fail or skip without the add-on too): {len(verdict['not_ours'])}")
            for x in verdict["not_ours"]:
                print(f"  {x['id']}: {x['outcome']}: {x['reason'][:300]}")
        if verdict["passed_only_with_addon"]:
            print("passed only with the add-on (flaky?): " + ", ".join(verdict["passed_only_with_addon"]))
    if verdict["addon_warnings"]:
        print(f"rpc_observe warnings in the ranks' output: {len(verdict['addon_warnings'])} tests")
        for x in verdict["addon_warnings"][:20]:
            print(f"  {x['id']}: {x['warnings'][0][:300]}")
    for p in problems:
        print(f"PROBLEM: {p}")
    failed = bool(verdict["regressions"] or problems)
    if keep or failed:
        print(f"details: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
