"""The configurations and their worker processes: one caller/callee pair of benchmarks/_worker.py each,
or (the saturation section) a group of one server and four clients.

Each pair or group runs on a fresh file:// rendezvous, is driven over the workers' stdin (JSON
commands) and a JSON answer pipe, and is kept SIGSTOPped whenever it is not the one being measured.
"""

from __future__ import annotations

import json
import os
import signal
import site
import subprocess
import sys
import time
from typing import Any

from bench.procstat import TICK_US, cpu_us

__all__ = ["cpu_us", "Pair", "Worker", "start_pairs", "shutdown_all", "kill_all", "proc_counters"]

WORKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_worker.py")

LABELS = {
    "a": "(a) torch RPC only (python -S, no .pth)",
    "a2": "(a2) = (a), 2nd pair: A/A noise control",
    "b": "(b) installed, RPC_OBSERVE unset",
    "c": "(c) metrics only",
    "d": "(d) metrics+spans+profiler events",
    "dn": "(dn) (d), thread states not kept",
    "e": "(e) (d) + torch.profiler on caller",
    "ap": "(ap) (a) + torch.profiler on caller [ref]",
    "h": "(h) hand-written OTel SDK + prometheus",
    "l": "(l) (a) + torch legacy profiler [ref]",
}
ON = {"RPC_OBSERVE": "1"}
ENVS: dict[str, dict[str, str]] = {
    "a": {},
    "a2": {},
    "ap": {},
    "b": {},
    "c": {**ON, "OTEL_TRACES_EXPORTER": "none", "RPC_OBSERVE_PROFILER_EVENTS": "0"},
    "d": dict(ON),
    # (d) with torch's pool threads given a new Python thread state at every GIL hold, as torch alone does
    # (hooks/thread_states.py): the cost of observing alone, without what keeping them saves
    "dn": {**ON, "RPC_OBSERVE_KEEP_THREAD_STATES": "0"},
    "e": dict(ON),
    "h": {},  # rpc_observe is not imported; the worker sets up the OpenTelemetry SDK itself
    "l": {},
}
NO_SITE = ("a", "a2", "ap", "h", "l")  # started with `python -S`
for _c in ("c", "d", "dn", "e"):  # --profile: these with the worker's in-situ self-timer (BENCH_SELF_TIME)
    LABELS[_c + "_t"] = LABELS[_c] + " + self-timer"
    ENVS[_c + "_t"] = {**ENVS[_c], "BENCH_SELF_TIME": "1"}
EXTRA_ENV: dict[str, dict[str, str]] = {}  # per config, for diagnostics (edit by hand)
BASELINE = ("c0", "d0", "e0")  # --baseline REV: (c), (d) and (e) with rpc_observe imported from REV's tree


def add_baseline(rev: str, tree: str) -> None:
    """Registers (c0), (d0) and (e0): the configs (c), (d) and (e), their rpc_observe imported from `tree` (REV's
    rpc_observe/, put first on PYTHONPATH), so that a change is measured against REV in the same rounds."""
    for c in BASELINE:
        LABELS[c] = f"{LABELS[c[0]]} at {rev}"
        ENVS[c] = {**ENVS[c[0]], "PYTHONPATH": tree}
        LABELS[c + "_t"] = LABELS[c] + " + self-timer"  # --profile: with the self-timer too
        ENVS[c + "_t"] = {**ENVS[c], "BENCH_SELF_TIME": "1"}


SAT_CONFIGS = ["a", "c", "d", "dn", "h"]  # the saturation section's groups (+ "a2" with the A/A control)


def configs_for(mode: str, control: bool = True, profiler_baseline: bool = False, baseline: bool = False) -> list[str]:
    """The configurations a mode's latency/throughput rounds run."""
    if mode == "memory":
        return ["a", "d"]
    if mode == "profile":
        return ["a", "c", "d", "dn", "c_t", "d_t", "dn_t", "e_t"] + (["d0", "c0_t", "d0_t", "e0_t"] if baseline else [])
    return (["a", "b", "c", "d", "dn", "e", "h", "l"] + (list(BASELINE) if baseline else [])
            + (["a2"] if control else []) + (["ap"] if profiler_baseline else []))


def clean_env() -> dict[str, str]:
    """This process's environment without any RPC_OBSERVE* / OTEL_* variable."""
    return {k: v for k, v in os.environ.items() if not (k.startswith("RPC_OBSERVE") or k.startswith("OTEL_"))}


def site_dirs() -> list[str]:
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        dirs.append(site.getusersitepackages())
    return dirs


def tail(path: str, n: int = 30) -> str:
    try:
        with open(path) as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


