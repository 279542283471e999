"""`rpc-observe doctor`: snapshots in the schema "rpc_observe.debug/1" (its input format, built
here as dicts) joined into a wait-for graph; cycles, stuck UDFs, unreachable workers; bad input
in one line; live fetching over real HTTP from servers on 127.0.0.1 port 0."""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rpc_observe import doctor
from rpc_observe.doctor import SCHEMA, Worker, diagnose, main, render_text
from rpc_observe.doctor import sources as doctor_sources

NOW = 1_790_000_000.0
THREADING = "/usr/lib/python3.11/threading.py"
TORCH = "/venv/lib/python3.11/site-packages/torch/distributed/rpc"


def stack(*user: str) -> list[str]:
    """A pool thread's stack, innermost last: threading, torch's UDF runner, the user, then rpc_sync."""
    return [f"{THREADING}:1002 in _bootstrap", f"{THREADING}:1045 in _bootstrap_inner",
            f"{TORCH}/internal.py:207 in _run_function", *user, f"{TORCH}/api.py:842 in rpc_sync",
            "/venv/lib/python3.11/site-packages/rpc_observe/hooks/client.py:80 in rpc_sync"]


def call(call_id: int | None, peer: str, age: float, thread: int, nested_in: dict | None = None,
         method: str = "hop", mode: str = "sync") -> dict[str, Any]:
    return {"call_id": call_id, "method": method, "peer": peer, "mode": mode, "age_s": age, "trace_id": None,
            "span_id": None, "thread": thread, "thread_name": None, "nested_in": nested_in}


def served(caller: str, call_id: int | None, age: float, thread: int, method: str = "hop") -> dict[str, Any]:
    return {"caller": caller, "call_id": call_id, "method": method, "mode": "sync", "age_s": age, "thread": thread,
            "trace_id": None}


def nested(caller: str, call_id: int, method: str = "hop") -> dict[str, Any]:
    return {"caller": caller, "call_id": call_id, "method": method}


def snap(worker: str, calls: list | None = None, serving: list | None = None, stacks: dict | None = None,
         pool: int = 1, idle: int = 0, time_unix_s: float = NOW, hang: float = 30.0, run: str = "run1",
         reason: str = "live") -> dict[str, Any]:
    calls, serving = calls or [], serving or []
    return {"schema": SCHEMA, "worker": worker, "rank": int(worker[-1]), "pid": 4240 + int(worker[-1]),
            "run_id": run, "host": "node0", "time_unix_s": time_unix_s, "reason": reason, "hang_seconds": hang,
            "agent": {"pool_size": pool, "idle_threads": idle, "client_active_calls": len(calls),
                      "server_active_calls": len(serving), "server_active_async_calls": 0},
            "calls": calls, "serving": serving, "finished": [], "stacks": stacks or {}}


def live(*snapshots: dict[str, Any]) -> dict[str, Worker]:
    return {s["worker"]: Worker(s["worker"], doctor.parse_snapshot(s), True, "live") for s in snapshots}


def two_worker_deadlock(age: float = 9.8) -> list[dict[str, Any]]:
    """worker0's main loop calls hop on worker1, whose only pool thread calls hop on worker2, whose
    only pool thread calls hop on worker1: that request waits for worker1's busy thread."""
    return [
        snap("worker0", [call(3, "worker1", age + 0.2, 1)], idle=1, stacks={"1": ["/tmp/app.py:20 in main"]}),
        snap("worker1", [call(12, "worker2", age, 11, nested("worker0", 3))], [served("worker0", 3, age + 0.1, 11)],
             {"11": stack("/tmp/app.py:5 in hop")}),
        snap("worker2", [call(7, "worker1", age - 0.1, 21, nested("worker1", 12))],
             [served("worker1", 12, age - 0.05, 21)], {"21": stack("/tmp/app.py:6 in hop")}),
    ]


