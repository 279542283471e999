"""SIGTERM mid-traffic: the last spans are written, calls in flight end with an error, targets go."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from cluster import Cluster


def _wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)


def test_sigterm_writes_the_last_spans_and_removes_the_target(tmp_path):
    ready = tmp_path / "ready"
    cluster = Cluster(tmp_path, "sigterm", world=2, env={"RPC_OBSERVE": "1", "SCENARIO_READY": str(ready)})
    try:
        _wait_for(Path(f"{ready}0"))
        _wait_for(Path(f"{ready}1"))
        assert len(cluster.targets()) == 2
        # rank 0: four threads of rpc_sync, four long calls in flight, the main thread blocked in fut.wait()
        cluster.procs[0].send_signal(signal.SIGTERM)
        assert cluster.procs[0].wait(timeout=30) == -signal.SIGTERM  # terminated by the same signal, as before
        _wait_for(Path(f"{ready}1-failed"))  # rank 1's calls to rank 0 failed: it survives, then is stopped too
        cluster.procs[1].send_signal(signal.SIGTERM)
        assert cluster.procs[1].wait(timeout=30) == -signal.SIGTERM
    finally:
        cluster.kill()
    assert cluster.targets() == {}, "the file_sd targets of stopped workers must go"

    spans = cluster.spans()
    clients = {s["spanId"]: s for s in spans if s["kind"] == 3}
    servers = [s for s in spans if s["kind"] == 2 and s["worker"] == "worker1"
               and s["attrs"]["torch.rpc.src"] == "worker0"]
    assert len(servers) > 20
    # every call worker1 served for worker0 has its CLIENT span in worker0's files, written at SIGTERM
    # (calls started while the telemetry closed go unobserved: their server spans have no parent)
    parented = [s for s in servers if s.get("parentSpanId")]
    assert len(parented) > 20 and all(s["parentSpanId"] in clients for s in parented)
    worker0_long = [s for s in clients.values() if s["worker"] == "worker0" and s["attrs"]["rpc.method"] == "sleep_for"]
    assert len(worker0_long) == 4
    assert {s["status"]["code"] for s in worker0_long} == {2}
    assert {s["attrs"]["error.type"] for s in worker0_long} == {"shutdown"}
    # the survivor's calls to the stopped worker: ended with its error, written when it was stopped in turn
    worker1_long = [s for s in clients.values() if s["worker"] == "worker1" and s["attrs"]["rpc.method"] == "sleep_for"]
    assert len(worker1_long) == 2 and {s["status"]["code"] for s in worker1_long} == {2}
    assert "shutdown" not in {s["attrs"]["error.type"] for s in worker1_long}
    for rank in (0, 1):
        assert "internal error" not in cluster.log(rank), cluster.log(rank)