class Worker:
    def __init__(self, config: str, rank: int, init_file: str, tmp: str, transport: str, channels: str = "default",
                 world: int = 2) -> None:
        env = clean_env()
        env.update(ENVS[config])
        env.update(EXTRA_ENV.get(config, {}))
        env["RPC_OBSERVE_DIR"] = os.path.join(tmp, f"out-{config}")
        env["BENCH_SITE_DIRS"] = os.pathsep.join(site_dirs())
        env["BENCH_TRANSPORT"] = transport
        env["BENCH_CHANNELS"] = channels
        env["BENCH_WORLD"] = str(world)
        env.setdefault("PYTHONUNBUFFERED", "1")
        cmd = [sys.executable] + (["-S"] if config in NO_SITE else []) + [WORKER, config, str(rank), init_file]
        self.config, self.rank = config, rank
        self.log_path = os.path.join(tmp, f"worker-{os.path.basename(init_file)}-{rank}.log")
        self._log = open(self.log_path, "w")  # open as long as the process runs
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     env=env, text=True, bufsize=1, cwd=tmp)
        self.ready: dict[str, Any] | None = None

    def send(self, cmd: str, **kwargs: Any) -> None:
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kwargs}) + "\n")
        self.proc.stdin.flush()

    def recv(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(5)
            raise RuntimeError(f"worker {self.config}/{self.rank} died (rc={self.proc.returncode}); "
                               f"log {self.log_path}:\n{tail(self.log_path)}")
        msg = json.loads(line)
        if msg.get("ok") is False:
            raise RuntimeError(f"worker {self.config}/{self.rank}: {msg['error']}\n{tail(self.log_path)}")
        return msg

    def call(self, cmd: str, **kwargs: Any) -> Any:
        self.send(cmd, **kwargs)
        return self.recv().get("result")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def close(self) -> None:
        """Kills the process if it still runs, reaps it and closes its pipes and log."""
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        for f in (self.proc.stdin, self.proc.stdout, self._log):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass


class Pair:
    """The processes of one configuration: a caller (rank 0) and a callee (rank 1), or with
    `world` > 2 a saturation group: one server (rank 1) and `world` - 1 clients (the other ranks)."""

    started = 0

    def __init__(self, config: str, tmp: str, transport: str, channels: str = "default", world: int = 2) -> None:
        Pair.started += 1
        kind = "pair" if world == 2 else f"group{world}"
        init_file = os.path.join(tmp, f"init-{kind}-{config}-{Pair.started}")  # a fresh file:// rendezvous
        self.config = config
        self.workers = [Worker(config, r, init_file, tmp, transport, channels, world) for r in range(world)]
        self.caller, self.callee = self.workers[0], self.workers[1]
        self.server = self.callee
        self.clients = [w for w in self.workers if w.rank != 1]

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self.workers]

    def wait_ready(self) -> None:
        for w in self.workers:
            w.ready = w.recv()

    # TensorPipe's shm transport has a reactor thread (TP_SHM_reactor) that busy-polls:
    # ~50% of a core per process even when no RPC is in flight. Ten idle workers would
    # fill both cores, so every pair but the one being measured is kept SIGSTOPped.
    def pause(self) -> None:
        for w in self.workers:
            os.kill(w.pid, signal.SIGSTOP)

    def resume(self) -> None:
        for w in self.workers:
            os.kill(w.pid, signal.SIGCONT)

    def call(self, cmd: str, **kwargs: Any) -> Any:
        """Runs one command on the caller, with this pair (only) running."""
        self.resume()
        try:
            return self.caller.call(cmd, **kwargs)
        finally:
            self.pause()

    def shutdown(self) -> dict[int, dict[str, Any]]:
        return shutdown_all([self])[self.config]

    def kill(self) -> None:
        for w in self.workers:
            w.close()


def kill_all(pairs: list[Pair]) -> None:
    """Ends the pairs without rpc.shutdown() (a round's pairs are not needed afterwards: saves ~1 s per pair)."""
    for pr in pairs:
        pr.kill()


def shutdown_all(pairs: list[Pair]) -> dict[str, dict[int, dict[str, Any]]]:
    """rpc.shutdown() in every worker of every pair, all at once (it is collective per pair); a worker
    that does not answer is killed."""
    for pr in pairs:
        pr.resume()
    for pr in pairs:
        for w in pr.workers:
            w.send("shutdown")
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for pr in pairs:
        res = out.setdefault(pr.config, {})
        for w in pr.workers:
            try:
                res[w.rank] = w.recv()
                w.proc.wait(30)
            except Exception as e:  # noqa: BLE001
                res[w.rank] = {"error": str(e)}
            w.close()
    return out


def start_pairs(configs: list[str], tmp: str, transport: str, channels: str = "default", world: int = 2,
                verbose: bool = True) -> dict[str, Pair]:
    """One pair (or group of `world`) per config, all started at once, in the order given."""
    t0 = time.perf_counter()
    pairs = {c: Pair(c, tmp, transport, channels, world) for c in configs}
    try:
        for p in pairs.values():
            p.wait_ready()
    except Exception:
        for p in pairs.values():
            p.kill()
        raise
    n = sum(len(p.workers) for p in pairs.values())
    print(f"started {n} worker processes in {time.perf_counter() - t0:.1f}s", flush=True)
    if verbose:
        for c, p in pairs.items():
            st = p.caller.ready["state"]
            print(f"  {c:>2}: pids {'/'.join(map(str, p.pids))} rpc_observe imported={st['rpc_observe_imported']} "
                  f"patched={st['invoke_rpc_patched']} no_site={st['no_site']} "
                  f"otel_sdk={st['opentelemetry_sdk_imported']} runtime={st.get('runtime')}", flush=True)
    for c, p in pairs.items():  # a baseline measured with the current code would compare nothing
        tree = ENVS[c].get("PYTHONPATH")
        for w in p.workers:
            if tree is not None and w.ready["state"].get("rpc_observe_dir") != tree:
                raise RuntimeError(f"({c}) imported rpc_observe from {w.ready['state'].get('rpc_observe_dir')}, "
                                   f"not from the baseline tree {tree}")
    return pairs


# -- /proc counters of a worker ----------------------------------------------------------------
def _stat_fields(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def proc_counters(pid: int) -> dict[str, float]:
    """Context switches (all live threads), minor page faults and user/sys CPU (whole process) of a process."""
    vcs = nvcs = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches"):
                        vcs += int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches"):
                        nvcs += int(line.split()[1])
        except OSError:
            pass
    fields = _stat_fields(pid)
    return {"vcs": vcs, "nvcs": nvcs, "minflt": int(fields[7]), "user_us": int(fields[11]) * TICK_US,
            "sys_us": int(fields[12]) * TICK_US}