def test_a_two_worker_cycle_is_named_in_order_with_methods_and_user_lines() -> None:
    d = diagnose(live(*two_worker_deadlock()))
    assert [[hop.worker for hop in cycle] for cycle in d.cycles] == [["worker1", "worker2"]]
    first, second = d.cycles[0]
    assert (first.call.callee, first.call.method, first.call.call_id, first.call.state, first.line) == \
        ("worker2", "hop", 12, "running", "/tmp/app.py:5 in hop")
    assert (second.call.callee, second.call.call_id, second.call.state, second.line) == \
        ("worker1", 7, "queued", "/tmp/app.py:6 in hop")
    assert d.status == 1
    assert d.verdict == ("DEADLOCK: worker1 -> worker2 -> worker1: every pool thread waits on a nested RPC "
                         "(pool exhausted by nested rpc_sync)")
    text = render_text(d, now_unix_s=NOW).splitlines()
    assert text[:4] == [
        d.verdict,
        "  worker1 waits on worker2: hop, call 12, running 9.8 s, at /tmp/app.py:5 in hop",
        "  worker2 waits on worker1: hop, call 7, queued 9.7 s (worker1: 0 of 1 pool threads idle), "
        "at /tmp/app.py:6 in hop",
        "Remedies: make the nested call with rpc_async and return its future from a @rpc.functions.async_execution "
        "function, or raise num_worker_threads in TensorPipeRpcBackendOptions (now 1 on worker1).",
    ]
    assert text[-1] == ("workers: worker0 live, pool 1, 1 idle; worker1 live, pool 1, 0 idle; "
                        "worker2 live, pool 1, 0 idle")


def test_a_three_worker_cycle_starts_at_the_alphabetically_first_worker() -> None:
    """worker0 -> worker3 -> worker1 -> worker2 -> worker3 (queued): the cycle is 1 -> 2 -> 3."""
    d = diagnose(live(
        snap("worker0", [call(1, "worker3", 12.0, 1)], idle=1),
        snap("worker3", [call(2, "worker1", 11.5, 31, nested("worker0", 1), method="pull")],
             [served("worker0", 1, 11.9, 31)], {"31": stack("/tmp/ps.py:33 in forward")}),
        snap("worker1", [call(3, "worker2", 11.0, 11, nested("worker3", 2), method="push")],
             [served("worker3", 2, 11.4, 11, method="pull")], {"11": stack("/tmp/ps.py:11 in pull")}),
        snap("worker2", [call(4, "worker3", 10.0, 21, nested("worker1", 3))],
             [served("worker1", 3, 10.9, 21, method="push")], {"21": stack("/tmp/ps.py:22 in push")}),
    ))
    assert [[hop.worker for hop in cycle] for cycle in d.cycles] == [["worker1", "worker2", "worker3"]]
    hops = [(h.worker, h.call.callee, h.call.method, h.call.state, h.line) for h in d.cycles[0]]
    assert hops == [("worker1", "worker2", "push", "running", "/tmp/ps.py:11 in pull"),
                    ("worker2", "worker3", "hop", "queued", "/tmp/ps.py:22 in push"),
                    ("worker3", "worker1", "pull", "running", "/tmp/ps.py:33 in forward")]
    assert d.verdict.startswith("DEADLOCK: worker1 -> worker2 -> worker3 -> worker1: ")
    assert doctor.as_json(d)["cycles"] == [["worker1", "worker2", "worker3"]]


def test_a_worker_calling_itself_from_its_only_pool_thread_is_a_cycle_of_one() -> None:
    d = diagnose(live(snap("worker0", [call(1, "worker1", 5.0, 1)], idle=1),
                      snap("worker1", [call(2, "worker1", 4.0, 11, nested("worker0", 1), method="inner")],
                           [served("worker0", 1, 4.5, 11)], {"11": stack("/tmp/app.py:3 in outer")})))
    assert [(h.worker, h.call.method, h.call.state, h.line) for h in d.cycles[0]] == \
        [("worker1", "inner", "queued", "/tmp/app.py:3 in outer")]
    assert d.verdict.startswith("DEADLOCK: worker1 -> worker1: every pool thread waits on a nested RPC")


def test_a_call_waiting_for_an_exhausted_pool_is_queued() -> None:
    d = diagnose(live(
        snap("worker0", [call(5, "worker1", 40.0, 1)], idle=1),
        snap("worker1", [call(9, "worker2", 3.0, 11, nested("worker2", 2))], [served("worker2", 2, 3.5, 11)]),
        snap("worker2", [call(2, "worker1", 3.6, 1)], idle=1),
    ))
    assert {(c.caller, c.call_id): c.state for c in d.calls} == {("worker0", 5): "queued", ("worker2", 2): "running",
                                                                 ("worker1", 9): "unknown"}
    assert not d.cycles and not d.stuck_udfs and d.status == 1
    assert d.verdict == ("STUCK: 1 call(s) in flight for 30 s or more; the oldest: worker0 -> worker1 hop, "
                         "queued 40.0 s")
    assert "  worker0 -> worker1: hop, call 5, queued 40.0 s (worker1: 0 of 1 pool threads idle)" in \
        render_text(d, now_unix_s=NOW).splitlines()


