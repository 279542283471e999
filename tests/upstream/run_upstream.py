#!/usr/bin/env python
"""Runs torch's own RPC test suite with the add-on off and on, and compares the outcomes.

    python tests/upstream/run_upstream.py [--full] [--addon on|off|both] [-k EXPR] [--junit DIR]

torch ships its RPC tests in the wheel (`torch.testing._internal.distributed.rpc`);
`rpc_utils.generate_tests` mixes them with the TensorPipe fixture, as torch's
`test/distributed/rpc/test_tensorpipe_agent.py` does. Each test is a
`MultiProcessTestCase`: the pytest process starts one process per rank (file:// init),
and every rank inherits the pytest process's environment, so with `RPC_OBSERVE=1` each
rank is instrumented by the installed `rpc_observe.pth` before its `init_rpc`.

Without --full the curated SUBSET below runs; --full runs every generated TensorPipe
test (436). With --addon both (the default) the selection runs twice, in one pytest
subprocess per mode: without the add-on (RPC_OBSERVE unset), then with it
(RPC_OBSERVE=1, RPC_OBSERVE_DIR=<temp dir>). Outcomes are compared per test id (junit
xml): a test that passes without the add-on and fails with it, also on a rerun, is a
regression (exit status 1); tests that fail or skip without the add-on too are
listed as "not ours". That the add-on really ran in the ranks is checked from the
span files they write, matched to each test's rank pids; the off run must write none.

Ranks start with torch's "spawn" only for SPAWN_TESTS by default; the other tests fork
them from a forkserver, itself a fresh interpreter with the same environment (see
_spawn_processes): ~0.5 s a test instead of ~6 s. --start-method spawn runs all as torch does.

This file is also the test module of the inner pytest: imported under its module name
(by pytest, or by a spawned rank), it defines the generated test classes.
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
DEADLINE_ENV = "RPC_UPSTREAM_DEADLINE"  # epoch seconds after which no test starts (pytest_runtest_setup)
DEADLINE_SKIP = "run_upstream: time budget used up (--timeout); not run"

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
    "TensorPipeRpcTest.test_stress_light_rpc",
    "TensorPipeRpcTest.test_rpc_barrier_multithreaded",
    # The pickler: a custom pickler, non-contiguous and sparse (storage-less) tensors, futures.
    "TensorPipeRpcTest.test_use_rpc_pickler",
    "TensorPipeRpcTest.test_non_cont_tensors",
    "TensorPipeRpcTest.test_pickle_future",
    "TensorPipeTensorPipeAgentRpcTest.test_send_to_rank_sparse",
    "TensorPipeTensorPipeAgentRpcTest.test_py_sparse_tensors_in_container",
    # Builtins (C++ ops: no Python UDF, no pickled request), to valid and invalid ranks.
    "TensorPipeRpcTest.test_add",
    "TensorPipeRpcTest.test_send_to_rank",
    "TensorPipeRpcTest.test_async_add",
    "TensorPipeRpcTest.test_scalar_add",
    "TensorPipeRpcTest.test_self_add",
    "TensorPipeRpcTest.test_rpc_barrier_all",
    # TorchScript functions and modules over RPC.
    "TensorPipeJitRpcTest.test_torchscript_function",
    "TensorPipeJitRpcTest.test_torchscript_functions_not_supported",
    "TensorPipeJitRpcTest.test_call_script_function_that_raises_remotely_from_script",
    "TensorPipeJitRpcTest.test_rref_as_arg_and_return",
    "TensorPipeJitRpcTest.test_async_script_udf",
    "TensorPipeJitRpcTest.test_remote_script_module",
    "TensorPipeJitRpcTest.test_async_function_remote",
    "TensorPipeJitDistAutogradTest.test_get_gradients",
    # init_rpc and shutdown (both wrapped): twice, without rank, dynamic membership, after shutdown.
    "TensorPipeRpcTest.test_init_rpc_twice",
    "TensorPipeRpcTest.test_shutdown_followed_by_rpc",
    "TensorPipeTensorPipeAgentRpcTest.test_dynamic_rpc_init_rpc_without_rank",
    "TensorPipeTensorPipeAgentRpcTest.test_dynamic_rpc_new_rank_can_communicated_with_existing_rank",
    # RRefs: remote(), owner/user RRefs, forwarding, reference counting, and the RRef proxies.
    "TensorPipeRpcTest.test_py_udf_remote",
    "TensorPipeRpcTest.test_builtin_remote_ret",
    "TensorPipeRpcTest.test_nested_remote",
    "TensorPipeRpcTest.test_nested_rref",
    "TensorPipeRpcTest.test_rref_forward_chain",
    "TensorPipeRpcTest.test_py_rref_args_user_share",
    "TensorPipeRpcTest.test_self_remote_rref_as_rpc_arg",
    "TensorPipeRpcTest.test_rref_type_blocking",
    "TensorPipeRpcTest.test_rref_get_future",
    "TensorPipeRpcTest.test_rref_context_debug_info",
    "TensorPipeRpcTest.test_rref_leak",
    "TensorPipeRpcTest.test_user_rrefs_confirmed",
    "TensorPipeRpcTest.test_owner_rref_backward",
    "TensorPipeRpcTest.test_rref_proxy_tensor",
    "TensorPipeRpcTest.test_rref_proxy_class",
    "TensorPipeRpcTest.test_async_class_rref_proxy_async",
    "TensorPipeRpcTest.test_async_class_rref_proxy_remote",
    "TensorPipeRemoteModuleTest.test_forward_async",
    # @rpc.functions.async_execution (the UDF returns a Future; the server span ends with it).
    "TensorPipeRpcTest.test_async_function_simple",
    "TensorPipeRpcTest.test_async_function_chained_remote",
    "TensorPipeRpcTest.test_async_function_nested",
    "TensorPipeRpcTest.test_async_function_raise",
    "TensorPipeRpcTest.test_async_function_wrong_return_type",
    "TensorPipeRpcTest.test_async_function_multi_fanout",
    "TensorPipeRpcTest.test_return_future",
    # Exceptions (remote, in user code, unknown function, during unpickling) and timeouts.
    "TensorPipeRpcTest.test_py_function_exception",
    "TensorPipeRpcTest.test_py_raise_in_user_func",
    "TensorPipeRpcTest.test_py_raise_in_user_func_escaped_str",
    "TensorPipeRpcTest.test_remote_with_exception",
    "TensorPipeRpcTest.test_custom_exception_throw_during_reconstruction",
    "TensorPipeRpcTest.test_function_not_on_callee",
    "TensorPipeRpcTest.test_wait_all_raise_in_user_func",
    "TensorPipeRpcTest.test_callback_with_error",
    "TensorPipeRpcTest.test_handle_send_exceptions",
    "TensorPipeRpcTest.test_rpc_timeouts",
    "TensorPipeRpcTest.test_rref_timeout",
    "TensorPipeRpcTest.test_wait_all_timeout",
    "TensorPipeTensorPipeAgentRpcTest.test_tensorpipe_set_default_timeout",
    # The legacy (autograd) profiler over RPC: remote events, keys, record_function, exported traces.
    "TensorPipeRpcTest.test_profiler_with_async_rpc_builtin",
    "TensorPipeRpcTest.test_profiler_with_async_rpc_udf",  # also under torch.profiler: see KNOWN_DIFFERENCES
    "TensorPipeRpcTest.test_profiler_with_remote_udf",
    "TensorPipeRpcTest.test_profiler_with_script_async_rpc",
    "TensorPipeRpcTest.test_profiler_with_autograd_context",
    "TensorPipeRpcTest.test_profiler_remote_events_profiled",
    "TensorPipeRpcTest.test_profiler_export_trace",
    "TensorPipeRpcTest.test_profiler_rpc_record_shapes",
    "TensorPipeRpcTest.test_profiler_rpc_memory",
    "TensorPipeRpcTest.test_rpc_profiling_remote_record_function",
    "TensorPipeRpcTest.test_rpc_profiling_async_function",
    "TensorPipeRpcTest.test_async_record_function_double_end_callbacks",
    "TensorPipeRpcTest.test_async_record_function_cbs_jit_call",
    "TensorPipeRpcTest.test_server_process_global_profiler",
    "TensorPipeRpcTest.test_profiler_rpc_key_names",  # skipped on Linux by torch (issue 125365)
    "TensorPipeJitRpcTest.test_rpc_torchscript_record_function",
    "TensorPipeJitRpcTest.test_call_rpc_with_profiling",
    "TensorPipeDistAutogradTest.test_dist_autograd_profiling",
    # Distributed autograd and optimizer (their messages go through the same agent).
    "TensorPipeDistAutogradTest.test_backward_simple_python_udf",
    "TensorPipeDistAutogradTest.test_backward_multiple_round_trips",
    "TensorPipeDistAutogradTest.test_rpc_complex_args",
    "TensorPipeDistAutogradTest.test_backward_rref",
    "TensorPipeDistOptimizerTest.test_dist_optim",
    # The examples: batch-updating parameter server, and reinforcement learning.
    "TensorPipeParameterServerTest.test_batch_updating_parameter_server",
    "TensorPipeReinforcementLearningRpcTest.test_rl_rpc",
]

# Tests whose outcome differs with the add-on for a known reason, reported to the
# add-on's maintainers. A difference here is reported as "known", not as a regression;
# once it no longer shows, the run fails until the entry is removed (like a strict xfail).
KNOWN_DIFFERENCES = {
    "TensorPipeRpcTest.test_profiler_with_async_rpc_udf":
        "deliberate (issue 2): under torch.profiler (Kineto) the add-on records a record_function "
        "named with torch's profiling key (rpc_async#...), which is the product; torch's test asserts "
        "that no such event exists under Kineto (profiler_events.ProfilerEvents.client_start)",
    "TensorPipeRpcTest.test_profiler_with_async_rpc_udf_single_threaded":
        "same as TensorPipeRpcTest.test_profiler_with_async_rpc_udf",
}

# In the default start-method mode ("auto") these still start their ranks with torch's
# "spawn" (a fresh interpreter per rank, which must pick RPC_OBSERVE=1 up through the
# .pth hook on its own, ~6 s a test here); the others fork their ranks from a
# forkserver (see _spawn_processes). Each calls init_rpc on every rank.
SPAWN_TESTS = [
    "TensorPipeRpcTest.test_py_user_defined",
    "TensorPipeRpcTest.test_rref_proxy_tensor",
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
INTERNAL_ERROR = "rpc_observe: internal error"


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
    try:
        mp.set_start_method("spawn")  # the process-wide default, as torch's _spawn_processes sets it
    except RuntimeError:
        pass
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload([type(self).__module__])
    self._start_processes(ctx.Process)
    pids_file = os.environ.get(PIDS_ENV)
    if pids_file:
        with open(pids_file, "a", encoding="utf-8") as f:
            f.write(json.dumps({"id": test_id, "start_method": method,
                                "pids": [p.pid for p in self.processes]}) + "\n")


def pytest_runtest_setup(item) -> None:
    """A pytest hook (the runner loads this module with -p): past the deadline, skip what is left.

    So a run on a slow machine still ends with a junit report of the tests that did run.
    """
    deadline = os.environ.get(DEADLINE_ENV)
    if deadline and time.time() > float(deadline):
        import pytest

        pytest.skip(DEADLINE_SKIP)


if __name__ != "__main__":  # imported by the inner pytest, or by a spawned rank
    _generate_suites(globals())


# ---------------------------------------------------------------------------------------
# The runner (when run as a script)

_running: list[subprocess.Popen] = []  # the pytest subprocess, for the SIGTERM handler
MISSING = {"outcome": "missing", "message": "did not run (pytest crashed, timed out, or the id is unknown)"}


def _base_env() -> dict[str, str]:
    """This environment without any rpc_observe / OpenTelemetry setting, and with torch's test defaults."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RPC_OBSERVE", "OTEL_"))}
    for name in ("PYTEST_ADDOPTS", "RPC_INIT_WITH_TCP", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # file:// init, as torch's run_test.py does by default
    # Read by common_distributed at import: a hung test fails after this, not after 300 s.
    env.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "120")
    # pytest loads this file as a plugin (-p run_upstream), and the ranks unpickle its classes.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def mode_env(mode: str, out_dir: Path, start_method: str, pids_file: Path,
             deadline: float | None = None) -> dict[str, str]:
    env = _base_env()
    env[START_METHOD_ENV] = start_method
    env[PIDS_ENV] = str(pids_file)
    if deadline is not None:
        env[DEADLINE_ENV] = str(deadline)
    if mode == "on":
        env["RPC_OBSERVE"] = "1"
        env["OTEL_TRACES_EXPORTER"] = "file"
    env["RPC_OBSERVE_DIR"] = str(out_dir)  # also when off: nothing may write there then
    return env


