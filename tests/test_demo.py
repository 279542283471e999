"""Issue 5B: the demo runs from one command and shows every part of the product."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from cluster import clean_env


def test_demo_shows_endpoints_summary_matrix_and_artifacts(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "rpc_observe", "demo", "--duration", "2", "--out", str(out)],
                          env=clean_env(), capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    for worker in ("ps", "trainer1", "trainer2"):
        assert f"{worker}" in text and "/metrics" in text
    assert "100%" in text  # the progress bar finished
    # method, calls, errors, client and server p50/p99, `client = callee + outside` (or -), bytes, tensors, wasted
    rows = {line.split()[0]: line.split() for line in text.splitlines()
            if line.startswith("  ") and len(line.split()) in (9, 13)}
    assert int(rows["ParameterServer.update_and_fetch"][1]) > 10
    assert int(rows["save_checkpoint"][2]) >= 2  # the failing call, at least once per trainer
    assert rows["store_activations"][-1] == "45%"  # the view of a large tensor
    client, equals, callee, plus, outside = rows["ParameterServer.get_weights"][5:10]
    assert (equals, plus) == ("=", "+") and float(callee) > 0 and float(outside) > 0
    assert float(client) == pytest.approx(float(callee) + float(outside), abs=0.011)  # each rounded to 0.01
    assert "traffic matrix" in text and "trainer1" in text.split("traffic matrix")[1]
    assert "Perfetto" in text and "Jaeger" in text and "Grafana" in text

    spans = sorted(p.name.split("-")[0] for p in (out / "spans").glob("*.jsonl"))
    assert spans == ["ps", "trainer1", "trainer2"]
    for worker in ("ps", "trainer1", "trainer2"):
        trace = json.loads((out / "profiler" / f"{worker}.json").read_text())
        assert trace["distributedInfo"]["world_size"] == 3
        assert trace["rpc_observe"]["worker"] == worker
    merged = json.loads((out / "merged.json").read_text())
    names = {e["args"]["name"] for e in merged["traceEvents"] if e.get("ph") == "M" and e.get("name") == "process_name"}
    assert {"ps", "trainer1", "trainer2"} <= names
    starts = Counter((e["cat"], e["id"]) for e in merged["traceEvents"] if e.get("ph") == "s")
    ends = Counter((e["cat"], e["id"]) for e in merged["traceEvents"] if e.get("ph") == "f")
    assert starts and starts == ends and set(starts.values()) == {1}
