"""The multi-host schemes of docs/multi-host.md, with the configs of deploy/prometheus/multi-host/.

Every config passes `promtool check config`.  Then, where one machine can stand for many, each
scheme runs for real: rpc_observe workers (tests/cluster.py) scraped by a real Prometheus
(tests/prom.py) that is configured from the shipped file, with only its paths, hosts and
intervals changed:

* file_sd on a shared file system: a directory stands for the NFS share, two runs at once
  (two slots), workers bound to a stand-in for the host's address (127.0.0.9); queries by run id;
* fixed ports: two "hosts" (127.0.0.1 and 127.0.0.2) with LOCAL_RANK set as torchrun does,
  the static config generated from the scheme (base port + local rank);
* Kubernetes: Debian's promtool has no Kubernetes discovery, so the file is checked with its
  kubernetes_sd_configs swapped for a file_sd (a full check where promtool has it), and its
  relabeling runs in a real Prometheus on target groups that carry the meta labels
  kubernetes_sd gives pods (fed through file_sd), pointing at real workers on "pod IPs"
  127.0.0.3 and 127.0.0.4, ports 9400 + local rank.  No Kubernetes API server is involved.

The per-host collector config is checked for consistency only (no collector binary here).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from cluster import Cluster, read_spans, samples, scrape, total
from prom import Prometheus, free_port

REPO = Path(__file__).resolve().parents[1]
MULTI_HOST = REPO / "deploy" / "prometheus" / "multi-host"
FILE_SD = MULTI_HOST / "file_sd-nfs.yml"
STATIC = MULTI_HOST / "static-ports.yml"
KUBERNETES = MULTI_HOST / "kubernetes.yml"
AGENT = REPO / "deploy" / "otel-collector" / "agent.yaml"
GATEWAY = REPO / "deploy" / "otel-collector" / "config.yaml"
DOC = REPO / "docs" / "multi-host.md"
NFS_PREFIX = "/nfs/rpc_observe/"  # the share's mount point in file_sd-nfs.yml
K8S_BASE_PORT = 9400  # RPC_OBSERVE_METRICS_PORT in kubernetes.yml's port range

IN_CI = os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}

# The PromQL examples of docs/multi-host.md ("RUN" is the run id); each one is run below.
UP_OF_A_RUN = 'up{job="rpc_observe", rpc_observe_run_id="RUN"}'
REQUESTS_OF_A_RUN = 'sum by (worker) (torch_rpc_client_requests_total{rpc_observe_run_id="RUN"})'
P99_OF_A_RUN = ('histogram_quantile(0.99, sum by (le) '
                '(rate(torch_rpc_client_duration_seconds_bucket{rpc_observe_run_id="RUN"}[5m])))')
RUNS_SCRAPED = 'count by (rpc_observe_run_id) (up{job="rpc_observe"})'
DOC_QUERIES = (UP_OF_A_RUN, REQUESTS_OF_A_RUN, P99_OF_A_RUN, RUNS_SCRAPED)


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if IN_CI:
            pytest.fail("promtool is required in CI (apt-get install prometheus)")
        pytest.skip("promtool not available (apt-get install prometheus); with CI=true this is a failure")
    return path


def promtool_check(path: Path) -> tuple[int, str]:
    result = subprocess.run([_promtool(), "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    return result.returncode, result.stdout + result.stderr


def _yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def _job(config: dict) -> dict:
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "rpc_observe" and job["honor_labels"] is True
    return job


def for_test(config: dict) -> dict:
    """The shipped config with 1 s intervals (scrapes and file_sd re-reads): nothing else changes."""
    config = copy.deepcopy(config)
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    for job in config["scrape_configs"]:
        for sd in job.get("file_sd_configs", []):
            sd["refresh_interval"] = "1s"
    return config


def routable_address() -> str:
    """Stands for a host's routable address. Tests send traffic on loopback only (127.0.0.0/8),
    never to the machine's network addresses: a loopback address other than 127.0.0.1 shows the
    same thing, that the target file names the bind address and Prometheus scrapes it there."""
    return "127.0.0.9"


def ports_free(hosts: list[str], ports: list[int]) -> bool:
    """Whether a worker can listen there (its HTTP server sets SO_REUSEADDR: TIME_WAIT is no obstacle)."""
    for host in hosts:
        for port in ports:
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind((host, port))
                except OSError:
                    return False
    return True


class ConfiguredPrometheus(Prometheus):
    """tests/prom.py's Prometheus, then given `config` (a SIGHUP reloads the configuration)."""

    def __init__(self, workdir: Path, config: dict):
        super().__init__(workdir, str(workdir / "none" / "*.json"))
        text = yaml.safe_dump(config, sort_keys=False)
        (workdir / "prometheus.yml").write_text(text)
        code, output = promtool_check(workdir / "prometheus.yml")
        assert code == 0, output
        assert "relabel_configs" not in self.loaded_config()  # tests/prom.py's config has none; ours do
        self.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while "relabel_configs" not in self.loaded_config():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError("prometheus did not load the config: "
                                     + (workdir / "prometheus.log").read_text()[-2000:])
            time.sleep(0.2)
        self.loaded = self.loaded_config()

    def _get(self, path: str) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return body["data"]

    def loaded_config(self) -> str:
        return self._get("/api/v1/status/config")["yaml"]

    def targets(self) -> dict:
        return self._get("/api/v1/targets")

    def wait_for_result(self, promql: str, count: int, timeout: float = 30) -> list[dict]:
        """Polls until the query returns `count` series."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(promql)
            if len(result) == count or time.monotonic() > deadline:
                return result
            time.sleep(0.5)


def read_targets(targets_dir: Path) -> dict[str, dict]:
    """worker -> its file_sd target group, from the files the workers wrote."""
    found = {}
    for path in sorted(targets_dir.glob("*.json")):
        (group,) = json.loads(path.read_text())
        found[path.stem] = group
    return found


# ---------------------------------------------------------------------------
# promtool, on the files as shipped
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", [FILE_SD, STATIC], ids=lambda p: p.name)
def test_promtool_check_config(path):
    code, output = promtool_check(path)
    assert code == 0 and "SUCCESS" in output, output


def _promtool_has_kubernetes_sd(tmp_path: Path) -> bool:
    probe = tmp_path / "probe.yml"
    probe.write_text("scrape_configs:\n  - job_name: k\n    kubernetes_sd_configs:\n      - role: pod\n")
    code, output = promtool_check(probe)
    if code != 0:
        # Debian builds Prometheus without Kubernetes discovery.
        assert "kubernetes_sd_configs not found" in output, output
    return code == 0


def test_promtool_check_kubernetes_config(tmp_path):
    config = _yaml(KUBERNETES)
    job = _job(config)
    assert job["kubernetes_sd_configs"] == [{"role": "pod"}]
    if _promtool_has_kubernetes_sd(tmp_path):
        code, output = promtool_check(KUBERNETES)
        assert code == 0 and "SUCCESS" in output, output
    # Everything but the discovery, with any promtool: the relabeling, labels, intervals.
    del job["kubernetes_sd_configs"]
    job["file_sd_configs"] = [{"files": [str(tmp_path / "pods" / "*.json")]}]
    (tmp_path / "swapped.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    code, output = promtool_check(tmp_path / "swapped.yml")
    assert code == 0 and "SUCCESS" in output, output


def test_promtool_rejects_a_directory_glob(tmp_path):
    """Why file_sd-nfs.yml lists one pattern per slot: only the file name may be a glob."""
    config = _yaml(FILE_SD)
    _job(config)["file_sd_configs"][0]["files"] = ["/nfs/rpc_observe/*/targets/*.json"]
    (tmp_path / "glob.yml").write_text(yaml.safe_dump(config))
    code, output = promtool_check(tmp_path / "glob.yml")
    assert code != 0 and "is not valid for file discovery" in output, output


KNOWN_COLLECTOR_COMPONENTS = {
    "receivers": {"otlp"},
    "processors": {"batch", "memory_limiter", "resourcedetection"},
    "exporters": {"otlp"},
}


def test_collector_agent_config_is_consistent():
    config = _yaml(AGENT)
    assert set(config) <= {"receivers", "processors", "exporters", "service"}
    (pipeline,) = config["service"]["pipelines"].values()
    assert list(config["service"]["pipelines"]) == ["traces"]
    for kind, known in KNOWN_COLLECTOR_COMPONENTS.items():
        assert set(pipeline[kind]) == set(config[kind]), kind  # all defined, all used
        assert {name.split("/")[0] for name in config[kind]} <= known, kind
    assert pipeline["processors"][0] == "memory_limiter" and pipeline["processors"][-1] == "batch"
    # The workers of the host send to it on loopback; it forwards to the gateway (config.yaml).
    protocols = config["receivers"]["otlp"]["protocols"]
    assert protocols["http"]["endpoint"] == "127.0.0.1:4318" and protocols["grpc"]["endpoint"] == "127.0.0.1:4317"
    (exporter,) = config["exporters"].values()
    assert exporter["endpoint"] == "${env:OTLP_GATEWAY_ENDPOINT}"
    gateway = _yaml(GATEWAY)["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    assert gateway.endswith(":4317")


def test_doc_names_every_config_and_query():
    doc = DOC.read_text(encoding="utf-8")
    for path in (FILE_SD, STATIC, KUBERNETES, AGENT, GATEWAY, Path(__file__)):
        assert str(path.relative_to(REPO)) in doc, path
    for query in DOC_QUERIES:
        assert query in doc, query
    assert "docs/multi-host.md" in (REPO / "README.md").read_text(encoding="utf-8")


# ---------------------------------------------------------------------------
# Scheme 1: file_sd on a shared file system, two runs at once
# ---------------------------------------------------------------------------

RUN_A, RUN_B = "run-a", "run-b"


@pytest.fixture(scope="module")
def nfs(tmp_path_factory):
    """Two runs, each in its own slot of the "share", workers bound to the host's address."""
    share = tmp_path_factory.mktemp("nfs")
    address = routable_address()
    runs = {}
    try:
        for run_id, slot, scenario in ((RUN_A, "slot0", "metrics"), (RUN_B, "slot1", "marker")):
            env = {"RPC_OBSERVE": "1", "RPC_OBSERVE_DIR": str(share / slot), "RPC_OBSERVE_RUN_ID": run_id,
                   "RPC_OBSERVE_METRICS_ADDR": address}
            runs[run_id] = Cluster(tmp_path_factory.mktemp(run_id), scenario, env=env, hold=True)
        expected = {run_id: cluster.wait_ready() for run_id, cluster in runs.items()}
    except BaseException:
        for cluster in runs.values():
            cluster.kill()
        raise
    yield share, address, runs, expected
    for cluster in runs.values():
        cluster.wait()


