"""Why is my job stuck, and where did the time go (issue 22), on real workers.

A nested-rpc_sync deadlock on pools of one thread, a UDF stuck on an Event, a worker stopped
with SIGSTOP, a healthy job read in a loop, the time split of a saturated callee, and the
spans of a trainer-like UDF: `/debug/rpc`, the watchdog's dumps and `rpc-observe doctor`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from cluster import Cluster, samples, total
from scenarios import MARKER

SCENARIOS = Path(__file__).resolve().parent / "scenarios.py"
HANG = {"RPC_OBSERVE": "1", "RPC_OBSERVE_HANG_SECONDS": "2"}
SERVER, CLIENT, INTERNAL = 2, 3, 1


def doctor(*args: str, timeout: float = 60) -> tuple[int, str, str]:
    """`rpc-observe doctor ARGS` in a process of its own: (exit status, stdout, stderr)."""
    done = subprocess.run([sys.executable, "-m", "rpc_observe", "doctor", *args], capture_output=True, text=True,
                          timeout=timeout)
    return done.returncode, done.stdout, done.stderr


def debug_rpc(target: str, timeout: float = 10) -> dict:
    with urllib.request.urlopen(f"http://{target}/debug/rpc", timeout=timeout) as response:
        assert response.headers["Content-Type"] == "application/json"
        return json.loads(response.read())


def wait_for_dumps(out_dir: Path, workers: set[str], within: float) -> dict[str, dict]:
    """The watchdog's dump of each of `workers`, waited for at most `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        dumps = {p.name.rsplit("-", 1)[0]: p for p in (out_dir / "debug").glob("*.json")}
        if workers <= set(dumps) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert workers <= set(dumps), f"dumps of {sorted(dumps)} after {within} s, expected {sorted(workers)}"
    return {w: json.loads(p.read_text()) for w, p in dumps.items()}


def user_line(frames: list[str]) -> str:
    """The innermost frame of a stack in the scenarios' own file."""
    return next(f for f in reversed(frames) if f.startswith(str(SCENARIOS)))


def line_of(text: str) -> int:
    """The line of scenarios.py that holds `text`."""
    return next(i for i, line in enumerate(SCENARIOS.read_text().splitlines(), 1) if text in line)


@pytest.fixture(scope="module")
def deadlocked(tmp_path_factory):
    env = {**HANG, "SCENARIO_POOL": "1"}
    cluster = Cluster(tmp_path_factory.mktemp("deadlock"), "deadlock", env=env, hold=True)
    try:
        cluster.wait_ready()
        started = time.monotonic()
        dumps = wait_for_dumps(cluster.out_dir, {"worker0", "worker1", "worker2"}, within=15)
        dumped_after = time.monotonic() - started
        live = {w: debug_rpc(t) for w, t in cluster.targets().items()}
        code, out, err = doctor(str(cluster.out_dir), "--json")
        text_code, text, _ = doctor(str(cluster.out_dir))
        yield cluster, dumps, dumped_after, live, (code, out, err), (text_code, text)
    finally:
        cluster.kill()


def test_the_doctor_names_the_deadlock_cycle_hop_by_hop(deadlocked):
    cluster, _, _, _, (code, out, err), (text_code, text) = deadlocked
    assert code == 1 and text_code == 1, err
    report = json.loads(out)
    # worker1 waits on worker2, worker2 on worker0, worker0 on worker1 (queued: its one thread is busy)
    assert len(report["cycles"]) == 1
    cycle = report["cycles"][0]
    start = cycle.index("worker0")
    assert cycle[start:] + cycle[:start] == ["worker0", "worker1", "worker2"]
    stuck = {(c["caller"], c["callee"]): c for c in report["calls"] if c["method"] == "ring_hop"}
    assert {k for k in stuck} >= {("worker1", "worker2"), ("worker2", "worker0"), ("worker0", "worker1")}
    assert stuck[("worker0", "worker1")]["state"] == "queued"
    assert stuck[("worker1", "worker2")]["state"] == stuck[("worker2", "worker0")]["state"] == "running"
    assert stuck[("worker1", "worker2")]["nested_in"]["caller"] == "worker0"
    blocking = f"{SCENARIOS}:{line_of('the blocking line of every hop')} in ring_hop"
    assert blocking in stuck[("worker1", "worker2")]["stack"]  # worker2's thread, where it waits on worker0
    assert report["workers"]["worker1"]["idle_threads"] == 0 and report["workers"]["worker1"]["pool_size"] == 1
    assert report["verdict"].startswith("DEADLOCK")
    # In plain words: the cycle, each hop's method and line, and the remedies.
    first = text.splitlines()[0]
    assert first.startswith("DEADLOCK") and "worker0" in first and "worker1" in first and "worker2" in first
    assert text.count(blocking) >= 3 and "ring_hop" in text
    assert "async_execution" in text and "num_worker_threads" in text


