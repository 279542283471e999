"""A failing job exits cleanly while its endpoints are scraped: no C++ abort at interpreter exit."""

from __future__ import annotations

import threading
import time
import urllib.request
from pathlib import Path

import pytest

from cluster import Cluster

ABORTS = ("terminate called", "Fatal Python error", "Aborted", "Segmentation fault")


def _scrape_until(stop: threading.Event, targets: dict[str, str], counts: dict[str, int]) -> None:
    while not stop.is_set():
        for target in targets.values():
            try:
                urllib.request.urlopen(f"http://{target}/metrics", timeout=0.5).read()
                counts["ok"] += 1
            except OSError:
                counts["failed"] += 1
        time.sleep(0.02)


@pytest.mark.parametrize("round_", range(3))
def test_a_failing_job_exits_cleanly_while_scraped(tmp_path, round_):
    ready = tmp_path / "ready"
    env = {"RPC_OBSERVE": "1", "SCENARIO_READY": str(ready), "PYTHONFAULTHANDLER": "1"}
    cluster = Cluster(tmp_path, "failing_exit", world=3, env=env)
    stop, counts = threading.Event(), {"ok": 0, "failed": 0}
    try:
        deadline = time.monotonic() + 60
        while not all(Path(f"{ready}{r}").exists() for r in range(3)):
            assert time.monotonic() < deadline, "the job never got ready"
            time.sleep(0.05)
        scraper = threading.Thread(target=_scrape_until, args=(stop, cluster.targets(), counts))
        scraper.start()
        codes = [proc.wait(timeout=60) for proc in cluster.procs]
    finally:
        stop.set()
        cluster.kill()
    scraper.join()
    assert counts["ok"] > 10  # the endpoints were scraped through the job's last second
    for rank, code in enumerate(codes):
        log = cluster.log(rank)
        assert not [a for a in ABORTS if a in log], log[-3000:]
        assert code == 1, f"rank {rank} exited {code}: {log[-3000:]}"  # the job's own exception, as without the add-on
        assert "the job failed" in log and "internal error" not in log