def test_a_udf_stuck_on_event_wait_points_at_the_user_line() -> None:
    frames = [f"{THREADING}:1002 in _bootstrap", f"{TORCH}/internal.py:207 in _run_function",
              "/tmp/app.py:9 in wait_for_flag", f"{THREADING}:629 in wait", f"{THREADING}:327 in wait"]
    d = diagnose(live(snap("worker0", [call(3, "worker1", 45.0, 1)], idle=1),
                      snap("worker1", serving=[served("worker0", 3, 44.9, 11, method="wait_for_flag")],
                           stacks={"11": frames})))
    assert [(u.worker, u.caller, u.method, u.line) for u in d.stuck_udfs] == \
        [("worker1", "worker0", "wait_for_flag", "/tmp/app.py:9 in wait_for_flag")]
    assert d.verdict == ("STUCK IN USER CODE: worker1 has run wait_for_flag for worker0 for 44.9 s, "
                         "at /tmp/app.py:9 in wait_for_flag")
    assert d.calls[0].stack == frames and d.status == 1


def test_an_unreachable_worker_is_named_with_its_waiters() -> None:
    workers = live(snap("worker0", [call(4, "worker1", 3.0, 1, method="step")], idle=1))
    workers["worker1"] = Worker("worker1", None, False, "none", "http://127.0.0.1:9/debug/rpc",
                                "http://127.0.0.1:9/debug/rpc: no answer within 2 s")
    d = diagnose(workers)
    assert d.verdict == ("UNREACHABLE: worker1 does not answer (http://127.0.0.1:9/debug/rpc: no answer within 2 s); "
                         "1 call(s) wait on it")
    out = doctor.as_json(d)
    assert [(c["caller"], c["method"], c["age_s"], c["state"]) for c in out["unreachable"]["worker1"]] == \
        [("worker0", "step", 3.0, "unreachable")]
    assert out["workers"]["worker1"]["reachable"] is False and out["workers"]["worker1"]["source"] == "none"
    assert d.status == 1


def test_a_healthy_job_exits_0() -> None:
    d = diagnose(live(snap("worker0", [call(1, "worker1", 0.01, 1)], idle=1),
                      snap("worker1", serving=[served("worker0", 1, 0.005, 11)], idle=3, pool=4)))
    assert d.status == 0 and d.verdict.startswith("OK: no call is stuck") and d.calls[0].state == "running"


def test_a_busy_healthy_job_shows_no_cycle() -> None:
    """The deadlock's shape, caught in a snapshot of calls younger than a second, is not one."""
    d = diagnose(live(*two_worker_deadlock(age=0.3)))
    assert not d.cycles and d.status == 0


def test_the_threshold_defaults_to_the_smallest_hang_seconds() -> None:
    workers = live(snap("worker0", [call(1, "worker1", 12.0, 1)], idle=1, hang=10.0),
                   snap("worker1", serving=[served("worker0", 1, 11.0, 11)], idle=0, hang=20.0))
    assert diagnose(workers).threshold_s == 10.0 and diagnose(workers).stuck_calls
    assert diagnose(workers, threshold_s=60.0).status == 0


# The command: bad input, files, live HTTP.

def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def write_dumps(run_dir: Path, snapshots: list[dict[str, Any]]) -> None:
    (run_dir / "debug").mkdir(parents=True, exist_ok=True)
    for s in snapshots:
        (run_dir / "debug" / f"{s['worker']}-{s['pid']}.json").write_text(json.dumps(s))


