"""Span files must not fill the disk: rotation, a cap per process, and a disk that fills up mid-run.

Real torch RPC workers (tests/scenarios.py `span_flood`: small rpc_sync calls from 4 threads as fast
as they go), real span files, the real metrics endpoint. Every span a worker ended is accounted
for exactly: it is in the worker's files, or counted in `rpc_observe_spans_dropped_total` with
its reason. That is checked while the job is held after its calls, once nothing moves any more
(before shutdown writes its own few spans).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from cluster import Cluster, read_spans, samples, scrape, span_files, total

CAP, FILE = 300_000, 40_000
REASONS = ("queue_full", "export_failed", "timeout", "disk_cap", "disk_error")


def files_by_worker(out_dir: Path) -> dict[str, dict[str, int]]:
    """worker -> {span file name: bytes}."""
    found: dict[str, dict[str, int]] = {}
    for path in span_files(out_dir):
        name = os.path.basename(path)
        found.setdefault(name.rsplit("-", 1)[0], {})[name] = os.path.getsize(path)
    return found


def spans_by_worker(out_dir: Path) -> Counter:
    return Counter(s["worker"] for s in read_spans(out_dir))


def snapshot(cluster: Cluster) -> tuple[dict, dict, Counter]:
    """({worker: {ended, reason...}}, span files, spans in them per worker), all read at one moment."""
    counts = {}
    for worker, target in sorted(cluster.targets().items()):
        parsed = samples(scrape(target))
        counts[worker] = {
            # every client call and every Python UDF ends one span (always_on: all sampled)
            "ended": total(parsed, "torch_rpc_client_duration_seconds_count")
            + total(parsed, "torch_rpc_server_duration_seconds_count"),
            **{r: total(parsed, "rpc_observe_spans_dropped_total", reason=r) for r in REASONS},
            "internal_errors": total(parsed, "rpc_observe_internal_errors_total"),
        }
    return counts, files_by_worker(cluster.out_dir), spans_by_worker(cluster.out_dir)


def settled(cluster: Cluster, timeout: float = 30) -> tuple[dict, dict, Counter]:
    """A snapshot once two in a row, 0.5 s apart, are the same: every span ended is exported or dropped."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            now = snapshot(cluster)
        except json.JSONDecodeError:  # read a line while it was written
            now = None
        if now is not None and now == last:
            return now
        last = now
        time.sleep(0.5)
    raise AssertionError(f"span export never settled: {last}")


def assert_every_span_accounted_for(counts: dict, in_files: Counter, reason: str) -> None:
    for worker, c in counts.items():
        assert c[reason] > 0, (worker, c)
        assert c[reason] == c["ended"] - in_files[worker], (worker, c, in_files[worker])  # exact
        assert all(c[r] == 0 for r in REASONS if r != reason), (worker, c)
        assert c["internal_errors"] == 0, (worker, c)


def assert_last_calls_kept(out_dir: Path) -> None:
    """The newest spans are in the files: the 5 last calls, client side on worker0 and server side on worker1."""
    last = Counter((s["worker"], s["kind"]) for s in read_spans(out_dir) if s["attrs"].get("rpc.method") == "last_call")
    assert last == {("worker0", 3): 5, ("worker1", 2): 5}, last


def flood(tmp_path: Path, env: dict[str, str]) -> tuple[Cluster, dict, Any, Any, Any]:
    """The span_flood scenario, held while its spans settle; the job's own results are checked here."""
    cluster = Cluster(tmp_path, "span_flood", world=2, env=env, hold=True)
    try:
        result = cluster.wait_ready()
        counts, files, in_files = settled(cluster)
    finally:
        cluster.wait()
    assert result["wrong"] == 0 and result["last"] == [0, -1, -2, -3, -4]  # RPC results unaffected
    return cluster, result, counts, files, in_files


def test_span_files_rotate_and_stay_under_the_cap_keeping_the_newest(tmp_path: Path) -> None:
    env = {"RPC_OBSERVE": "1", "RPC_OBSERVE_SPANS_MAX_BYTES": str(CAP), "RPC_OBSERVE_SPANS_FILE_BYTES": str(FILE),
           "OTEL_BSP_SCHEDULE_DELAY": "100", "SCENARIO_SECONDS": "3"}
    cluster, result, counts, files, in_files = flood(tmp_path, env)
    # The job's results are unaffected.
    assert result["calls"] > 3 * CAP // 800, result  # several times what the cap holds
    assert set(files) == {"worker0", "worker1"}
    for worker, sizes in files.items():
        # No slack: a batch is split into lines that fit a file, and the oldest files are deleted
        # *before* a line would take the total past the cap.
        assert sum(sizes.values()) <= CAP, (worker, sizes)
        assert all(size <= FILE for size in sizes.values()), (worker, sizes)
        assert sum(sizes.values()) > CAP - 2 * FILE, (worker, sizes)  # and the cap is used, not wasted
        # logrotate numbering: <name>.jsonl and .1 (newest) ... .N (oldest), no gaps after deletions
        base = next(name for name in sizes if name.endswith(".jsonl"))
        assert set(sizes) == {base} | {f"{base}.{n}" for n in range(1, len(sizes))}, sizes
    assert_every_span_accounted_for(counts, in_files, "disk_cap")
    assert_last_calls_kept(cluster.out_dir)
    # After shutdown (its own spans written): still under the cap, the last calls still there.
    for worker, sizes in files_by_worker(cluster.out_dir).items():
        assert sum(sizes.values()) <= CAP, (worker, sizes)
    assert_last_calls_kept(cluster.out_dir)
    for rank in (0, 1):  # logged once per process
        assert cluster.log(rank).count("reached RPC_OBSERVE_SPANS_MAX_BYTES=300000") == 1, cluster.log(rank)


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 16 MiB tmpfs where the cluster writes (`tmp_path/out`); skipped where mounting is not permitted."""
    out = tmp_path / "out"
    out.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(out)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        # Not root: a directory made read-only by chmod is the closest, and the unit tests cover
        # EROFS/ENOSPC with the sink's own file; a real full disk needs a small file system.
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()})")
    try:
        yield out
    finally:
        if subprocess.run(["umount", str(out)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(out)], capture_output=True)


def test_a_disk_that_fills_up_mid_run_drops_and_counts_warns_once_and_recovers(tmp_path: Path,
                                                                               small_disk: Path) -> None:
    env = {"RPC_OBSERVE": "1", "OTEL_BSP_SCHEDULE_DELAY": "100", "SCENARIO_SECONDS": "3",
           "SCENARIO_FILL": str(small_disk / "filler")}  # the driver fills the disk for the middle second
    cluster, result, counts, files, in_files = flood(tmp_path, env)
    assert cluster.out_dir == small_disk
    assert result["filled"] > 1 << 20, result  # the filler did take the disk
    assert cluster.shutdown_s[0] < 5.0  # the driver's; worker1's includes the hold it waited through
    assert_every_span_accounted_for(counts, in_files, "disk_error")
    assert_last_calls_kept(cluster.out_dir)  # the disk freed up: later batches were written again
    read_spans(cluster.out_dir)  # every line whole: partial lines were taken back
    for rank in (0, 1):
        log = cluster.log(rank)
        warned = re.findall(r"rpc_observe: cannot write span file (\S+) \((\w+): ([^)]*)\)", log)
        assert len(warned) == 1, log
        path, code, text = warned[0]
        assert path.startswith(str(small_disk / "spans" / f"worker{rank}-")) and path.endswith(".jsonl")
        assert (code, text) == ("ENOSPC", "No space left on device")
        assert "Traceback" not in log, log