@pytest.fixture(scope="module")
def nfs_prometheus(nfs, tmp_path_factory):
    share = nfs[0]
    text = FILE_SD.read_text(encoding="utf-8")
    assert text.count(NFS_PREFIX) == 2
    config = for_test(yaml.safe_load(text.replace(NFS_PREFIX, f"{share}/")))
    server = ConfiguredPrometheus(tmp_path_factory.mktemp("prometheus-nfs"), config)
    yield server
    server.stop()


def test_each_worker_announces_the_hosts_address_and_its_run(nfs):
    share, address, _, _ = nfs
    for run_id, slot in ((RUN_A, "slot0"), (RUN_B, "slot1")):
        groups = read_targets(share / slot / "targets")
        assert sorted(groups) == ["worker0", "worker1", "worker2"]
        for group in groups.values():
            (target,) = group["targets"]
            assert target.rsplit(":", 1)[0] == address
            assert group["labels"] == {"job": "rpc_observe", "rpc_observe_run_id": run_id}
            assert total(samples(scrape(target)), "torch_rpc_agent_threads") == 16  # really served there


def test_promtool_reads_the_workers_target_files_on_the_share(nfs, tmp_path):
    share = nfs[0]
    config = FILE_SD.read_text(encoding="utf-8").replace(NFS_PREFIX, f"{share}/")
    (tmp_path / "prometheus.yml").write_text(config)
    code, output = promtool_check(tmp_path / "prometheus.yml")
    assert code == 0 and "WARNING" not in output, output  # the patterns match the workers' files


