"""Runs a scenario of tests/scenarios.py in real worker processes on 127.0.0.1."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCENARIOS = HERE / "scenarios.py"


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without any rpc_observe or OTEL setting, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RPC_OBSERVE", "OTEL_", "SCENARIO_"))}
    env.update(extra)
    return env


class Cluster:
    """`world` processes running one scenario; rank 0 drives it.

    With `hold=True`, rank 0 waits after the scenario (endpoints alive) until `release()`.
    """

    def __init__(
        self,
        tmp_path: Path,
        scenario: str,
        world: int = 3,
        env: dict | None = None,
        rank_env: dict[int, dict] | None = None,
        hold: bool = False,
        args: str = "",
    ):
        self.dir = Path(tmp_path)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.out_dir = self.dir / "out"
        self.world = world
        self.procs: list[subprocess.Popen] = []
        self.hold_file = self.dir / "hold"
        self.ready_file = self.dir / "ready"
        base = clean_env(
            RPC_OBSERVE_DIR=str(self.out_dir),
            RPC_OBSERVE_RUN_ID=f"test-{self.dir.name}",
            SCENARIO_ARGS=args,
            PYTHONUNBUFFERED="1",
        )
        base.update(env or {})
        if hold:
            self.hold_file.write_text("hold")
            base["SCENARIO_HOLD"] = str(self.hold_file)
        init = self.dir / "init"
        for rank in range(world):
            proc_env = {**base, **((rank_env or {}).get(rank, {}))}
            log = open(self.dir / f"log{rank}.txt", "w")
            self.procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(SCENARIOS),
                        scenario,
                        str(rank),
                        str(world),
                        str(init),
                        str(self.dir / f"result{rank}.json"),
                    ],
                    env=proc_env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=self.dir,
                )
            )

    def log(self, rank: int) -> str:
        return (self.dir / f"log{rank}.txt").read_text(errors="replace")

    def wait_ready(self, timeout: float = 90, killed: tuple[int, ...] = ()) -> dict:
        """Waits for rank 0 to finish the scenario while holding; returns its result.

        Ranks in `killed` are expected to die (SIGKILL) before that."""
        deadline = time.monotonic() + timeout
        while not self.ready_file.exists():
            failed = [rank for rank, p in enumerate(self.procs)
                      if p.poll() not in (None, 0) and not (rank in killed and p.poll() == -9)]
            if failed or time.monotonic() > deadline:
                doctor = "" if failed else self.doctor()  # stuck: who waits on whom, while the workers still run
                self.kill()
                rank = failed[0] if failed else 0  # the log that says why
                raise AssertionError(f"scenario did not get ready (rank {rank}'s log):\n" + self.log(rank)[-3000:]
                                     + doctor)
            time.sleep(0.1)
        return json.loads(self.ready_file.read_text())

    def scrape_held(
        self, timeout: float = 90, killed: tuple[int, ...] = (), workers: tuple[str, ...] | None = None
    ) -> tuple[dict, dict[str, list]]:
        """Waits for the held scenario, scrapes the workers' endpoints (all by default), then lets them finish.

        Returns rank 0's result and {worker: parsed samples}.
        """
        try:
            result = self.wait_ready(timeout, killed)
            parsed = {w: samples(scrape(t)) for w, t in self.targets().items() if workers is None or w in workers}
        finally:
            self.wait(timeout=max(timeout, 120), killed=killed)
        return result, parsed

    def release(self) -> None:
        self.hold_file.unlink(missing_ok=True)

    def wait(self, timeout: float = 120, killed: tuple[int, ...] = ()) -> list[dict]:
        """Waits for every process to exit 0 (or to have been killed); returns each rank's result.

        How long each rank's rpc.shutdown() took goes to `self.shutdown_s`.
        """
        self.release()
        deadline = time.monotonic() + timeout
        results, self.shutdown_s = [], {}
        for rank, proc in enumerate(self.procs):
            try:
                code = proc.wait(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"rank {rank} hung:\n" + self.log(rank)[-3000:]) from None
            if rank in killed:
                assert code == -9, f"rank {rank} exited {code}, expected SIGKILL"
                results.append(None)
                continue
            if code != 0:  # the others would wait for it in rpc.shutdown(): stop them too
                self.kill()
                raise AssertionError(f"rank {rank} exited {code}:\n" + self.log(rank)[-3000:])
            result = json.loads((self.dir / f"result{rank}.json").read_text())
            self.shutdown_s[rank] = result.pop("shutdown_s")
            results.append(result)
        return results

    def doctor(self) -> str:
        """`rpc-observe doctor` on the live workers: the diagnosis a stuck test leaves in its failure."""
        try:
            out = subprocess.run([sys.executable, "-m", "rpc_observe", "doctor", str(self.out_dir)],
                                 capture_output=True, text=True, timeout=60)
            return f"\nrpc-observe doctor (exit {out.returncode}):\n{out.stdout[-6000:]}{out.stderr[-2000:]}"
        except (OSError, subprocess.SubprocessError) as e:
            return f"\nrpc-observe doctor did not run: {e}"

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()

    def targets(self) -> dict[str, str]:
        """worker -> host:port, from the file_sd target files the workers wrote."""
        found = {}
        for path in glob.glob(str(self.out_dir / "targets" / "*.json")):
            for group in json.loads(Path(path).read_text()):
                found[Path(path).stem] = group["targets"][0]
        return found

    def spans(self) -> list[dict]:
        return read_spans(self.out_dir)


def span_files(out_dir: Path) -> list[str]:
    """The span files: per process, its rotated `<name>.jsonl.N` (larger N older) oldest first, then `<name>.jsonl`."""
    paths = glob.glob(str(Path(out_dir) / "spans" / "*.jsonl")) + glob.glob(
        str(Path(out_dir) / "spans" / "*.jsonl.[0-9]*")
    )

    def oldest_first(path: str) -> tuple[str, int]:
        base, _, n = path.rpartition(".jsonl")
        return base, -int(n[1:] or 0)

    return sorted(paths, key=oldest_first)


def read_spans(out_dir: Path) -> list[dict]:
    """Every span in the OTLP JSON span files (rotated ones too), with its worker added as `worker`."""
    spans = []
    for path in span_files(out_dir):
        for line in Path(path).read_text().splitlines():
            for resource_spans in json.loads(line)["resourceSpans"]:
                resource = attributes(resource_spans["resource"])
                for scope_spans in resource_spans["scopeSpans"]:
                    for span in scope_spans["spans"]:
                        span["worker"] = resource["torch.rpc.worker"]
                        span["attrs"] = attributes(span)
                        span["resource"] = resource
                        spans.append(span)
    return spans


def attributes(obj: dict) -> dict:
    out = {}
    for item in obj.get("attributes", []):
        value = item["value"]
        out[item["key"]] = next(iter(value.values()))
    return out


def scrape(target: str) -> str:
    with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as response:
        return response.read().decode()


def samples(text: str) -> list[tuple[str, dict, float]]:
    """(name, labels, value) of every sample, parsed with prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def total(parsed: list, name: str, **labels: str) -> float:
    return sum(v for n, lab, v in parsed if n == name and all(lab.get(k) == want for k, want in labels.items()))
