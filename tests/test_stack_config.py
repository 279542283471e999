"""Offline checks of the observability stack: compose file, Prometheus and its
alerting rules, Grafana provisioning, OpenTelemetry Collector config and the
generated dashboard.

Nothing here starts a container or needs the network.  Independent of the
rpc_observe package on purpose: this only reads files of the repository.

External tools:
* ``promtool`` (Debian package ``prometheus``): skipped when missing, unless
  CI is set (``CI=true``), where a missing promtool fails.
* ``grafana-foundation-sdk`` at the version pinned in dashboards/generate.py,
  for the regeneration check: same rule.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "docker-compose.yml"
COMPOSE_SCHEMA = REPO / "deploy" / "compose-spec.json"
PROMETHEUS_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"
MULTI_HOST_CONFIGS = sorted((REPO / "deploy" / "prometheus" / "multi-host").glob("*.yml"))
RULES_DIR = REPO / "deploy" / "prometheus" / "rules"
RULES_FILE = RULES_DIR / "rpc_observe.rules.yml"
RULES_TEST_FILE = RULES_DIR / "rpc_observe.rules.test.yml"
GRAFANA_PROVISIONING = REPO / "deploy" / "grafana" / "provisioning"
DATASOURCES_FILE = GRAFANA_PROVISIONING / "datasources" / "datasources.yml"
DASHBOARD_PROVIDERS_FILE = GRAFANA_PROVISIONING / "dashboards" / "dashboards.yml"
COLLECTOR_CONFIG = REPO / "deploy" / "otel-collector" / "config.yaml"
DASHBOARD_FILE = REPO / "dashboards" / "rpc_observe.json"
STACK_DOC = REPO / "docs" / "stack.md"

IN_CI = os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}

# The compose variable that names the training run's directory (not in the repo).
RUN_DIR_VARIABLE = "RPC_OBSERVE_DIR"


def _load_generator():
    spec = importlib.util.spec_from_file_location(
        "rpc_observe_dashboard_generate", REPO / "dashboards" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate = _load_generator()


def _yaml(path: Path):
    with path.open(encoding="utf-8") as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def compose():
    return _yaml(COMPOSE_FILE)


@pytest.fixture(scope="module")
def dashboard():
    return json.loads(DASHBOARD_FILE.read_text(encoding="utf-8"))


def _missing_tool(what: str, how: str):
    if IN_CI:
        pytest.fail(f"{what} is required in CI ({how})")
    pytest.skip(f"{what} not available ({how}); with CI=true this is a failure")


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        _missing_tool("promtool", "apt-get install prometheus")
    return path


# ---------------------------------------------------------------------------
# The metric contract: what the rpc_observe exporter produces, with the defaults
# (RPC_OBSERVE_PEER_LABELS=counters: no peer on a histogram nor on the callee's
# series, so that series do not grow with the world size; `histograms` adds dst
# to the client histogram and src to the server's, which the queries sum away).
# Every series also gets `job` and `instance` from Prometheus.
# ---------------------------------------------------------------------------

_SERIALIZATION_LABELS = frozenset({"worker", "direction", "message", "method"})
HISTOGRAMS = {
    "torch_rpc_serialized_bytes": _SERIALIZATION_LABELS,
    "torch_rpc_serialized_tensors": _SERIALIZATION_LABELS,
    "torch_rpc_tensor_bytes": _SERIALIZATION_LABELS,
    "torch_rpc_tensor_storage_bytes": _SERIALIZATION_LABELS,
    "torch_rpc_serialization_seconds": _SERIALIZATION_LABELS,
    "torch_rpc_client_duration_seconds": frozenset({"worker", "method", "mode"}),
    # Each call's client duration = the callee's own time, as it reported it + the rest.
    "torch_rpc_client_callee_seconds": frozenset({"worker", "method", "mode"}),
    "torch_rpc_client_outside_seconds": frozenset({"worker", "method", "mode"}),
    "torch_rpc_server_duration_seconds": frozenset({"worker", "method"}),
}
COUNTERS = {
    "torch_rpc_client_requests_total": frozenset({"worker", "method", "mode", "dst"}),
    "torch_rpc_client_errors_total": frozenset({"worker", "method", "dst", "exception"}),
    "torch_rpc_client_sent_bytes_total": frozenset({"worker", "dst"}),
    "torch_rpc_client_received_bytes_total": frozenset({"worker", "dst"}),
    "torch_rpc_server_errors_total": frozenset({"worker", "method", "exception"}),
    "rpc_observe_internal_errors_total": frozenset({"worker", "where"}),
    "rpc_observe_spans_dropped_total": frozenset({"worker", "reason"}),
}
GAUGES = {
    "torch_rpc_client_in_flight": frozenset({"worker", "dst"}),
    # Ages of the oldest client call in flight and of the oldest Python UDF running (0: none).
    "torch_rpc_client_oldest_call_age_seconds": frozenset({"worker"}),
    "torch_rpc_server_oldest_udf_age_seconds": frozenset({"worker"}),
    "rpc_observe_hang_threshold_seconds": frozenset({"worker"}),
    "torch_rpc_agent_threads": frozenset({"worker"}),
    "torch_rpc_agent_idle_threads": frozenset({"worker"}),
    "torch_rpc_agent_active_calls": frozenset({"worker", "side"}),
    "torch_rpc_agent_gil_wait_seconds": frozenset({"worker"}),
    # torch's RRef and distributed autograd state (telemetry/state.py)
    "torch_rpc_rref_owners": frozenset({"worker"}),
    "torch_rpc_rref_pending_users": frozenset({"worker"}),
    "torch_rpc_rref_forks": frozenset({"worker"}),
    "torch_rpc_rref_pending_futures": frozenset({"worker"}),
    "torch_rpc_dist_autograd_contexts": frozenset({"worker"}),
    "torch_rpc_dist_autograd_backward_passes": frozenset({"worker"}),
}
# Prometheus' own series per target; `worker` comes from the file_sd target labels.
PROMETHEUS_SERIES = {"up": frozenset({"worker"})}
TARGET_LABELS = frozenset({"job", "instance"})


def _series_contract() -> dict[str, tuple[str, frozenset[str]]]:
    """Series name -> (kind, labels) for every series the dashboard may query."""
    series: dict[str, tuple[str, frozenset[str]]] = {}
    for name, labels in HISTOGRAMS.items():
        series[f"{name}_bucket"] = ("histogram_bucket", labels | {"le"} | TARGET_LABELS)
        series[f"{name}_sum"] = ("counter", labels | TARGET_LABELS)
        series[f"{name}_count"] = ("counter", labels | TARGET_LABELS)
    for name, labels in COUNTERS.items():
        series[name] = ("counter", labels | TARGET_LABELS)
    for name, labels in GAUGES.items():
        series[name] = ("gauge", labels | TARGET_LABELS)
    for name, labels in PROMETHEUS_SERIES.items():
        series[name] = ("gauge", labels | TARGET_LABELS)
    return series


SERIES = _series_contract()


def _base_metric(series: str) -> str:
    """The exported metric a series belongs to (a histogram's _bucket/_sum/_count -> the histogram)."""
    for histogram in HISTOGRAMS:
        if series in (f"{histogram}_bucket", f"{histogram}_sum", f"{histogram}_count"):
            return histogram
    return series

# ---------------------------------------------------------------------------
# A small PromQL reader: enough to find selectors and grouping labels.
# ---------------------------------------------------------------------------

_STRING = r'"(?:[^"\\]|\\.)*"'
_SELECTOR = re.compile(
    r"(?<![\w:])(?P<name>[a-zA-Z_:][\w:]*)?\s*\{(?P<body>(?:[^{}\"]|" + _STRING + r")*)\}")
_MATCHER = re.compile(r"(?P<label>\w+)\s*(?P<op>=~|!~|!=|=)\s*(?P<value>" + _STRING + ")")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\((?P<labels>[^)]*)\)")
_IDENTIFIER = re.compile(r"(?<![\w:.])[a-zA-Z_:][\w:]*(?![\w:])")
_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left",
             "group_right", "bool", "offset", "inf", "nan", "atan2"}