def test_prometheus_discovers_every_worker_of_both_runs(nfs, nfs_prometheus):
    share, address, _, _ = nfs
    assert nfs_prometheus.wait_for('count(up{job="rpc_observe"} == 1)', 6) == 6
    announced = {group["targets"][0]: (run_id, slot) for run_id, slot in ((RUN_A, "slot0"), (RUN_B, "slot1"))
                 for group in read_targets(share / slot / "targets").values()}
    active = nfs_prometheus.targets()["activeTargets"]
    assert {t["labels"]["instance"]: (t["labels"]["rpc_observe_run_id"], t["labels"]["rpc_observe_slot"])
            for t in active} == announced
    assert {t["labels"]["host"] for t in active} == {address}
    assert all(t["health"] == "up" for t in active)


def test_queries_filtered_by_run_id_return_only_that_run(nfs, nfs_prometheus):
    share, _, runs, expected = nfs
    assert nfs_prometheus.wait_for('count(up{job="rpc_observe"} == 1)', 6) == 6
    for run_id, slot in ((RUN_A, "slot0"), (RUN_B, "slot1")):
        instances = {g["targets"][0] for g in read_targets(share / slot / "targets").values()}
        up = nfs_prometheus.query(UP_OF_A_RUN.replace("RUN", run_id))
        assert {r["metric"]["instance"] for r in up} == instances
        assert all(r["value"][1] == "1" for r in up)
        series = nfs_prometheus.wait_for_result(f'torch_rpc_agent_threads{{rpc_observe_run_id="{run_id}"}}', 3)
        assert {r["metric"]["instance"] for r in series} == instances
        assert sorted(r["metric"]["worker"] for r in series) == ["worker0", "worker1", "worker2"]
        # The same sums as the workers' own endpoints give, for this run only.
        requests = {r["metric"]["worker"]: float(r["value"][1])
                    for r in nfs_prometheus.query(REQUESTS_OF_A_RUN.replace("RUN", run_id))}
        endpoints = {g["targets"][0]: w for w, g in read_targets(share / slot / "targets").items()}
        assert requests == {w: total(samples(scrape(t)), "torch_rpc_client_requests_total")
                            for t, w in endpoints.items()}
    calls = expected[RUN_A]["calls"]
    n_add = calls["add_sync"] + calls["add_async"] + calls["add_remote"]
    add = 'sum(torch_rpc_client_duration_seconds_count{{method="add", rpc_observe_run_id="{}"}})'
    assert nfs_prometheus.value(add.format(RUN_A)) == n_add
    assert nfs_prometheus.query(add.format(RUN_B)) == []  # run B made no `add` call
    assert nfs_prometheus.query('up{rpc_observe_run_id="no-such-run"}') == []
    runs_scraped = {r["metric"]["rpc_observe_run_id"]: float(r["value"][1])
                    for r in nfs_prometheus.query(RUNS_SCRAPED)}
    assert runs_scraped == {RUN_A: 3, RUN_B: 3}