def test_bad_inputs_exit_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    garbage, other = tmp_path / "worker1-7.json", tmp_path / "other.json"
    garbage.write_text("{not json")
    other.write_text(json.dumps({"schema": "someone.else/2", "worker": "w"}))
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hello")
    cases = {str(tmp_path / "empty"): "no readable targets/*.json and no debug/*.json",
             str(garbage): f"{garbage}: not JSON", str(other): f"{other}: schema 'someone.else/2', not",
             str(tmp_path / "nowhere"): "no such file or directory", str(tmp_path / "notes.txt"): "neither",
             "http://127.0.0.1:1": "nothing readable: http://127.0.0.1:1/debug/rpc ("}
    for arg, says in cases.items():
        status, out, err = run_main(capsys, arg, "--timeout", "1")
        assert status == 2 and out == "" and err.count("\n") == 1, (arg, err)
        assert err.startswith("rpc-observe doctor: ") and says in err, (arg, err)
    for argv in (["--timeout", "soon"], ["--threshold", "-1"], ["--what"]):
        status, out, err = run_main(capsys, str(tmp_path), *argv)
        assert status == 2 and err.count("\n") == 1, (argv, err)


def test_a_run_dir_of_dumps_alone_is_diagnosed_and_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    snapshots = [{**s, "reason": "hang", "time_unix_s": NOW + i} for i, s in enumerate(two_worker_deadlock())]
    write_dumps(tmp_path, snapshots)
    # An older dump of worker2 (an earlier process): the newest one counts.
    (tmp_path / "debug" / "worker2-1.json").write_text(json.dumps(snap("worker2", time_unix_s=NOW - 600)))
    status, out, _ = run_main(capsys, str(tmp_path))
    assert status == 1 and out.startswith("DEADLOCK: worker1 -> worker2 -> worker1: ")
    assert "\nfrom dumps only (no worker answered): the oldest (worker0) of " in out
    assert "; worker2, dump of " in out and " ago (hang), pool 1, 0 idle" in out
    status, out, _ = run_main(capsys, str(tmp_path), "--json")
    report = json.loads(out)
    assert status == 1 and report["cycles"] == [["worker1", "worker2"]] and report["from_dumps_only"]
    assert {w: (v["reachable"], v["source"]) for w, v in report["workers"].items()} == \
        {"worker0": (False, "dump"), "worker1": (False, "dump"), "worker2": (False, "dump")}


