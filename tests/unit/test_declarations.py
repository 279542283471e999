"""The metric declarations (rpc_observe/telemetry/declarations.py) against the documented table, the scrape
and the dashboard: adding a metric touches the table, and these say where else it must be said."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rpc_observe.telemetry import health
from rpc_observe.telemetry.declarations import BY_NAME, METRICS, STATE_METRICS, MetricDeclaration, sample_names
from rpc_observe.telemetry.metrics import Metrics
from rpc_observe.telemetry.state import StateGauges

ROOT = Path(__file__).resolve().parents[2]
# The document whose table lists every metric (`| metric | type | labels | what |`).
METRICS_TABLE_DOC = ROOT / "docs" / "metrics.md"
AGENT_INFO = {"agent.thread_pool_size": 16, "agent.num_idle_threads": 3, "agent.gil_average_wait_time_us": 12.5,
              "agent.client_active_calls": 2, "agent.server_active_calls": 1, "agent.server_active_async_calls": 0}


def documented_rows(text: str) -> dict[str, tuple[str, set[str], set[str]]]:
    """{metric name: (type, labels, peer-only labels)} of the metric table; a row may name several metrics."""
    lines = text.splitlines()
    start = lines.index("| metric | type | labels | what |") + 2
    rows: dict[str, tuple[str, set[str], set[str]]] = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        names, kind, labels = (cell.strip() for cell in line.strip("|").split("|")[:3])
        peer = {n.strip() for group in re.findall(r"\(\+ ([^)]*?)\\\*\)", labels) for n in group.split(",")}
        plain = {n.strip() for n in re.sub(r"\([^)]*\)", "", labels).split(",") if n.strip()}
        for name in re.findall(r"`([a-z_]+)`", names):
            rows[name] = (kind, plain | peer, peer)
    return rows


def test_the_documented_table_lists_every_declared_metric_with_its_type_and_labels() -> None:
    documented = documented_rows(METRICS_TABLE_DOC.read_text(encoding="utf-8"))
    declared = {m.name: (m.kind, set(m.labels), set(m.peer_labels)) for m in METRICS}
    assert sorted(set(declared) - set(documented)) == [], f"declared, not in {METRICS_TABLE_DOC.name}'s table"
    assert sorted(set(documented) - set(declared)) == [], f"in {METRICS_TABLE_DOC.name}'s table, not declared"
    assert {n: r for n, r in documented.items() if declared[n] != r} == {}, "type or labels differ"


def test_the_table_parser_sees_a_difference() -> None:
    rows = documented_rows("| metric | type | labels | what |\n| --- |\n"
                           "| `a_seconds`, `b_total` | histogram | method, mode (+ dst\\*) | x (y, z) |\n"
                           "| `c` | gauge | side (client, server) | w |\n\nafter")
    assert rows == {"a_seconds": ("histogram", {"method", "mode", "dst"}, {"dst"}),
                    "b_total": ("histogram", {"method", "mode", "dst"}, {"dst"}), "c": ("gauge", {"side"}, set())}


@pytest.mark.parametrize("declaration", METRICS, ids=lambda m: m.name)
def test_names_follow_prometheus_conventions(declaration: MetricDeclaration) -> None:
    name, kind, unit = declaration.name, declaration.kind, declaration.unit
    assert re.fullmatch(r"(torch_rpc|rpc_observe)_[a-z_]+", name)
    assert name.endswith("_total") == (kind == "counter")
    base = name.removesuffix("_total")
    assert base.endswith(f"_{unit}") if unit else not base.endswith(("_seconds", "_bytes"))
    assert (declaration.buckets is not None) == (kind == "histogram")
    assert set(declaration.peer_labels) <= set(declaration.labels) and "worker" not in declaration.labels
    assert declaration.help.endswith(".") and declaration.help[0].isupper()


@pytest.mark.parametrize("peer_histograms", [False, True], ids=["counters", "histograms"])
def test_a_scrape_shows_every_declared_metric_as_declared(peer_histograms: bool) -> None:
    """Every family `Metrics` and `StateGauges` expose, with the name, help, type and labels of its declaration."""
    registry = CollectorRegistry()
    metrics = Metrics("worker0", 10, lambda: AGENT_INFO, peer_histograms=peer_histograms)
    state = StateGauges("worker0")
    state.source = lambda: [(m.name, 1.0) for m in STATE_METRICS]
    registry.register(metrics)
    registry.register(state)
    cells = metrics.client_cells("f", "sync", "worker1")  # a child in every per-call family
    metrics.message_cells("serialize", "request", "f")
    metrics.server_cells("f", "worker1")
    metrics.count_error("client", "f", "worker1", "E")
    metrics.count_error("server", "f", "worker1", "E")
    health.internal_error("test")
    assert cells.in_flight == [0]
    seen = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        name = family.name + ("_total" if family.type == "counter" else "")
        declaration = BY_NAME[name]
        labels = {k for s in family.samples for k in s.labels if k != "le"}
        seen[name] = (family.type, family.documentation, labels)
        assert (family.type, family.documentation) == (declaration.kind, declaration.help), name
        assert labels == set(declaration.label_names(peer_histograms)), name
    assert set(seen) == set(BY_NAME)


def test_the_dashboard_queries_only_declared_metrics() -> None:
    sys.path.insert(0, str(ROOT / "dashboards"))
    try:
        import generate
    finally:
        sys.path.remove(str(ROOT / "dashboards"))
    dashboard = json.loads((ROOT / "dashboards" / "rpc_observe.json").read_text())
    assert len(generate.referenced_metrics(dashboard)) > 20 and generate.undeclared_metrics(dashboard) == []
    dashboard["panels"].append({"title": "x", "targets": [{"expr": "rate(torch_rpc_made_up_total[1m])"}]})
    assert generate.undeclared_metrics(dashboard) == ["torch_rpc_made_up_total"]


def test_the_alert_rules_name_only_declared_metrics() -> None:
    text = (ROOT / "deploy" / "prometheus" / "rules" / "rpc_observe.rules.yml").read_text()
    named = set(re.findall(r"\b((?:torch_rpc|rpc_observe)_[a-z_]+)", text))
    assert named and named <= sample_names(), sorted(named - sample_names())