def test_p99_of_one_run(nfs_prometheus):
    # The calls were made before the first scrape: the rates are 0 and the quantile NaN, one series.
    result = nfs_prometheus.wait_for_result(P99_OF_A_RUN.replace("RUN", RUN_A), 1)
    assert len(result) == 1 and set(result[0]["metric"]) == set()
    assert nfs_prometheus.query(P99_OF_A_RUN.replace("RUN", "no-such-run")) == []


def test_merge_keeps_the_run_it_is_asked_for(nfs, tmp_path):
    """Last of the file_sd tests: it lets both runs finish, which writes their span files."""
    share, _, runs, _ = nfs
    for cluster in runs.values():
        cluster.wait()
    spans = read_spans(share / "slot0") + read_spans(share / "slot1")
    per_run = {run_id: sum(1 for s in spans if s["resource"]["rpc_observe.run_id"] == run_id)
               for run_id in (RUN_A, RUN_B)}
    assert per_run[RUN_A] > per_run[RUN_B] > 0
    for run_id in (RUN_A, RUN_B):
        out = tmp_path / f"{run_id}.json"
        result = subprocess.run([sys.executable, "-m", "rpc_observe", "merge", "--run-id", run_id, "-o", str(out),
                                 str(share)], capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, result.stderr  # 2: the other run's three files, reported as skipped
        assert result.stderr.count("from another run") == 3, result.stderr
        summary = json.loads(out.read_text())["rpc_observe_merge"]
        assert summary["run_id"] == run_id
        assert summary["rpc"]["spans"] == per_run[run_id]


# ---------------------------------------------------------------------------
# Scheme 2: fixed ports, static configs per host
# ---------------------------------------------------------------------------

def _base_port(hosts: list[str], count: int) -> int:
    for _ in range(50):
        base = free_port()
        if base + count <= 65535 and ports_free(hosts, list(range(base, base + count))):
            return base
    raise AssertionError("no free port range")


def test_static_ports_scheme_scrapes_every_worker(tmp_path):
    hosts = {"127.0.0.1": 2, "127.0.0.2": 1}  # two "hosts": local ranks 0-1 and 0
    base = _base_port(list(hosts), max(hosts.values()))
    placement = [(host, local) for host, n in hosts.items() for local in range(n)]  # rank -> (host, local rank)
    rank_env = {rank: {"RPC_OBSERVE_METRICS_ADDR": host, "LOCAL_RANK": str(local)}
                for rank, (host, local) in enumerate(placement)}
    env = {"RPC_OBSERVE": "1", "RPC_OBSERVE_METRICS_PORT": str(base), "RPC_OBSERVE_RUN_ID": "run-static"}
    cluster = Cluster(tmp_path / "job", "marker", env=env, rank_env=rank_env, hold=True)
    server = None
    try:
        cluster.wait_ready()
        # The static config of the scheme: one group per host, ports base + local rank.
        config = for_test(_yaml(STATIC))
        job = _job(config)
        shipped = job["static_configs"]
        assert len(shipped) == 2 and all(g["targets"][0].endswith(":9400") for g in shipped)
        job["static_configs"] = [{"targets": [f"{host}:{base + local}" for local in range(n)],
                                  "labels": {"rpc_observe_run_id": "run-static"}} for host, n in hosts.items()]
        server = ConfiguredPrometheus(tmp_path / "prometheus", config)
        assert server.wait_for('count(up{job="rpc_observe"} == 1)', 3) == 3
        series = server.wait_for_result('torch_rpc_agent_threads{rpc_observe_run_id="run-static"}', 3)
        assert {r["metric"]["instance"]: (r["metric"]["worker"], r["metric"]["host"]) for r in series} == {
            f"{host}:{base + local}": (f"worker{rank}", host) for rank, (host, local) in enumerate(placement)}
        # The file_sd targets agree: nothing fell back to a free port.
        assert cluster.targets() == {f"worker{rank}": f"{host}:{base + local}"
                                     for rank, (host, local) in enumerate(placement)}
    finally:
        if server is not None:
            server.stop()
        cluster.wait()


# ---------------------------------------------------------------------------
# Scheme 2 on Kubernetes: the relabeling, on kubernetes_sd's meta labels
# ---------------------------------------------------------------------------

META = "__meta_kubernetes_"


def _pod(name: str, ip: str, node: str, phase: str, annotations: dict, containers: dict) -> list[dict]:
    """What kubernetes_sd (role: pod) makes of a pod, one target per declared port, as file_sd groups."""
    labels = {f"{META}namespace": "training", f"{META}pod_name": name, f"{META}pod_ip": ip,
              f"{META}pod_node_name": node, f"{META}pod_host_ip": "10.0.0.1", f"{META}pod_phase": phase,
              f"{META}pod_ready": "true" if phase == "Running" else "false", f"{META}pod_uid": f"uid-{name}"}
    for key, value in annotations.items():
        sanitized = "".join(c if c.isalnum() or c == "_" else "_" for c in key)
        labels[f"{META}pod_annotation_{sanitized}"] = value
        labels[f"{META}pod_annotationpresent_{sanitized}"] = "true"
    targets = [{"__address__": f"{ip}:{port}", f"{META}pod_container_name": container,
                f"{META}pod_container_port_name": port_name, f"{META}pod_container_port_number": str(port),
                f"{META}pod_container_port_protocol": protocol, f"{META}pod_container_init": "false"}
               for container, ports in containers.items() for port_name, port, protocol in ports]
    # kubernetes_sd gives the pod's labels to its group and the port's to each target; file_sd has
    # group labels only, so one group per target, with both.
    return [{"targets": [t.pop("__address__")], "labels": {**labels, **t}} for t in targets]


def test_kubernetes_relabeling_keeps_exactly_the_workers(tmp_path):
    pod_ips = {"trainer-0": ("127.0.0.3", "node-a", 2), "trainer-1": ("127.0.0.4", "node-b", 1)}
    if not ports_free([ip for ip, _, _ in pod_ips.values()], [K8S_BASE_PORT, K8S_BASE_PORT + 1]):
        pytest.skip(f"ports {K8S_BASE_PORT}-{K8S_BASE_PORT + 1} are taken on 127.0.0.3/127.0.0.4")
    placement = [(pod, local) for pod, (_, _, n) in pod_ips.items() for local in range(n)]
    rank_env = {rank: {"RPC_OBSERVE_METRICS_ADDR": pod_ips[pod][0], "LOCAL_RANK": str(local)}
                for rank, (pod, local) in enumerate(placement)}
    env = {"RPC_OBSERVE": "1", "RPC_OBSERVE_METRICS_PORT": str(K8S_BASE_PORT), "RPC_OBSERVE_RUN_ID": "run-k8s"}
    opted_in = {"rpc-observe/scrape": "true", "rpc-observe/run-id": "run-k8s"}
    groups = (
        _pod("trainer-0", "127.0.0.3", "node-a", "Running", opted_in, {
            "trainer": [("rpc-observe-0", 9400, "TCP"), ("rpc-observe-1", 9401, "TCP"), ("dns", 9402, "UDP")],
            "sidecar": [("http", 8080, "TCP")]})
        + _pod("trainer-1", "127.0.0.4", "node-b", "Running", opted_in,
               {"trainer": [("rpc-observe-0", 9400, "TCP")]})
        + _pod("other-app", "127.0.0.5", "node-b", "Running", {}, {"app": [("metrics", 9400, "TCP")]})
        + _pod("trainer-2", "127.0.0.6", "node-c", "Pending", opted_in,
               {"trainer": [("rpc-observe-0", 9400, "TCP")]}))
    (tmp_path / "pods").mkdir()
    (tmp_path / "pods" / "pods.json").write_text(json.dumps(groups))
    cluster = Cluster(tmp_path / "job", "marker", env=env, rank_env=rank_env, hold=True)
    server = None
    try:
        cluster.wait_ready()
        config = _yaml(KUBERNETES)
        job = _job(config)
        del job["kubernetes_sd_configs"]
        job["file_sd_configs"] = [{"files": [str(tmp_path / "pods" / "*.json")]}]
        server = ConfiguredPrometheus(tmp_path / "prometheus", for_test(config))
        assert server.wait_for('count(up{job="rpc_observe"} == 1)', 3) == 3
        targets = server.targets()
        active = {t["labels"]["instance"]: t["labels"] for t in targets["activeTargets"]}
        expected = {f"{pod_ips[pod][0]}:{K8S_BASE_PORT + local}": pod for pod, local in placement}
        assert sorted(active) == sorted(expected)
        for instance, labels in active.items():
            pod = expected[instance]
            assert labels == {"instance": instance, "job": "rpc_observe", "rpc_observe_run_id": "run-k8s",
                              "namespace": "training", "pod": pod, "host": pod_ips[pod][1]}
        assert len(targets["droppedTargets"]) == 4  # UDP port, sidecar port, no annotation, Pending
        series = server.wait_for_result('torch_rpc_agent_threads{rpc_observe_run_id="run-k8s"}', 3)
        workers = {f"{pod_ips[pod][0]}:{K8S_BASE_PORT + local}": f"worker{rank}"
                   for rank, (pod, local) in enumerate(placement)}
        assert {r["metric"]["instance"]: r["metric"]["worker"] for r in series} == workers
    finally:
        if server is not None:
            server.stop()
        cluster.wait()
