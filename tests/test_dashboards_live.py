"""Issue 4: every panel query of the dashboard, against a live Prometheus scraping the demo job."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rpc_observe.telemetry.declarations import sample_names

from cluster import clean_env
from prom import Prometheus

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "dashboards"))
import generate  # noqa: E402

# Panels that may be empty in a healthy run, and why.
EMPTY_BY_DESIGN = {
    "Add-on internal errors/s": "rpc_observe caught no exception of its own in a healthy run",
    "No idle RPC threads": "an annotation: the demo never exhausts the agent's thread pool",
}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """`rpc-observe demo --serve` (failing calls, wasteful views, async and remote calls), scraped."""
    path = tmp_path_factory.mktemp("dashboards")
    out = path / "out"
    demo = subprocess.Popen([sys.executable, "-m", "rpc_observe", "demo", "--serve", "--out", str(out)],
                            env=clean_env(RPC_OBSERVE_PROFILE="0"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=path)
    prometheus = Prometheus(path / "prometheus", str(out / "targets" / "*.json"))
    try:
        deadline = time.monotonic() + 120
        while (prometheus.value('count(up{job="rpc_observe"} == 1)') != 3
               or (prometheus.value("sum(torch_rpc_client_requests_total)") or 0) < 200):
            assert demo.poll() is None and time.monotonic() < deadline, "demo did not run"
            time.sleep(1)
        time.sleep(6)  # a few more scrapes, so that rate() has points
        yield prometheus
    finally:
        prometheus.stop()
        demo.send_signal(signal.SIGINT)
        try:
            demo.wait(timeout=120)
        except subprocess.TimeoutExpired:
            demo.kill()


def _queries():
    dashboard = json.loads((ROOT / "dashboards" / "rpc_observe.json").read_text())
    return generate.panel_queries(dashboard) + generate.annotation_queries(dashboard)


def test_every_panel_query_parses_and_returns_data(live):
    empty = []
    for title, expr in _queries():
        promql = generate.substitute_variables(expr, job="rpc_observe", rate_interval="30s", range_="5m",
                                               extra={"trace_service": ".*", "datasource": "prometheus"})
        result = live.query(promql)  # raises on a parse error
        if not result:
            empty.append(title)
    unexpected = sorted(set(empty) - set(EMPTY_BY_DESIGN))
    assert not unexpected, f"panels with no data: {unexpected}"


def test_series_carry_no_peer_except_the_callers_counters(live):
    """With the defaults the latency histograms and the callee's series carry no peer (series bounded)."""
    peered = live.query('count by (__name__) ({job="rpc_observe", __name__=~"torch_rpc_.+", dst!=""})')
    assert {r["metric"]["__name__"] for r in peered} <= {
        "torch_rpc_client_requests_total", "torch_rpc_client_errors_total", "torch_rpc_client_in_flight",
        "torch_rpc_client_sent_bytes_total", "torch_rpc_client_received_bytes_total"}
    assert live.query('{job="rpc_observe", __name__=~"torch_rpc_.+", src!=""}') == []
    assert (live.value('sum(torch_rpc_client_received_bytes_total{job="rpc_observe"})') or 0) > 0


def test_no_panel_references_a_metric_the_exporter_does_not_produce(live):
    """The panels query declared metrics (rpc_observe/telemetry/declarations.py) that the demo's workers produce,
    and the workers produce only declared ones."""
    produced = {r["metric"]["__name__"] for r in live.query('count by (__name__) ({job="rpc_observe"})')}
    ours = {name for name in produced if re.match(r"(torch_rpc|rpc_observe)_", name)}
    assert ours and ours <= sample_names(), sorted(ours - sample_names())
    produced |= {"rpc_observe_internal_errors_total"}  # only has samples once an error happened
    dashboard = json.loads((ROOT / "dashboards" / "rpc_observe.json").read_text())
    referenced = generate.referenced_metrics(dashboard)
    assert referenced and not generate.undeclared_metrics(dashboard)
    assert referenced <= produced, sorted(referenced - produced)