def node_ids(full: bool, ids: list[str] | None = None) -> list[str]:
    if ids is not None:
        return [f"{THIS}::{tid.replace('.', '::')}" for tid in ids]
    if full:
        return [f"{THIS}::{cls}" for cls in FULL_CLASSES]
    return [f"{THIS}::{tid.replace('.', '::')}" for tid in SUBSET]


def build_pytest_command(selection: list[str], junit: Path, k_expr: str | None, verbose: bool) -> list[str]:
    # -c /dev/null, --rootdir and --confcutdir: neither the project's pytest settings nor its
    # conftest.py files apply to torch's tests.
    cmd = [sys.executable, "-m", "pytest", *selection,
           "-c", os.devnull, "--rootdir", str(HERE), "--confcutdir", str(HERE),
           "-p", THIS.stem, "-p", "no:cacheprovider", "-p", "no:warnings", f"--junitxml={junit}",
           "-o", "junit_logging=out-err", "-o", "junit_family=xunit1", "--tb=short",
           "-v" if verbose else "-q"]
    if k_expr:
        cmd += ["-k", k_expr]
    return cmd


def run_mode(tag: str, mode: str, workdir: Path, selection: list[str], k_expr: str | None,
             timeout: float | None, verbose: bool, start_method: str) -> dict:
    """One pytest subprocess over `selection`, with the add-on `mode` ("on"/"off")."""
    out_dir = workdir / f"observe-{tag}"
    shutil.rmtree(out_dir, ignore_errors=True)
    junit, log, pids_file = workdir / f"{tag}.xml", workdir / f"{tag}.log", workdir / f"{tag}-ranks.jsonl"
    for stale in (junit, pids_file):
        stale.unlink(missing_ok=True)
    start = time.monotonic()
    # No test starts in the last part of the time budget, so that pytest ends on its own, with a report.
    deadline = time.time() + timeout - min(25.0, 0.2 * timeout) if timeout else None
    with open(log, "w") as log_file:
        proc = subprocess.Popen(build_pytest_command(selection, junit, k_expr, verbose),
                                env=mode_env(mode, out_dir, start_method, pids_file, deadline), cwd=str(HERE),
                                stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        _running.append(proc)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            _kill_group(proc)  # on timeout; else a forkserver or rank left behind
            _running.remove(proc)
    outcomes = parse_junit(junit) if junit.exists() else {}
    return {"mode": mode, "tag": tag, "exit_code": code, "timed_out": code is None,
            "seconds": round(time.monotonic() - start, 1), "junit": str(junit), "log": str(log),
            "observe_dir": str(out_dir), "outcomes": outcomes,
            "telemetry": inspect_observe_dir(out_dir, pids_file, outcomes)}


def _kill_group(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: pytest, its forkserver and ranks
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _on_sigterm(signum, frame) -> None:
    for proc in list(_running):
        _kill_group(proc)
    sys.exit(128 + signum)


def parse_junit(path: Path) -> dict[str, dict]:
    """{"Class.test": {outcome, message, seconds, addon_warnings, details}} of a pytest junit xml."""
    outcomes: dict[str, dict] = {}
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        return {"<junit>": {"outcome": "error", "message": f"unreadable junit xml: {e}", "seconds": 0.0,
                            "addon_warnings": [], "details": ""}}
    for case in root.iter("testcase"):
        tid = f"{case.get('classname', '').rsplit('.', 1)[-1]}.{case.get('name')}"
        outcome, message, details = "passed", "", ""
        for tag, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            node = case.find(tag)
            if node is not None:
                outcome, message = name, node.get("message") or ""
                if tag != "skipped":
                    details = node.text or message
                    message = _failure_summary(details) or message
                break
        output = "".join(n.text or "" for n in case.iter() if n.tag in ("system-out", "system-err"))
        outcomes[tid] = {"outcome": outcome, "message": message.strip()[:2000],
                         "seconds": float(case.get("time") or 0.0),
                         "addon_warnings": sorted(set(ADDON_WARNING.findall(output))),
                         "details": (details + "\n" + output)[-40000:] if details else ""}
    return outcomes


def _failure_summary(text: str) -> str:
    """The ranks' exception lines of a MultiProcessTestCase failure, else its last line."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    lines = [re.sub(r"^E\s+", "", ln).strip() for ln in lines]  # pytest's --tb=short marks
    picked = [ln for ln in lines if re.match(r"^(Process \d+ |[\w.]*(Error|Exception|Timeout)\b)", ln)]
    return " | ".join(dict.fromkeys(picked))[:2000] if picked else (lines[-1] if lines else "")


def inspect_observe_dir(out_dir: Path, pids_file: Path, outcomes: dict[str, dict]) -> dict:
    """The ranks' span files, matched to their tests by pid.

    The add-on opens `<RPC_OBSERVE_DIR>/spans/<worker>-<pid>.jsonl` in the wrapped init_rpc,
    so each rank that went through init_rpc with the add-on active has exactly one.
    """
    spans_dir = out_dir / "spans"
    files = sorted(spans_dir.glob("*.jsonl")) if spans_dir.is_dir() else []
    spans, workers, methods, pids_with_file = 0, set(), collections.Counter(), set()
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
    per_test = {}
    if pids_file.exists():
        for line in pids_file.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            per_test[row["id"]] = (row["start_method"], len(row["pids"]),
                                   sum(p in pids_with_file for p in row["pids"]))
    for tid, (method, ranks, observed) in per_test.items():
        if tid in outcomes:
            outcomes[tid]["start_method"] = method
            outcomes[tid]["ranks_observed"] = f"{observed}/{ranks}"
    passed = [v for t, v in per_test.items() if outcomes.get(t, {}).get("outcome") == "passed"]
    return {"span_files": len(files), "spans": spans, "workers": sorted(workers),
            "top_methods": methods.most_common(10),
            "entries": sum(1 for _ in out_dir.rglob("*")) if out_dir.exists() else 0,
            "tests_started": len(per_test), "passed_tests": len(passed),
            "passed_tests_all_ranks_observed": sum(observed == ranks for _, ranks, observed in passed),
            "passed_spawn_tests": sum(method == "spawn" for method, _, _ in passed),
            "passed_spawn_tests_all_ranks_observed": sum(method == "spawn" and observed == ranks
                                                         for method, ranks, observed in passed)}


def internal_errors(outcome: dict) -> list[str]:
    return [w for w in outcome.get("addon_warnings", []) if INTERNAL_ERROR in w]


def compare(off: dict, on: dict, reruns: list[dict]) -> dict:
    """Regressions (passed off, not on, not on a rerun either), flaky and known ones, "not ours"."""
    regressions, flaky, known, stale, not_ours, only_on, unrun = [], [], [], [], [], [], []
    for tid in sorted(set(off["outcomes"]) | set(on["outcomes"])):
        a, b = off["outcomes"].get(tid, MISSING), on["outcomes"].get(tid, MISSING)
        if DEADLINE_SKIP in (a["message"], b["message"]):
            unrun.append(tid)
            continue
        if a["outcome"] != "passed":
            not_ours.append({"id": tid, "outcome": a["outcome"], "reason": a["message"]})
            if a["outcome"] in ("failed", "error") and b["outcome"] == "passed":
                only_on.append(tid)
            continue
        entry = {"id": tid, "outcome": b["outcome"], "reason": b["message"], "details": b.get("details", "")}
        if tid in KNOWN_DIFFERENCES:
            if b["outcome"] == "passed" and not internal_errors(b):
                stale.append(tid)
            else:
                known.append(entry | {"reason": f"{b['outcome']}: {b['message'][:300]}" if b["outcome"] != "passed"
                                      else internal_errors(b)[0], "known": KNOWN_DIFFERENCES[tid]})
        elif b["outcome"] != "passed":
            retried = [r["outcomes"].get(tid, MISSING)["outcome"] for r in reruns if tid in r["selected"]]
            (flaky if "passed" in retried else regressions).append(entry | {"reruns": retried})
        elif internal_errors(b):  # passed, but the add-on failed inside: a bug all the same
            regressions.append(entry | {"outcome": "internal error", "reason": internal_errors(b)[0],
                                        "details": b.get("details") or "\n".join(b["addon_warnings"]),
                                        "reruns": []})
    return {"regressions": regressions, "flaky_with_addon": flaky, "known_differences": known,
            "known_differences_gone": stale, "not_ours": not_ours, "passed_only_with_addon": only_on,
            "not_run_time_budget": unrun, "compared": len(set(off["outcomes"]) | set(on["outcomes"])) - len(unrun)}


def count(outcomes: dict) -> dict:
    c = collections.Counter(o["outcome"] for o in outcomes.values())
    return {k: c.get(k, 0) for k in ("passed", "failed", "error", "skipped")}


def check_telemetry(results: dict[str, dict]) -> list[str]:
    """Problems with the proof that the add-on was active in the ranks, and only when on."""
    problems = []
    for r in results.values():
        t = r["telemetry"]
        if r["mode"] == "off" and t["entries"]:
            problems.append(f"the {r['tag']} run (add-on off) wrote {t['entries']} entries under {r['observe_dir']}")
        if r["mode"] == "on":
            ran = sum(1 for o in r["outcomes"].values() if o["outcome"] != "skipped")
            if ran and not t["span_files"]:
                problems.append(f"the {r['tag']} run wrote no span file under {r['observe_dir']}/spans: "
                                "the add-on was not active in the rank processes")
            # The spawned ranks are torch's exact set-up: each must have come up instrumented.
            for tid, o in r["outcomes"].items():
                if tid in SPAWN_TESTS and o["outcome"] == "passed" and o.get("start_method") == "spawn":
                    seen, total = o["ranks_observed"].split("/")
                    if seen != total:
                        problems.append(f"{tid}: only {seen} of its {total} spawned ranks wrote a span file")
    return problems


def check_selection(results: dict[str, dict], expected: list[str]) -> list[str]:
    problems = []
    for r in results.values():
        missing = [tid for tid in expected if tid not in r["outcomes"]]
        if not r["outcomes"]:
            problems.append(f"the {r['tag']} run reported no test (exit {r['exit_code']}; see {r['log']})")
        elif missing:
            problems.append(f"the {r['tag']} run did not report {len(missing)} selected tests: "
                            + ", ".join(missing[:5]))
        if r["timed_out"]:
            problems.append(f"the {r['tag']} run was killed after {r['seconds']:.0f}s (--timeout)")
        elif r["exit_code"] not in (0, 1):  # 1: some test failed; others: pytest itself did not work
            problems.append(f"pytest exited {r['exit_code']} in the {r['tag']} run (see {r['log']})")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="every generated TensorPipe test (436; long)")
    parser.add_argument("--addon", choices=("on", "off", "both"), default="both")
    parser.add_argument("-k", dest="k_expr", help="pytest -k expression to narrow the selection")
    parser.add_argument("--junit", type=Path, help="directory for the junit xml files (off.xml, on.xml), the "
                        "logs and summary.json; default: a temporary directory, removed unless something failed")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds per pytest run before it is killed (default: 900; none with --full)")
    parser.add_argument("--start-method", choices=("auto", "spawn", "forkserver"), default="auto",
                        help="how the ranks start: 'spawn' (torch's way; ~6 s a test here), 'forkserver' "
                        "(~0.5 s a test), or 'auto' (the default): forkserver, but spawn for SPAWN_TESTS")
    parser.add_argument("--rerun", type=int, default=1,
                        help="runs again, with the add-on, each test that passed off but not on (default 1); "
                        "one that then passes is reported as flaky, not as a regression")
    parser.add_argument("--list", action="store_true", help="print the selected pytest node ids and exit")
    parser.add_argument("-v", "--verbose", action="store_true", help="pytest -v in the logs")
    parser.add_argument("--quiet", action="store_true", help="print the verdict only")
    args = parser.parse_args(argv)

    selection = node_ids(args.full)
    if args.list:
        print("\n".join(selection))
        return 0
    try:
        import expecttest  # noqa: F401  (torch.testing._internal.common_utils needs it)
    except ImportError:
        print("run_upstream: torch's test utilities need the package expecttest: pip install expecttest",
              file=sys.stderr)
        return 2

    import signal

    signal.signal(signal.SIGTERM, _on_sigterm)
    if args.full:  # torch's own per-test limit; the subset's tests get 120 s (_base_env)
        os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "300")
    keep = args.junit is not None
    workdir = args.junit.resolve() if keep else Path(tempfile.mkdtemp(prefix="rpc_upstream-"))
    workdir.mkdir(parents=True, exist_ok=True)
    timeout = args.timeout if args.timeout is not None else (None if args.full else 900.0)
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))

    results: dict[str, dict] = {}
    for mode in (("off", "on") if args.addon == "both" else (args.addon,)):
        what = "--full" if args.full else f"{len(SUBSET)} curated tests"
        say(f"[{mode}] {what}{f' -k {args.k_expr!r}' if args.k_expr else ''}, ranks: {args.start_method}")
        r = results[mode] = run_mode(mode, mode, workdir, selection, args.k_expr, timeout, args.verbose,
                                     args.start_method)
        print(f"[{mode}] {r['seconds']:.0f}s {count(r['outcomes'])}; span files {r['telemetry']['span_files']}, "
              f"spans {r['telemetry']['spans']}; tests with every rank observed "
              f"{r['telemetry']['passed_tests_all_ranks_observed']}/{r['telemetry']['passed_tests']} passed",
              flush=True)

    reruns: list[dict] = []
    if "off" in results and "on" in results:
        suspects = [tid for tid, o in results["off"]["outcomes"].items() if o["outcome"] == "passed"
                    and results["on"]["outcomes"].get(tid, MISSING)["outcome"] != "passed"
                    and results["on"]["outcomes"].get(tid, MISSING)["message"] != DEADLINE_SKIP
                    and tid not in KNOWN_DIFFERENCES]
        for i in range(args.rerun if suspects else 0):
            say(f"[on-rerun{i + 1}] {len(suspects)} tests that passed off but not on")
            retry = suspects[:10]  # more than that is no flake
            r = run_mode(f"on-rerun{i + 1}", "on", workdir, node_ids(False, retry), None,
                         min(timeout or 300.0, 40.0 + 8.0 * len(retry)), args.verbose, args.start_method)
            r["selected"] = retry
            reruns.append(r)
            suspects = [tid for tid in suspects if r["outcomes"].get(tid, MISSING)["outcome"] != "passed"]
            if not suspects:
                break

    problems = check_telemetry({r["tag"]: r for r in [*results.values(), *reruns]})
    problems += check_selection(results, [] if args.full or args.k_expr else SUBSET)
    if "off" in results and "on" in results:
        verdict = compare(results["off"], results["on"], reruns)
    else:  # one mode only: its own failures are the finding
        r = next(iter(results.values()))
        failed = [{"id": t, "outcome": o["outcome"], "reason": o["message"], "details": o.get("details", "")}
                  for t, o in r["outcomes"].items() if o["outcome"] in ("failed", "error")]
        verdict = {"regressions": failed if r["mode"] == "on" else [], "flaky_with_addon": [],
                   "known_differences": [], "known_differences_gone": [],
                   "not_ours": [] if r["mode"] == "on" else failed, "passed_only_with_addon": [],
                   "not_run_time_budget": [t for t, o in r["outcomes"].items() if o["message"] == DEADLINE_SKIP],
                   "compared": 0}
    problems += [f"{tid} is in KNOWN_DIFFERENCES but now behaves the same with the add-on: remove it"
                 for tid in verdict["known_differences_gone"]]
    warnings = [{"id": t, "warnings": o["addon_warnings"]} for t, o in results.get("on", {"outcomes": {}})
                ["outcomes"].items() if o["addon_warnings"] and t not in KNOWN_DIFFERENCES]

    summary = {"full": args.full, "k": args.k_expr, "start_method": args.start_method,
               "runs": {r["tag"]: {k: v for k, v in r.items() if k != "outcomes"} | {"counts": count(r["outcomes"])}
                        for r in [*results.values(), *reruns]},
               "outcomes": {r["tag"]: {t: {k: v for k, v in o.items() if k != "details"}
                                       for t, o in r["outcomes"].items()} for r in [*results.values(), *reruns]},
               **{k: v for k, v in verdict.items()}, "addon_warnings": warnings, "problems": problems}
    with open(workdir / "summary.json", "w") as f:
        json.dump(summary, f, indent=1, default=str)
    if verdict["regressions"] or verdict["flaky_with_addon"] or verdict["known_differences"]:
        with open(workdir / "regressions.txt", "w") as f:
            for x in verdict["regressions"] + verdict["flaky_with_addon"] + verdict["known_differences"]:
                f.write(f"==== {x['id']}: {x['outcome']} (reruns: {x.get('reruns')})\n{x['details']}\n\n")

    label = ("regressions (passed without the add-on, failed with it)" if len(results) == 2
             else f"failures (add-on {next(iter(results))})")
    print(f"{label}: {len(verdict['regressions'])}")
    for x in verdict["regressions"]:
        print(f"  REGRESSION {x['id']}: {x['outcome']}: {x['reason'][:500]}")
    for x in verdict["flaky_with_addon"]:
        print(f"  flaky with the add-on (failed, then passed on rerun) {x['id']}: {x['reason'][:300]}")
    if verdict["known_differences"]:
        print(f"known differences (KNOWN_DIFFERENCES): {len(verdict['known_differences'])}")
        for x in verdict["known_differences"]:
            print(f"  {x['id']}: {x['reason'][:200]}")
    if verdict["not_ours"]:
        print(f"not ours (failed or skipped without the add-on too): {len(verdict['not_ours'])}")
        for x in verdict["not_ours"][: None if not args.quiet else 10]:
            print(f"  {x['id']}: {x['outcome']}: {x['reason'][:300]}")
    if verdict["not_run_time_budget"]:
        print(f"not run, time budget used up (--timeout): {len(verdict['not_run_time_budget'])} tests")
    if verdict["passed_only_with_addon"]:
        print("failed without the add-on but passed with it (flaky?): " + ", ".join(verdict["passed_only_with_addon"]))
    if warnings:
        print(f"rpc_observe warnings in the ranks' output of {len(warnings)} tests:")
        for x in warnings[:10]:
            print(f"  {x['id']}: {x['warnings'][0][:300]}")
    for p in problems:
        print(f"PROBLEM: {p}")
    failed = bool(verdict["regressions"] or problems)
    if keep or failed or verdict["flaky_with_addon"]:
        print(f"details: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