def test_a_run_dirs_unreadable_or_other_run_dumps_are_left_out_with_a_note(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_dumps(tmp_path, [snap("worker0", [call(1, "worker1", 50.0, 1)], idle=1, run="run2"),
                           snap("worker1", run="run1", time_unix_s=NOW - 3600)])
    (tmp_path / "debug" / "worker2-9.json").write_text('{"schema": "rpc_observe.debug/1", "wor')  # cut short
    status, out, _ = run_main(capsys, str(tmp_path), "--json")
    report = json.loads(out)
    assert sorted(report["workers"]) == ["worker0"] and status == 1 and report["verdict"].startswith("STUCK: ")
    assert [note.split(": ", 1)[1] for note in report["notes"]] == [
        "not JSON (Unterminated string starting at: line 1 column 35 (char 34)); expected a rpc_observe.debug/1 dump",
        "a dump of run run1, not of run2"]


def test_the_command_runs_as_a_module(tmp_path: Path) -> None:
    write_dumps(tmp_path / "stuck", two_worker_deadlock())
    write_dumps(tmp_path / "fine", [snap("worker0", [call(1, "worker1", 0.1, 1)], idle=1)])
    env = {k: v for k, v in os.environ.items() if not k.startswith("RPC_OBSERVE")}
    for args, status in (([str(tmp_path / "stuck")], 1), ([str(tmp_path / "fine")], 0),
                         ([str(tmp_path / "nowhere")], 2)):
        run = subprocess.run([sys.executable, "-m", "rpc_observe", "doctor", *args], capture_output=True, text=True,
                             env=env, timeout=60)
        assert run.returncode == status, run.stderr
        assert "Traceback" not in run.stderr


class _SnapshotHandler(http.server.BaseHTTPRequestHandler):
    snapshot: dict[str, Any] = {}

    def do_GET(self) -> None:
        body = json.dumps(self.snapshot).encode() if self.path == "/debug/rpc" else b"{}"
        self.send_response(200 if self.path == "/debug/rpc" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def worker_endpoint() -> Iterator[str]:
    """A real HTTP server on 127.0.0.1 (port from the OS) serving worker0's snapshot at /debug/rpc."""
    handler = type("Handler", (_SnapshotHandler,),
                   {"snapshot": snap("worker0", [call(8, "worker1", 5.0, 1, method="step")], idle=1)})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """A server that accepts connections and never answers, like a worker stopped with SIGSTOP."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop, held = threading.Event(), []

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    listener.close()


def test_live_snapshots_are_fetched_over_http(worker_endpoint: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_main(capsys, f"http://{worker_endpoint}", "--json")
    report = json.loads(out)
    assert report["workers"]["worker0"] == {**report["workers"]["worker0"], "reachable": True, "source": "live",
                                            "pool_size": 1, "idle_threads": 1}
    assert [(c["callee"], c["method"], c["state"]) for c in report["calls"]] == [("worker1", "step", "unknown")]
    assert status == 0 and err == ""
    status, out, _ = run_main(capsys, f"http://{worker_endpoint}/debug/rpc")  # the full URL is used as is
    assert status == 0 and out.startswith("OK: no call is stuck")


def test_fetches_run_at_most_max_fetches_at_once_and_all_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job of many workers costs MAX_FETCHES threads, not one per worker, and every worker is still read."""
    state = {"now": 0, "most": 0}
    lock = threading.Lock()

    class Slow(_SnapshotHandler):
        snapshot = snap("worker0", [], idle=1)

        def do_GET(self) -> None:
            with lock:
                state["now"] += 1
                state["most"] = max(state["most"], state["now"])
            time.sleep(0.05)
            with lock:
                state["now"] -= 1
            self.path = self.path.partition("?")[0]
            super().do_GET()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(doctor_sources, "MAX_FETCHES", 3)
        # Distinct URLs of the same server: every path below /debug/rpc?n=... is one worker to read.
        urls = [f"http://127.0.0.1:{server.server_address[1]}/debug/rpc?n={i}" for i in range(12)]
        results = doctor_sources.fetch_all(urls, 2.0)
        assert not [t for t in threading.enumerate() if t.name.startswith("doctor fetch")]  # the fetchers are gone
    finally:
        server.shutdown()
        server.server_close()
    assert state["most"] == 3
    assert sorted(results) == sorted(urls) and all(isinstance(r, dict) for r in results.values()), results


def test_a_worker_that_never_answers_is_unreachable_within_the_timeout(
        tmp_path: Path, worker_endpoint: str, silent_endpoint: str, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "targets").mkdir()
    for name, target in (("worker0", worker_endpoint), ("worker1", silent_endpoint)):
        group = [{"targets": [target], "labels": {"job": "rpc_observe", "rpc_observe_run_id": "run1"}}]
        (tmp_path / "targets" / f"{name}.json").write_text(json.dumps(group))
    started = time.monotonic()
    status, out, _ = run_main(capsys, str(tmp_path), "--timeout", "0.5", "--json")
    assert time.monotonic() - started < 2.0
    report = json.loads(out)
    assert status == 1 and report["verdict"].startswith("UNREACHABLE: worker1 does not answer (")
    assert report["workers"]["worker1"] == {**report["workers"]["worker1"], "reachable": False, "source": "none"}
    assert [(c["caller"], c["method"]) for c in report["unreachable"]["worker1"]] == [("worker0", "step")]
    # With a dump of the stopped worker, the dump feeds the graph and the worker is still unreachable.
    write_dumps(tmp_path, [snap("worker1", serving=[served("worker0", 8, 4.0, 11)], reason="hang")])
    status, out, _ = run_main(capsys, str(tmp_path), "--timeout", "0.5")
    assert status == 1 and out.startswith("UNREACHABLE: worker1 does not answer (")
    assert "worker1 unreachable (http://" in out and ", dump of " in out


def test_the_recorders_dump_is_what_the_doctor_reads_and_the_merge_skips(tmp_path: Path) -> None:
    """The schema is written in telemetry and read in doctor and merge (rooms that import no other):
    a dump from the writer itself holds them to one format."""
    from rpc_observe.merge.inputs import IgnoredInput, load_input
    from rpc_observe.telemetry.recorder import FlightRecorder

    tables = {"agent": None, "calls": [], "serving": [], "finished": [], "stacks": {}}
    recorder = FlightRecorder("worker3", 3, "run1", str(tmp_path), 30.0, lambda read_torch: tables, lambda: (0.0, ""))
    path = recorder.dump("hang")
    assert path is not None
    parsed = doctor_sources.read_dump(Path(path))
    assert parsed["schema"] == SCHEMA and parsed["worker"] == "worker3" and parsed["reason"] == "hang"
    with pytest.raises(IgnoredInput, match="flight recorder dump"):
        load_input(Path(path))