def selectors(expr: str) -> list[tuple[str | None, dict[str, tuple[str, str]], int]]:
    """(metric name or None, {label: (op, value)}, start offset) for each selector."""
    out = []
    for match in _SELECTOR.finditer(expr):
        matchers = {m["label"]: (m["op"], json.loads(m["value"]))
                    for m in _MATCHER.finditer(match["body"])}
        out.append((match["name"], matchers, match.start()))
    return out


def bare_metric_names(expr: str) -> list[str]:
    """Metric names used without a {...} selector (so without filters)."""
    stripped = re.sub(_STRING, '""', expr)
    stripped = _SELECTOR.sub(" SELECTOR ", stripped)
    stripped = _GROUPING.sub(" ", stripped)
    stripped = re.sub(r"\[[^\]]*\]", " ", stripped)
    names = []
    for match in _IDENTIFIER.finditer(stripped):
        word = match.group()
        following = stripped[match.end():].lstrip()
        if word in _KEYWORDS or word == "SELECTOR" or following.startswith("("):
            continue
        names.append(word)
    return names


def grouping_labels(expr: str) -> set[str]:
    labels: set[str] = set()
    for match in _GROUPING.finditer(expr):
        labels |= {label.strip() for label in match["labels"].split(",") if label.strip()}
    return labels


def all_queries(dashboard: dict) -> list[tuple[str, str]]:
    return generate.panel_queries(dashboard) + [
        (f"annotation {name}", expr) for name, expr in generate.annotation_queries(dashboard)]


def test_promql_reader_on_examples():
    expr = ('sum by (method) (rate(torch_rpc_client_requests_total{job=~"$job", worker=~"a}b"}'
            '[$__rate_interval])) / on (method) foo + vector(0) and 1e-09')
    found = selectors(expr)
    assert [(name, sorted(m)) for name, m, _ in found] == [
        ("torch_rpc_client_requests_total", ["job", "worker"])]
    assert found[0][1]["worker"] == ("=~", "a}b")
    assert bare_metric_names(expr) == ["foo"]
    assert grouping_labels(expr) == {"method"}


# ---------------------------------------------------------------------------
# docker-compose.yml
# ---------------------------------------------------------------------------


