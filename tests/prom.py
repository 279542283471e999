"""A real Prometheus server on a free loopback port, finding workers through file_sd."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prometheus_binary() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("the prometheus binary is missing in CI: .ci/run must apt-get install prometheus")
        pytest.skip("no prometheus binary (apt-get install -y prometheus); this test needs a real server")
    return binary


class Prometheus:
    def __init__(self, workdir: Path, targets_glob: str):
        self.port = free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        config = workdir / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: rpc_observe\n    scrape_interval: 1s\n"
            f"    file_sd_configs:\n      - files: ['{targets_glob}']\n        refresh_interval: 1s\n"
        )
        self.log = open(workdir / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [
                prometheus_binary(),
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--enable-feature=exemplar-storage",  # as docker-compose.yml's
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise AssertionError(
                        "prometheus did not start: " + (workdir / "prometheus.log").read_text()[-2000:]
                    ) from None
                time.sleep(0.2)

    def query(self, promql: str) -> list[dict]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return body["data"]["result"]

    def exemplars(self, promql: str, start: float, end: float) -> list[dict]:
        """`/api/v1/query_exemplars`: [{"seriesLabels": {...}, "exemplars": [{"labels", "value", "timestamp"}]}]."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query_exemplars?" + urllib.parse.urlencode(
            {"query": promql, "start": start, "end": end})
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return body["data"]

    def value(self, promql: str) -> float | None:
        result = self.query(promql)
        return float(result[0]["value"][1]) if result else None

    def wait_for(self, promql: str, expected: float, timeout: float = 30) -> float | None:
        """Polls until the query returns `expected` (scrapes are 1 s apart)."""
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            value = self.value(promql)
            if value == expected:
                return value
            time.sleep(0.5)
        return value

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