def test_the_watchdog_dumps_every_worker_in_time(deadlocked):
    cluster, dumps, dumped_after, _, _, _ = deadlocked
    assert dumped_after < 2 + 3  # RPC_OBSERVE_HANG_SECONDS, plus the watchdog's 0.5 s period and start-up
    for worker, dump in dumps.items():
        assert dump["schema"] == "rpc_observe.debug/1" and dump["worker"] == worker and dump["reason"] == "hang"
        assert dump["hang_seconds"] == 2.0 and dump["agent"]["pool_size"] == 1
    # the watchdog named the call and the file in one warning, once per incident
    for rank in range(3):
        warnings = [line for line in cluster.log(rank).splitlines() if "RPC_OBSERVE_HANG_SECONDS=2" in line]
        assert len(warnings) == 1 and f"worker{rank}-" in warnings[0] and "rpc-observe doctor" in warnings[0]


def test_debug_rpc_links_each_call_to_the_udf_it_waits_in(deadlocked):
    _, _, _, live, _, _ = deadlocked
    w1, w2 = live["worker1"], live["worker2"]
    served = next(s for s in w2["serving"] if s["method"] == "ring_hop")
    assert served["caller"] == "worker1"
    issued = next(c for c in w1["calls"] if c["method"] == "ring_hop" and c["peer"] == "worker2")
    assert served["call_id"] == issued["call_id"]  # the join key, (caller, call id)
    assert issued["mode"] == "sync" and issued["age_s"] > 1 and issued["trace_id"] == served["trace_id"]
    assert issued["nested_in"] == {"caller": "worker0", "call_id": issued["nested_in"]["call_id"],
                                   "method": "ring_hop"}
    assert user_line(w1["stacks"][str(issued["thread"])]).endswith(" in ring_hop")
    for snapshot in live.values():  # never an argument's value: the marker string was every hop's argument
        assert MARKER not in json.dumps(snapshot)


def test_dumps_hold_no_argument_values(deadlocked):
    cluster = deadlocked[0]
    for path in (cluster.out_dir / "debug").glob("*.json"):
        assert MARKER not in path.read_text()


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("stuck"), "stuck", env=HANG, hold=True)
    try:
        cluster.wait_ready()
        wait_for_dumps(cluster.out_dir, {"worker1"}, within=15)  # the UDF on the Event
        os.kill(cluster.procs[2].pid, signal.SIGSTOP)
        try:
            code, out, err = doctor(str(cluster.out_dir), "--json", "--timeout", "1")
            text_code, text, _ = doctor(str(cluster.out_dir), "--timeout", "1")
        finally:
            os.kill(cluster.procs[2].pid, signal.SIGCONT)
        yield cluster, (code, out, err), (text_code, text)
    finally:
        cluster.kill()


def test_a_stopped_worker_is_unreachable_and_its_callers_are_named(stopped):
    _, (code, out, err), (text_code, text) = stopped
    assert code == 1 and text_code == 1, err
    report = json.loads(out)
    assert report["workers"]["worker2"]["reachable"] is False
    assert report["workers"]["worker0"]["reachable"] and report["workers"]["worker1"]["reachable"]
    waiting = [c for c in report["calls"] if c["callee"] == "worker2"]
    assert [(c["caller"], c["method"], c["state"]) for c in waiting] == [("worker0", "sleep_for", "unreachable")]
    assert "worker2" in text.splitlines()[0] and "sleep_for" in text


def test_a_udf_stuck_in_user_code_points_at_its_line(stopped):
    _, (_, out, _), (_, text) = stopped
    report = json.loads(out)
    line = f"{SCENARIOS}:{line_of('the line a stuck UDF')} in wait_for_ever"
    stuck = [u for u in report["stuck_udfs"] if u["worker"] == "worker1"]
    assert [(u["caller"], u["method"], u["line"]) for u in stuck] == [("worker0", "wait_for_ever", line)]
    assert line in text
    assert MARKER not in out and MARKER not in text


def test_a_healthy_job_read_in_a_loop_is_well_and_unchanged(tmp_path):
    cluster = Cluster(tmp_path, "busy", env={"RPC_OBSERVE": "1"})
    targets: dict[str, str] = {}
    reads, failures = [], []

    def read_in_a_loop() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(p.poll() is None for p in cluster.procs):
            try:
                targets.update(cluster.targets())
            except (OSError, ValueError):  # a target file going away as its worker stops
                pass
            for target in list(targets.values()):
                try:
                    reads.append(len(debug_rpc(target, timeout=2)["calls"]))
                except (OSError, urllib.error.URLError) as e:  # a worker that has shut down
                    failures.append(type(e).__name__)

    reader = threading.Thread(target=read_in_a_loop)
    reader.start()
    deadline = time.monotonic() + 60
    while len(targets) < 3 and time.monotonic() < deadline:  # mid-run: every worker up
        time.sleep(0.1)
    time.sleep(0.5)
    code, out, err = doctor(str(cluster.out_dir), "--json")
    results = cluster.wait()
    reader.join()
    assert code == 0, out + err
    report = json.loads(out)
    assert report["cycles"] == [] and report["verdict"]
    assert all(w["reachable"] for w in report["workers"].values())
    assert results[0]["errors"] == [] and results[0]["wrong"] == 0 and results[0]["calls"] > 50
    assert len(reads) > 20 and sum(reads) > 0  # read while calls were in flight