def test_compose_validates_against_compose_spec_schema(compose):
    schema = json.loads(COMPOSE_SCHEMA.read_text(encoding="utf-8"))
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    errors = sorted(validator_class(schema).iter_errors(compose), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_compose_spec_schema_rejects_a_misspelt_key(compose):
    # Guard against a schema that accepts anything.
    schema = json.loads(COMPOSE_SCHEMA.read_text(encoding="utf-8"))
    broken = {**compose, "services": {**compose["services"], "typo": {"imagee": "x:1"}}}
    assert not jsonschema.validators.validator_for(schema)(schema).is_valid(broken)


def test_compose_images_are_pinned(compose):
    for name, service in compose["services"].items():
        image = service["image"]
        repository, _, tag = image.rpartition(":")
        assert repository and "/" not in tag, f"{name}: image {image!r} has no tag"
        assert tag != "latest" and re.search(r"\d", tag), f"{name}: image {image!r} is not pinned"


_INTERPOLATION = re.compile(r"\$\{(?P<name>\w+)(?P<rest>[^}]*)\}")


def test_compose_variables_have_defaults():
    # `docker compose up` must work with no variable set.
    text = COMPOSE_FILE.read_text(encoding="utf-8")
    for match in _INTERPOLATION.finditer(text):
        assert match["rest"].startswith((":-", "-")), f"${{{match['name']}}} has no default"


def _interpolate(value: str) -> str:
    def default(match):
        rest = match["rest"]
        return rest.split("-", 1)[1] if rest.startswith((":-", "-")) else ""
    return _INTERPOLATION.sub(default, value)


def _mounts(service: dict) -> list[tuple[str, str, str]]:
    """(raw source, source with defaults, target) of each short-syntax volume."""
    out = []
    for volume in service.get("volumes", []):
        assert isinstance(volume, str), "use the short volume syntax"
        # SOURCE:TARGET[:MODE], where SOURCE may hold ${VAR:-default} and its colon.
        match = re.match(r"(?P<source>(?:\$\{[^}]*\}|[^:$])+):(?P<target>[^:]+)", volume)
        assert match, volume
        source, target = match["source"], match["target"]
        out.append((source, _interpolate(source), target))
    return out


def _mount_target(service: dict, source: str) -> str:
    for _, resolved, target in _mounts(service):
        if resolved == source:
            return target
    raise AssertionError(f"{source} is not mounted")


def test_compose_mounts_exist_in_the_repo(compose):
    declared_volumes = set(compose.get("volumes") or {})
    for name, service in compose["services"].items():
        for raw, source, target in _mounts(service):
            assert target.startswith("/"), f"{name}: {target}"
            if RUN_DIR_VARIABLE in raw:
                continue  # the training run's directory, created by the user
            if source.startswith((".", "/")):
                path = (REPO / source).resolve()
                assert path.exists(), f"{name}: {source} does not exist"
                assert REPO in path.parents or path == REPO, f"{name}: {source} is outside the repo"
            else:
                assert source in declared_volumes, f"{name}: volume {source} not declared"


def test_compose_mounts_the_run_dir_where_prometheus_looks(compose):
    prometheus = compose["services"]["prometheus"]
    run_mounts = [(raw, target) for raw, _, target in _mounts(prometheus) if RUN_DIR_VARIABLE in raw]
    assert len(run_mounts) == 1
    raw, target = run_mounts[0]
    assert raw.startswith("${" + RUN_DIR_VARIABLE)
    config = _yaml(PROMETHEUS_CONFIG)
    files = [f for job in config["scrape_configs"] for sd in job.get("file_sd_configs", [])
             for f in sd["files"]]
    assert files == [f"{target}/targets/*.json"]
    assert f"--config.file={_mount_target(prometheus, './deploy/prometheus/prometheus.yml')}" \
        in prometheus["command"]
    # Workers serve metrics on the host's 127.0.0.1: only the host network reaches them.
    assert prometheus["network_mode"] == "host"


def test_compose_services_wire_up(compose):
    services = compose["services"]
    # Grafana: provisioning dirs and dashboards dir.
    grafana = services["grafana"]
    assert _mount_target(grafana, "./deploy/grafana/provisioning/datasources") == \
        "/etc/grafana/provisioning/datasources"
    assert _mount_target(grafana, "./deploy/grafana/provisioning/dashboards") == \
        "/etc/grafana/provisioning/dashboards"
    dashboards_target = _mount_target(grafana, "./dashboards")
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(dashboards_target + "/")
    assert (REPO / "dashboards" / home[len(dashboards_target) + 1:]).is_file()

    # Collector: config file, OTLP ports published on loopback, exporter to a service.
    collector = services["otel-collector"]
    config_target = _mount_target(collector, "./deploy/otel-collector/config.yaml")
    assert f"--config={config_target}" in collector["command"]
    published = {p.rsplit(":", 1)[-1]: p for p in collector["ports"]}
    assert set(published) == {"4317", "4318", "8889"}
    assert all(p.startswith("127.0.0.1:") for p in published.values())
    config = _yaml(COLLECTOR_CONFIG)
    protocols = config["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"].endswith(":4317")
    assert protocols["http"]["endpoint"].endswith(":4318")
    metrics_exporter = config["exporters"].pop("prometheus")  # served, not sent: Prometheus scrapes it
    assert metrics_exporter["endpoint"].endswith(":8889") and metrics_exporter["enable_open_metrics"]
    scrape_jobs = {job["job_name"]: job for job in _yaml(REPO / "deploy" / "prometheus" / "prometheus.yml")
                   ["scrape_configs"]}
    assert scrape_jobs["otel-collector"]["static_configs"][0]["targets"] == ["127.0.0.1:8889"]
    for exporter in config["exporters"].values():
        host = exporter["endpoint"].split("://")[-1].split(":")[0]
        assert host in services, f"collector exports to unknown host {host}"

    # Jaeger UI published on loopback, where Grafana (host network) looks for it.
    assert any(p.startswith("127.0.0.1:") and p.endswith(":16686") for p in services["jaeger"]["ports"])
    for name, service in services.items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"


# ---------------------------------------------------------------------------
# Prometheus
# ---------------------------------------------------------------------------


def test_promtool_check_config():
    result = subprocess.run([_promtool(), "check", "config", str(PROMETHEUS_CONFIG)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_accepts_a_worker_target_file(tmp_path):
    """The documented targets/<worker>.json format passes promtool's file_sd check."""
    promtool = _promtool()
    targets = tmp_path / "targets"
    targets.mkdir()
    (targets / "worker0.json").write_text(json.dumps(
        [{"targets": ["127.0.0.1:9464"], "labels": {"worker": "worker0", "job": "rpc_observe"}}]))
    (targets / "worker1.json").write_text(json.dumps(
        [{"targets": ["127.0.0.1:9465"], "labels": {"job": "rpc_observe", "rpc_observe_run_id": "r1"}}]))
    config = PROMETHEUS_CONFIG.read_text(encoding="utf-8").replace(
        "/rpc_observe/targets/", f"{targets}/")
    assert str(targets) in config
    (tmp_path / "prometheus.yml").write_text(config)
    result = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "WARNING" not in output, output
    # ...and promtool does read it: a malformed one fails.
    (targets / "bad.json").write_text(json.dumps([{"targets": "127.0.0.1:1"}]))
    result = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0


def test_prometheus_keeps_the_exporters_worker_label():
    config = _yaml(PROMETHEUS_CONFIG)
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"rpc_observe", "otel-collector"}  # the workers, and what they push over OTLP
    assert all(job["honor_labels"] is True for job in jobs.values())
    interval = config["global"]["scrape_interval"]
    datasources = _yaml(DATASOURCES_FILE)["datasources"]
    prometheus = next(d for d in datasources if d["type"] == "prometheus")
    assert prometheus["jsonData"]["timeInterval"] == interval


# ---------------------------------------------------------------------------
# Alerting rules (deploy/prometheus/rules)
# ---------------------------------------------------------------------------


def _alert_rules() -> dict[str, dict]:
    (group,) = _yaml(RULES_FILE)["groups"]
    assert group["name"] == "rpc_observe"
    rules = {rule["alert"]: rule for rule in group["rules"]}
    assert len(rules) == len(group["rules"]), "every rule is an alert, each with its own name"
    return rules


def test_promtool_check_rules():
    result = subprocess.run([_promtool(), "check", "rules", str(RULES_FILE)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_alert_rules())} rules found" in result.stdout


def _promtool_test_rules(test_file: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_promtool(), "test", "rules", str(test_file)],
                          capture_output=True, text=True, timeout=120)


def test_promtool_test_rules():
    result = _promtool_test_rules(RULES_TEST_FILE)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


# (alert, field, text, replacement): each change breaks the alert's unit tests, one way or the
# other (fires too late or not at all, or fires on a series that must stay silent).
RULE_CHANGES = [
    ("RpcCallStuck", "expr", "> rpc_observe_hang_threshold_seconds", "> 30"),  # each worker's own threshold
    ("RpcCallStuck", "expr", "> rpc", ">= rpc"),
    ("RpcUdfStuck", "expr", "> rpc_observe_hang_threshold_seconds", "> 2 * rpc_observe_hang_threshold_seconds"),
    ("RpcUdfStuck", "expr", "> rpc_observe_hang_threshold_seconds", "> 20"),
    ("RpcThreadPoolExhausted", "for", "1m", "0s"),
    ("RpcThreadPoolExhausted", "expr", "torch_rpc_agent_threads > 0 and ", ""),
    ("RpcThreadPoolExhausted", "expr", "== 0", "< 2"),
    ("RpcClientErrorRatioHigh", "expr", "> 0.05", "> 0.2"),
    ("RpcClientErrorRatioHigh", "expr", "> 0.05", "> 0.03"),
    ("RpcClientErrorRatioHigh", "for", "1m", "0s"),
    ("RpcObserveSpansDropped", "expr", "[5m]", "[10m]"),
    ("RpcObserveSpansDropped", "expr", "> 0", ">= 0"),
]


@pytest.mark.parametrize(("alert", "field", "text", "replacement"), RULE_CHANGES,
                         ids=[f"{a}-{f}:{t}->{r}" for a, f, t, r in RULE_CHANGES])
def test_promtool_test_rules_catches_a_changed_rule(tmp_path, alert, field, text, replacement):
    """The unit tests can fail: a copy of the rules with one threshold changed fails them."""
    rules = _yaml(RULES_FILE)
    (rule,) = [r for r in rules["groups"][0]["rules"] if r["alert"] == alert]
    assert text in str(rule[field]), (alert, field, text)
    rule[field] = str(rule[field]).replace(text, replacement)
    (tmp_path / RULES_FILE.name).write_text(yaml.safe_dump(rules, sort_keys=False))
    shutil.copy(RULES_TEST_FILE, tmp_path / RULES_TEST_FILE.name)
    result = _promtool_test_rules(tmp_path / RULES_TEST_FILE.name)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert f"alertname: {alert}" in output or f"alertname:{alert}" in output, output


def test_every_alert_has_unit_tests_that_fire_it_and_keep_it_silent():
    tests = _yaml(RULES_TEST_FILE)
    assert tests["rule_files"] == [RULES_FILE.name]
    fired: set[str] = set()
    silent: set[str] = set()
    for group in tests["tests"]:
        for case in group["alert_rule_test"]:
            (fired if case["exp_alerts"] else silent).add(case["alertname"])
            for alert in case["exp_alerts"]:
                assert alert["exp_labels"]["worker"] in alert["exp_annotations"]["description"]
    assert fired == silent == set(_alert_rules())


def test_alert_rules_query_the_contract_and_say_what_to_do():
    rules = _alert_rules()
    assert set(rules) == {"RpcCallStuck", "RpcUdfStuck", "RpcThreadPoolExhausted",
                          "RpcClientErrorRatioHigh", "RpcObserveSpansDropped"}
    for name, rule in rules.items():
        assert re.fullmatch(r"(?:[A-Z][a-z0-9]*)+", name), f"{name}: alert names are CamelCase"
        expr = rule["expr"]
        names = bare_metric_names(expr) + [n for n, _, _ in selectors(expr)]
        assert names, name
        for metric in names:
            assert metric in SERIES, f"{name}: {metric} is not a metric rpc_observe exports"
        labels = set().union(*(SERIES[m][1] for m in names))
        assert grouping_labels(expr) <= labels, f"{name}: grouping by an unknown label"
        for function, window in re.findall(r"\b(rate|increase)\([^\[\]]*\[([^\]]+)\]", expr):
            assert window == "5m", f"{name}: {function}(...[{window}])"
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, name
        annotations = rule["annotations"]
        assert set(annotations) == {"summary", "description"}, name
        assert "{{ $labels.worker }}" in annotations["summary"], name
        assert "{{ $labels.worker }}" in annotations["description"], name
        assert "rpc-observe doctor" in annotations["description"], name
        assert "$RPC_OBSERVE_DIR/debug/" in annotations["description"], name
    # Stuck: above each worker's own watchdog threshold (RPC_OBSERVE_HANG_SECONDS, exported).
    for name, metric in (("RpcCallStuck", "torch_rpc_client_oldest_call_age_seconds"),
                         ("RpcUdfStuck", "torch_rpc_server_oldest_udf_age_seconds")):
        assert rules[name]["expr"] == f"{metric} > rpc_observe_hang_threshold_seconds"
    assert rules["RpcThreadPoolExhausted"]["for"] == "1m"
    assert "> 0.05" in rules["RpcClientErrorRatioHigh"]["expr"]
    assert rules["RpcObserveSpansDropped"]["expr"] == "increase(rpc_observe_spans_dropped_total[5m]) > 0"


def _rule_files(config_file: Path) -> list[str]:
    return _yaml(config_file).get("rule_files") or []


def test_compose_mounts_the_rules_where_prometheus_loads_them(compose):
    prometheus = compose["services"]["prometheus"]
    target = _mount_target(prometheus, "./deploy/prometheus/rules")
    assert "./deploy/prometheus/rules:" + target + ":ro" in prometheus["volumes"]
    (pattern,) = _rule_files(PROMETHEUS_CONFIG)
    assert pattern.startswith(target + "/"), f"{pattern} is not under the mount {target}"
    # The glob, seen from the repository, loads the rules and not their unit tests.
    assert sorted(RULES_DIR.glob(pattern[len(target) + 1:])) == [RULES_FILE]
    # The multi-host configs load them from the same place.
    assert MULTI_HOST_CONFIGS
    for config_file in MULTI_HOST_CONFIGS:
        assert _rule_files(config_file) == [pattern], config_file.name


@pytest.mark.parametrize("config_file", [PROMETHEUS_CONFIG] + [
    f for f in MULTI_HOST_CONFIGS if "kubernetes_sd_configs" not in f.read_text(encoding="utf-8")],
    ids=lambda f: f.name)
def test_promtool_check_config_loads_the_rules(tmp_path, config_file):
    """With the mount's path pointing at the repository, promtool finds the rules and checks them."""
    (pattern,) = _rule_files(config_file)
    mounted = pattern.rsplit("/", 1)[0]
    text = config_file.read_text(encoding="utf-8")
    assert text.count(f"{mounted}/") == 1
    (tmp_path / "prometheus.yml").write_text(text.replace(f"{mounted}/", f"{RULES_DIR}/"))
    result = subprocess.run([_promtool(), "check", "config", str(tmp_path / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "SUCCESS: 1 rule files found" in output
    assert f"SUCCESS: {len(_alert_rules())} rules found" in output


def test_every_dashboard_query_is_valid_promql(tmp_path, dashboard):
    """promtool parses every panel and annotation query once variables are substituted."""
    promtool = _promtool()
    rules = [{"record": f"dashboard:query_{i}", "expr": generate.substitute_variables(expr)}
             for i, (_, expr) in enumerate(all_queries(dashboard))]
    # The series selectors of the variables, too.
    variables = generate.variable_selectors(dashboard)
    assert [name for name, _, _ in variables] == ["job", "worker", "method", "trace_service"]
    for name, selector, _ in variables:
        rules.append({"record": f"dashboard:variable_{name}",
                      "expr": generate.substitute_variables(selector)})
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run([promtool, "check", "rules", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


# ---------------------------------------------------------------------------
# Grafana provisioning
# ---------------------------------------------------------------------------


def test_grafana_datasources_provisioning():
    config = _yaml(DATASOURCES_FILE)
    assert config["apiVersion"] == 1
    datasources = config["datasources"]
    uids = [d["uid"] for d in datasources]
    assert len(uids) == len(set(uids))
    by_type = {d["type"]: d for d in datasources}
    assert set(by_type) == {"prometheus", "jaeger"}
    assert by_type["prometheus"]["uid"] == generate.PROMETHEUS_UID
    assert by_type["jaeger"]["uid"] == generate.JAEGER_UID
    assert by_type["prometheus"]["name"] == generate.PROMETHEUS_NAME
    assert by_type["jaeger"]["name"] == generate.JAEGER_NAME
    assert sum(bool(d.get("isDefault")) for d in datasources) == 1
    for d in datasources:
        assert urlsplit(d["url"]).scheme == "http" and urlsplit(d["url"]).port, d["url"]

    compose = _yaml(COMPOSE_FILE)["services"]
    # Grafana shares the host network with Prometheus: the URL is Prometheus' listen address.
    listen = next(a.split("=", 1)[1] for a in compose["prometheus"]["command"]
                  if a.startswith("--web.listen-address="))
    assert urlsplit(by_type["prometheus"]["url"]).netloc == listen
    assert compose["grafana"]["network_mode"] == "host"
    jaeger_port = urlsplit(by_type["jaeger"]["url"]).port
    assert f"127.0.0.1:{jaeger_port}:16686" in compose["jaeger"]["ports"]
    assert urlsplit(generate.JAEGER_UI_URL).port == jaeger_port
    # Exemplars lead to Jaeger, and Prometheus keeps them.
    assert by_type["prometheus"]["jsonData"]["exemplarTraceIdDestinations"] == [
        {"name": "trace_id", "datasourceUid": generate.JAEGER_UID}]
    assert "--enable-feature=exemplar-storage" in compose["prometheus"]["command"]


def test_grafana_dashboard_provider_points_at_the_dashboards():
    config = _yaml(DASHBOARD_PROVIDERS_FILE)
    assert config["apiVersion"] == 1
    (provider,) = config["providers"]
    assert provider["type"] == "file"
    grafana = _yaml(COMPOSE_FILE)["services"]["grafana"]
    assert provider["options"]["path"] == _mount_target(grafana, "./dashboards")
    assert DASHBOARD_FILE.parent == REPO / "dashboards" and DASHBOARD_FILE.is_file()


def _datasource_refs(node, path="$"):
    if isinstance(node, dict):
        ds = node.get("datasource")
        if isinstance(ds, dict) and "uid" in ds:
            yield path, ds.get("type"), ds["uid"]
        if "datasourceUid" in node:
            yield path, None, node["datasourceUid"]
        for key, value in node.items():
            yield from _datasource_refs(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _datasource_refs(value, f"{path}[{i}]")


def test_dashboard_datasource_uids_are_provisioned(dashboard):
    provisioned = {d["uid"]: d["type"] for d in _yaml(DATASOURCES_FILE)["datasources"]}
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    refs = list(_datasource_refs(dashboard))
    assert refs
    for path, ds_type, uid in refs:
        match = re.fullmatch(r"\$\{?(\w+)\}?", uid)
        if match:
            variable = variables[match.group(1)]
            assert variable["type"] == "datasource", path
            assert ds_type in (None, variable["query"]), path
            uid = variable["current"]["value"]
        assert uid in provisioned, f"{path}: datasource uid {uid} is not provisioned"
        assert ds_type in (None, provisioned[uid]), f"{path}: {ds_type} != {provisioned[uid]}"


# ---------------------------------------------------------------------------
# OpenTelemetry Collector
# ---------------------------------------------------------------------------

KNOWN_COLLECTOR_COMPONENTS = {
    "receivers": {"otlp"},
    "processors": {"batch", "memory_limiter"},
    "exporters": {"otlp", "otlphttp", "debug", "prometheus"},
    "extensions": {"health_check", "pprof", "zpages"},
}


def test_collector_config_is_consistent():
    config = _yaml(COLLECTOR_CONFIG)
    service = config["service"]
    used: dict[str, set[str]] = {kind: set() for kind in ("receivers", "processors", "exporters")}
    assert service["pipelines"], "no pipeline"
    for pipeline_name, pipeline in service["pipelines"].items():
        assert pipeline_name.split("/")[0] in {"traces", "metrics", "logs"}, pipeline_name
        assert pipeline.get("receivers") and pipeline.get("exporters"), pipeline_name
        for kind in used:
            names = pipeline.get(kind) or []
            assert len(names) == len(set(names)), f"{pipeline_name}: duplicate {kind}"
            used[kind] |= set(names)
    used["extensions"] = set(service.get("extensions") or [])
    for kind, names in used.items():
        defined = set(config.get(kind) or {})
        assert names <= defined, f"{kind} used but not defined: {names - defined}"
        assert defined <= names, f"{kind} defined but not used: {defined - names}"
        for name in defined:
            assert name.split("/")[0] in KNOWN_COLLECTOR_COMPONENTS[kind], f"unknown {kind} {name}"
    assert set(config) <= {"receivers", "processors", "exporters", "extensions", "connectors",
                           "service"}
    assert "traces" in service["pipelines"] and "metrics" in service["pipelines"]


# ---------------------------------------------------------------------------
# The dashboard
# ---------------------------------------------------------------------------


def test_dashboard_regenerates_byte_for_byte():
    version = generate.installed_sdk_version()
    if version is None:
        _missing_tool("grafana-foundation-sdk", f"pip install '{generate.SDK_REQUIREMENT}'")
    assert version == generate.SDK_VERSION, (
        f"grafana-foundation-sdk {version} installed; the committed JSON was made with "
        f"{generate.SDK_VERSION}: pip install '{generate.SDK_REQUIREMENT}'")
    assert generate.render().encode("utf-8") == DASHBOARD_FILE.read_bytes(), (
        "dashboards/rpc_observe.json is stale: run python dashboards/generate.py")


def _rows(dashboard) -> dict[str, list[dict]]:
    rows: dict[str, list[dict]] = {}
    current = None
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            current = rows.setdefault(panel["title"], list(panel.get("panels") or []))
        else:
            assert current is not None, f"panel {panel['title']} is outside any row"
            current.append(panel)
    return rows


def _exprs(panels) -> list[str]:
    return [t["expr"] for p in panels for t in p.get("targets", []) if t.get("expr")]


def test_dashboard_layout(dashboard):
    rows = _rows(dashboard)
    assert list(rows) == ["Overview", "Latency breakdown", "Stuck calls and where the time goes",
                          "Payload", "Traffic matrix", "Saturation", "RPC state (torch)", "Errors",
                          "Add-on health"]
    assert all(rows.values())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
    assert dashboard["uid"] == generate.DASHBOARD_UID


def test_dashboard_variables(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"datasource", "job", "worker", "method"} <= set(variables)
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("job", "worker", "method"):
        variable = variables[name]
        assert variable["type"] == "query"
        assert variable["datasource"]["uid"] == "${datasource}"
        assert variable["query"].startswith("label_values(")
        assert variable["query"].endswith(f", {name})")
    worker = variables["worker"]
    assert worker["multi"] is True and worker["includeAll"] is True
    assert worker["allValue"] == ".*"
    # Where latency links look for traces when a series has no worker label.
    trace_service = variables["trace_service"]
    assert trace_service["query"].endswith(", worker)") and trace_service["allowCustomValue"]
    assert not trace_service["multi"] and not trace_service["includeAll"]


def test_every_queried_metric_is_in_the_contract(dashboard):
    queries = all_queries(dashboard)
    assert len(queries) > 20
    used = set()
    for title, expr in queries:
        assert not bare_metric_names(expr), f"{title}: unfiltered metric in {expr}"
        for name, _, _ in selectors(expr):
            assert name in SERIES, f"{title}: {name} is not a metric rpc_observe exports"
            used.add(name)
    # The variable queries only name contract metrics (or prefixes of them).
    for variable in dashboard["templating"]["list"]:
        for name_regex in re.findall(r'__name__=~"([^"]+)"', variable.get("query") or ""):
            for alternative in name_regex.split("|"):
                if re.fullmatch(r"[\w:]+", alternative):
                    assert alternative in SERIES, alternative
                else:
                    assert any(re.fullmatch(alternative, s) for s in SERIES), alternative
    # Every metric of the contract is shown somewhere.
    exported = set(COUNTERS) | set(GAUGES) | set(HISTOGRAMS)
    shown = {_base_metric(name) for name in used}
    assert exported <= shown, f"not on the dashboard: {sorted(exported - shown)}"


def test_every_query_is_filtered_by_the_variables(dashboard):
    queries = all_queries(dashboard)
    with_client_latency = {title for title, expr in queries if "torch_rpc_client_duration_seconds" in expr}
    for title, expr in queries:
        for name, matchers, _ in selectors(expr):
            labels = SERIES[name][1]
            assert set(matchers) <= labels, f"{title}: {name} has no label {set(matchers) - labels}"
            assert matchers.get("job") == ("=~", "$job"), f"{title}: {name} not filtered by job"
            # Server-side series paired with the selected workers' client latency are every callee's
            # (they carry no caller label): only there may a selector leave out the worker.
            callee_side = name.startswith("torch_rpc_server_duration_seconds") and title in with_client_latency
            assert matchers.get("worker") == ("=~", "$worker") or (callee_side and "worker" not in matchers), \
                f"{title}: {name} not filtered by worker"
            if "method" in labels:
                assert matchers.get("method") == ("=~", "$method"), \
                    f"{title}: {name} not filtered by method"
        labels_used = set().union(*(SERIES[n][1] for n, _, _ in selectors(expr)))
        assert grouping_labels(expr) <= labels_used, f"{title}: grouping by unknown label"


def test_counters_are_rated_and_rates_use_rate_interval(dashboard):
    for title, expr in all_queries(dashboard):
        for name, _, start in selectors(expr):
            kind = SERIES[name][0]
            before = expr[:start]
            if kind in ("counter", "histogram_bucket"):
                assert re.search(r"\b(rate|increase)\($", before), f"{title}: raw counter {name}"
            else:
                assert not re.search(r"\b(rate|increase|irate)\($", before), \
                    f"{title}: rate() of gauge {name}"
        for function, window in re.findall(r"\b(rate|increase)\([^\[\]]*\[([^\]]+)\]", expr):
            expected = "$__rate_interval" if function == "rate" else "$__range"
            assert window == expected, f"{title}: {function}(...[{window}])"


def _panel(dashboard, title) -> dict:
    for panel in dashboard["panels"]:
        if panel["title"] == title:
            return panel
    raise AssertionError(f"no panel {title!r}")


def test_rows_show_what_the_issue_asks_for(dashboard):
    rows = {name: "\n".join(_exprs(panels)) for name, panels in _rows(dashboard).items()}
    overview = rows["Overview"]
    assert "sum by (method, mode) (rate(torch_rpc_client_requests_total" in overview
    assert re.search(r"torch_rpc_client_errors_total.*/.*torch_rpc_client_requests_total", overview)
    for q in ("0.5", "0.95", "0.99"):
        assert f"histogram_quantile({q}, sum by (le) (rate(torch_rpc_client_duration_seconds_bucket" \
            in overview
    assert "torch_rpc_client_in_flight" in overview

    latency_targets = [t["expr"] for p in _rows(dashboard)["Latency breakdown"] for t in p["targets"]]
    difference = [e for e in latency_targets if "torch_rpc_client_duration_seconds" in e
                  and "torch_rpc_server_duration_seconds" in e]
    assert difference and " - " in difference[0], "client − server as its own series"

    stuck = {p["title"]: p for p in _rows(dashboard)["Stuck calls and where the time goes"]}
    for title, metric in (("Oldest call in flight", "torch_rpc_client_oldest_call_age_seconds"),
                          ("Oldest UDF running", "torch_rpc_server_oldest_udf_age_seconds")):
        expr, threshold = _exprs([stuck[title]])
        assert expr.startswith(f"max by (worker) ({metric}{{")
        assert threshold.startswith("min(rpc_observe_hang_threshold_seconds{")
        defaults = stuck[title]["fieldConfig"]["defaults"]
        assert defaults["unit"] == "s"
        assert defaults["thresholds"]["steps"][-1] == {"color": "red", "value": generate.STUCK_SECONDS}
        assert defaults["custom"]["thresholdsStyle"]["mode"] != "off"
    assert "torch_rpc_agent_idle_threads" in "".join(_exprs([stuck["Idle RPC threads"]]))
    # client = callee + outside: means stacked over time, and per method as stacked bars.
    stacked = stuck["Mean time per call: callee + outside"]
    assert stacked["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    bars = stuck["Mean time per call by method: callee + outside"]
    assert bars["type"] == "barchart"
    assert bars["options"]["stacking"] == "normal" and bars["options"]["xField"] == "method"
    assert [t["id"] for t in bars["transformations"]][0] == "merge"
    assert all(t["instant"] and t["format"] == "table" for t in bars["targets"])
    for panel in (stacked, bars, stuck["Callee vs outside p50 by method"]):
        callee, outside = _exprs([panel])
        assert "torch_rpc_client_callee_seconds" in callee and "_outside_" not in callee
        assert "torch_rpc_client_outside_seconds" in outside and "_callee_" not in outside
        if panel is not stacked:
            assert grouping_labels(callee) - {"le"} == {"method"} == grouping_labels(outside) - {"le"}

    payload_panels = _rows(dashboard)["Payload"]
    assert "sum by (direction) (rate(torch_rpc_serialized_bytes_sum" in rows["Payload"]
    heatmaps = [p for p in payload_panels if p["type"] == "heatmap"]
    assert heatmaps and heatmaps[0]["targets"][0]["format"] == "heatmap"
    assert "torch_rpc_serialized_bytes_bucket" in heatmaps[0]["targets"][0]["expr"]
    assert heatmaps[0]["options"]["calculate"] is False
    assert "torch_rpc_serialized_tensors" in rows["Payload"]

    wasted = _panel(dashboard, "Wasted storage ratio")
    assert wasted["type"] == "stat"
    (target,) = wasted["targets"]
    assert re.fullmatch(r"1 - sum\(rate\(torch_rpc_tensor_bytes_sum\{.*\}\[\$__rate_interval\]\)\)"
                        r" / \(sum\(rate\(torch_rpc_tensor_storage_bytes_sum\{.*\}"
                        r"\[\$__rate_interval\]\)\) > 0\)", target["expr"])
    steps = wasted["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert steps[-1] == {"color": "red", "value": generate.WASTED_STORAGE_RED}
    assert wasted["fieldConfig"]["defaults"]["color"]["mode"] == "thresholds"

    for panel in _rows(dashboard)["Traffic matrix"]:
        assert panel["type"] == "table"
        (target,) = panel["targets"]
        assert target["expr"].startswith("sum by (worker, dst) (")
        assert target["format"] == "table" and target["instant"] is True
        matrix = [t for t in panel["transformations"] if t["id"] == "groupingToMatrix"]
        assert matrix[0]["options"]["rowField"] == "worker"
        assert matrix[0]["options"]["columnField"] == "dst"
    assert "torch_rpc_client_sent_bytes_total" in rows["Traffic matrix"]
    assert "torch_rpc_client_received_bytes_total" in rows["Traffic matrix"]
    assert "torch_rpc_client_requests_total" in rows["Traffic matrix"]
    # No panel groups a histogram by a peer: the default histograms carry none (series bounded).
    for _, expr in all_queries(dashboard):
        if "_bucket" in expr or "_duration_seconds" in expr:
            assert not {"dst", "src"} & grouping_labels(expr), expr

    state = _rows(dashboard)["RPC state (torch)"]
    for metric in ("torch_rpc_rref_owners", "torch_rpc_rref_pending_users", "torch_rpc_rref_forks",
                   "torch_rpc_rref_pending_futures", "torch_rpc_dist_autograd_contexts",
                   "torch_rpc_dist_autograd_backward_passes"):
        assert metric in rows["RPC state (torch)"]
    leaks = [p for p in state if "leak" in p["title"]]
    assert {"torch_rpc_rref_owners", "torch_rpc_dist_autograd_contexts"} <= {
        name for p in leaks for name, _, _ in selectors("".join(_exprs([p])))}

    for metric in ("torch_rpc_agent_threads", "torch_rpc_agent_idle_threads",
                   "torch_rpc_agent_active_calls", "torch_rpc_agent_gil_wait_seconds"):
        assert metric in rows["Saturation"]
    assert "by (exception, method)" in rows["Errors"]
    assert "torch_rpc_client_errors_total" in rows["Errors"]
    assert "torch_rpc_server_errors_total" in rows["Errors"]
    assert "rpc_observe_internal_errors_total" in rows["Add-on health"]
    assert "rpc_observe_spans_dropped_total" in rows["Add-on health"]


def test_no_idle_threads_is_annotated_and_red(dashboard):
    annotations = dict(generate.annotation_queries(dashboard))
    assert any(re.search(r"torch_rpc_agent_idle_threads\{[^}]*\}\) == 0$", e)
               for e in annotations.values())
    idle = _panel(dashboard, "Idle RPC threads")
    steps = idle["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert steps[0] == {"color": "red", "value": None} and steps[1]["value"] == 1
    assert idle["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] != "off"


def test_latency_panels_link_to_traces(dashboard):
    latency_panels = [p for p in dashboard["panels"] if p.get("fieldConfig", {}).get("defaults", {})
                      .get("unit") == "s" and "torch_rpc_client_duration_seconds" in
                      "".join(_exprs([p]))]
    assert len(latency_panels) >= 3
    for panel in latency_panels:
        links = panel["fieldConfig"]["defaults"].get("links") or []
        jaeger = [link for link in links if link["url"].startswith(f"{generate.JAEGER_UI_URL}/search?")]
        explore = [link for link in links
                   if (link.get("internal") or {}).get("datasourceUid") == generate.JAEGER_UID]
        assert jaeger and explore, f"{panel['title']}: no link to the trace viewer"
        quantiles = [t for t in panel["targets"] if "histogram_quantile" in t["expr"]]
        assert not quantiles or any(t.get("exemplar") is True for t in quantiles), f"{panel['title']}: no exemplars"
        # Jaeger needs a service; rpc_observe names spans after the worker.
        grouping = grouping_labels("".join(_exprs([panel])))
        service = "${__field.labels.worker}" if "worker" in grouping else "${trace_service}"
        assert f"service={service}&" in jaeger[0]["url"]
        assert "minDuration=${__value.raw}s" in jaeger[0]["url"]
        query = explore[0]["internal"]["query"]
        assert query["queryType"] == "search" and query["service"] == service
        if "method" in grouping:
            assert "${__field.labels.method}" in jaeger[0]["url"]
            assert "${__field.labels.method}" in query["tags"]


# ---------------------------------------------------------------------------
# Helpers for the live test
# ---------------------------------------------------------------------------


def test_panel_queries_helper(dashboard):
    queries = generate.panel_queries(dashboard)
    assert queries == generate.panel_queries(json.dumps(dashboard))
    titles = {title for title, _ in queries}
    assert "Wasted storage ratio" in titles and "Bytes per message" in titles
    assert all(isinstance(expr, str) and expr for _, expr in queries)
    # Collapsed rows keep panels inside; those are found too.
    nested = {"panels": [{"type": "row", "title": "r", "panels": [
        {"title": "inner", "targets": [{"expr": "up"}, {"refId": "B"}]}]}]}
    assert generate.panel_queries(nested) == [("inner", "up")]


def test_substitute_variables_gives_plain_promql(dashboard):
    for title, expr in all_queries(dashboard):
        plain = generate.substitute_variables(expr, worker="worker0|worker1", rate_interval="20s")
        assert "$" not in plain, f"{title}: {plain}"
    assert generate.substitute_variables(
        'rate(x{job=~"$job", worker=~"${worker}", method=~"${method:regex}"}[$__rate_interval])'
        ' + y[$__interval] + z[$__range] + [[job]]', job="j", method="m") == (
        'rate(x{job=~"j", worker=~".*", method=~"m"}[1m]) + y[15s] + z[1h] + j')
    with pytest.raises(KeyError):
        generate.substitute_variables('x{a="$unknown"}')
    assert generate.substitute_variables('x{a="$other"}', extra={"other": "v"}) == 'x{a="v"}'


def test_stack_doc_names_what_the_stack_uses():
    doc = STACK_DOC.read_text(encoding="utf-8")
    for needle in ("RPC_OBSERVE=1", "OTEL_TRACES_EXPORTER=otlp",
                   "OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318", "RPC_OBSERVE_DIR",
                   "docker compose up", "http://localhost:3000", "http://localhost:9090",
                   "http://localhost:16686", generate.SDK_REQUIREMENT,
                   "deploy/prometheus/rules/rpc_observe.rules.yml",
                   "promtool test rules deploy/prometheus/rules/rpc_observe.rules.test.yml",
                   *_alert_rules()):
        assert needle in doc, needle
