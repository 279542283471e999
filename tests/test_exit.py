"""A failing job exits cleanly while its endpoint is scraped: no C++ abort at interpreter exit.

The abort the PyTorch pipeline example showed (15 of 15 exits with the add-on on): a Python
done-callback of the add-on on a remote() future whose reply arrived while the interpreter
finalized. torch's pool thread, freeing the callback, had to take the GIL; CPython 3.11 ends such a
thread with pthread_exit, which in torch's C++ frames is std::terminate. `pending_at_exit` makes
that reply arrive during finalization every time.
"""

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
def test_a_reply_arriving_while_the_interpreter_finalizes_aborts_nothing(tmp_path, round_):
    """Scraped every 20 ms until it exits, as the pipeline example was; the reply comes 0.5 s after rank 0 began
    to exit. Without the fix all 3 rounds abort (-6) on torch 2.14.1; on 2.13.0 none does (CI runs both)."""
    ready = tmp_path / "ready"
    env = {"RPC_OBSERVE": "1", "SCENARIO_READY": str(ready), "PYTHONFAULTHANDLER": "1",
           "SCENARIO_LINGER": "1.0", "SCENARIO_DELAY": "1.5"}
    cluster = Cluster(tmp_path, "pending_at_exit", world=2, env=env)
    stop, counts = threading.Event(), {"ok": 0, "failed": 0}
    try:
        deadline = time.monotonic() + 60
        while not all(Path(f"{ready}{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline, "the job never got ready"
            time.sleep(0.05)
        scraper = threading.Thread(target=_scrape_until, args=(stop, cluster.targets(), counts))
        scraper.start()
        codes = [proc.wait(timeout=60) for proc in cluster.procs]
    finally:
        stop.set()
        cluster.kill()
    scraper.join()
    assert counts["ok"] > 10  # rank 0's endpoint was scraped through its last second
    log = cluster.log(0)
    assert not [a for a in ABORTS if a in log], log[-3000:]
    # -6 (SIGABRT) or -11 (a thread killed inside the callback, then a crash): the exit code shows what
    # the log may not (faulthandler is off by then)
    if codes[0] == -11:
        # Not the abort above (-6 with every round on 2.14.1 without the fix). With the scraper, about 1 round
        # in 10 (torch 2.13.0 and 2.14.1) ends in torch's own exit race: a pt_thread_pool thread completing an
        # RPC future (TensorPipeAgent::markFutureAsComplete -> ~Future -> ~ivalue::Object) while the main
        # thread runs exit()'s static destructors (~KernelFunction) (gdb on a core, 2026-12-03). Waiting
        # after the future was done did not avoid it. Reported, not hidden:
        pytest.xfail("rank 0 crashed (SIGSEGV) in exit(): torch's pool thread raced static destructors")
    assert codes[0] == 1, f"rank 0 exited {codes[0]}: {log[-3000:]}"
    assert "the job failed" in log and "internal error" not in log