def test_unknown_paths_are_404_and_metrics_are_still_served(tmp_path):
    cluster = Cluster(tmp_path, "basic", env={"RPC_OBSERVE": "1"}, rank_env={1: {"RPC_OBSERVE_HANG_SECONDS": "45"}},
                      hold=True)
    try:
        cluster.wait_ready()
        targets = cluster.targets()
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(f"http://{targets['worker1']}/debug/rpc/../secrets", timeout=10)
        assert raised.value.code == 404
        thresholds = {}
        for worker in ("worker0", "worker1"):
            with urllib.request.urlopen(f"http://{targets[worker]}/metrics", timeout=10) as response:
                scraped = samples(response.read().decode())
            assert any(name == "torch_rpc_client_oldest_call_age_seconds" for name, _, _ in scraped)
            thresholds[worker] = total(scraped, "rpc_observe_hang_threshold_seconds", worker=worker)
        # Each worker's own RPC_OBSERVE_HANG_SECONDS, which the stuck alerts compare the ages with.
        assert thresholds == {"worker0": 30.0, "worker1": 45.0}
    finally:
        cluster.wait()


def test_the_recorder_size_bounds_the_finished_calls_debug_rpc_shows(tmp_path):
    """RPC_OBSERVE_RECORDER_SIZE on real workers: /debug/rpc lists the last N finished calls, the ones the C core
    ends inline included (its ending once wrote to a table the recorder no longer read once N was set)."""
    cluster = Cluster(tmp_path, "basic", env={"RPC_OBSERVE": "1", "RPC_OBSERVE_RECORDER_SIZE": "3"},
                      rank_env={1: {"RPC_OBSERVE_RECORDER_SIZE": "1"}}, hold=True)
    try:
        cluster.wait_ready()
        targets = cluster.targets()
        assert len(debug_rpc(targets["worker0"])["finished"]) == 3  # basic made 17 calls: the newest 3 are kept
        # worker1's one call: the nested rpc_sync to worker2, whose echoed response ends it inline (in C)
        [finished] = debug_rpc(targets["worker1"])["finished"]
        assert (finished["method"], finished["peer"], finished["mode"], finished["status"]) == (
            "nested", "worker2", "sync", "ok"), finished
    finally:
        cluster.wait()


def test_a_saturated_callee_shows_as_outside_time(tmp_path):
    cluster = Cluster(tmp_path, "split", env={"RPC_OBSERVE": "1"}, rank_env={1: {"SCENARIO_POOL": "1"}}, hold=True)
    _, scraped = cluster.scrape_held(workers=("worker0",))
    w0 = scraped["worker0"]
    labels = {"method": "sleep_for", "mode": "sync"}
    count = total(w0, "torch_rpc_client_callee_seconds_count", **labels)
    callee = total(w0, "torch_rpc_client_callee_seconds_sum", **labels)
    outside = total(w0, "torch_rpc_client_outside_seconds_sum", **labels)
    client = total(w0, "torch_rpc_client_duration_seconds_sum", **labels)
    assert count == 40 == total(w0, "torch_rpc_client_outside_seconds_count", **labels)
    assert 0.019 <= callee / count <= 0.06  # the callee's own time stays ~20 ms
    assert outside > 2 * callee  # 8 callers on a pool of 1: most of the time is queueing
    assert client == pytest.approx(callee + outside, rel=1e-6)  # client = callee + outside


def test_spans_after_backward_in_a_udf_keep_their_parent(tmp_path):
    cluster = Cluster(tmp_path, "nested_spans", env={"RPC_OBSERVE": "1"})
    results = cluster.wait()
    assert results[0]["rounds"] == 3
    spans = cluster.spans()
    by_id = {s["spanId"]: s for s in spans}
    server = next(s for s in spans if s["kind"] == SERVER and s["attrs"]["rpc.method"] == "nested_spans_udf")

    def descends(span: dict) -> bool:
        while span.get("parentSpanId"):
            if span["parentSpanId"] == server["spanId"]:
                return True
            span = by_id.get(span["parentSpanId"], {})
        return False

    names = {s["name"] for s in spans if s["worker"] == "worker1" and s["kind"] == INTERNAL}
    assert any("dist_autograd.backward" in n for n in names) and any("DistributedOptimizer.step" in n for n in names)
    orphans = [s["name"] for s in spans if s["worker"] == "worker1" and s["kind"] in (CLIENT, INTERNAL)
               and "_gather_to_leader" not in s["name"] and "_broadcast" not in s["name"]
               and "_all_gather" not in s["name"] and not descends(s)]
    assert orphans == []
    backwards = [s for s in spans if s["name"] == "dist_autograd.backward" and s["worker"] == "worker1"]
    assert len(backwards) == 3
