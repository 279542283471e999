"""The configurations and their worker processes: one caller/callee pair of benchmarks/_worker.py each.

Each pair runs on a fresh file:// rendezvous, is driven over the workers' stdin (JSON commands)
and a JSON answer pipe, and is kept SIGSTOPped whenever it is not the pair being measured.
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

WORKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_worker.py")

LABELS = {
    "a": "(a) torch RPC only (python -S, no .pth)",
    "a2": "(a2) = (a), 2nd pair: A/A noise control",
    "b": "(b) installed, RPC_OBSERVE unset",
    "c": "(c) metrics only",
    "d": "(d) metrics+spans+profiler events",
    "e": "(e) (d) + torch.profiler on caller",
    "ap": "(ap) (a) + torch.profiler on caller [ref]",
}
ON = {"RPC_OBSERVE": "1"}
ENVS: dict[str, dict[str, str]] = {
    "a": {},
    "a2": {},
    "ap": {},
    "b": {},
    "c": {**ON, "OTEL_TRACES_EXPORTER": "none", "RPC_OBSERVE_PROFILER_EVENTS": "0"},
    "d": dict(ON),
    "e": dict(ON),
}
NO_SITE = ("a", "a2", "ap")  # started with `python -S`
for _c in ("c", "d"):  # --profile: (c), (d) with the worker's in-situ self-timer (BENCH_SELF_TIME)
    LABELS[_c + "_t"] = LABELS[_c] + " + self-timer"
    ENVS[_c + "_t"] = {**ENVS[_c], "BENCH_SELF_TIME": "1"}
EXTRA_ENV: dict[str, dict[str, str]] = {}  # per config, for diagnostics (edit by hand)


def configs_for(mode: str, control: bool = True, profiler_baseline: bool = False) -> list[str]:
    """The configurations a mode runs."""
    if mode == "memory":
        return ["a", "d"]
    if mode == "profile":
        return ["a", "c", "d", "c_t", "d_t"]
    return ["a", "b", "c", "d", "e"] + (["a2"] if control else []) + (["ap"] if profiler_baseline else [])


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
    def __init__(self, config: str, rank: int, init_file: str, tmp: str, transport: str) -> None:
        env = clean_env()
        env.update(ENVS[config])
        env.update(EXTRA_ENV.get(config, {}))
        env["RPC_OBSERVE_DIR"] = os.path.join(tmp, f"out-{config}")
        env["BENCH_SITE_DIRS"] = os.pathsep.join(site_dirs())
        env["BENCH_TRANSPORT"] = transport
        env.setdefault("PYTHONUNBUFFERED", "1")
        cmd = [sys.executable] + (["-S"] if config in NO_SITE else []) + [WORKER, config, str(rank), init_file]
        self.config, self.rank = config, rank
        self.log_path = os.path.join(tmp, f"worker-{config}-{rank}-{os.path.basename(init_file)}.log")
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


class Pair:
    started = 0

    def __init__(self, config: str, tmp: str, transport: str) -> None:
        Pair.started += 1
        init_file = os.path.join(tmp, f"init-{config}-{Pair.started}")  # a fresh file:// rendezvous
        self.config = config
        self.caller = Worker(config, 0, init_file, tmp, transport)
        self.callee = Worker(config, 1, init_file, tmp, transport)

    def wait_ready(self) -> None:
        for w in (self.caller, self.callee):
            w.ready = w.recv()

    # TensorPipe's shm transport has a reactor thread (TP_SHM_reactor) that busy-polls:
    # ~50% of a core per process even when no RPC is in flight. Ten idle workers would
    # fill both cores, so every pair but the one being measured is kept SIGSTOPped.
    def pause(self) -> None:
        for w in (self.caller, self.callee):
            os.kill(w.pid, signal.SIGSTOP)

    def resume(self) -> None:
        for w in (self.caller, self.callee):
            os.kill(w.pid, signal.SIGCONT)

    def call(self, cmd: str, **kwargs: Any) -> Any:
        """Runs one command on the caller, with this pair (only) running."""
        self.resume()
        try:
            return self.caller.call(cmd, **kwargs)
        finally:
            self.pause()

    def shutdown(self) -> dict[int, dict[str, Any]]:
        self.resume()
        for w in (self.caller, self.callee):
            w.send("shutdown")
        out = {}
        for w in (self.caller, self.callee):
            try:
                out[w.rank] = w.recv()
                w.proc.wait(30)
            except Exception as e:  # noqa: BLE001
                out[w.rank] = {"error": str(e)}
                w.proc.kill()
        return out

    def kill(self) -> None:
        for w in (self.caller, self.callee):
            if w.proc.poll() is None:
                w.proc.kill()


def start_pairs(configs: list[str], tmp: str, transport: str) -> dict[str, Pair]:
    t0 = time.perf_counter()
    pairs = {c: Pair(c, tmp, transport) for c in configs}
    for p in pairs.values():
        p.wait_ready()
    print(f"started {2 * len(pairs)} worker processes in {time.perf_counter() - t0:.1f}s", flush=True)
    for c, p in pairs.items():
        st = p.caller.ready["state"]
        print(f"  {c:>2}: pids {p.caller.pid}/{p.callee.pid} rpc_observe imported={st['rpc_observe_imported']} "
              f"patched={st['invoke_rpc_patched']} no_site={st['no_site']} runtime={st.get('runtime')}", flush=True)
    return pairs


# -- /proc counters of a worker ----------------------------------------------------------------
_TICK_US = 1e6 / os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def cpu_us(pid: int) -> float:
    """utime + stime of a process (all its threads, live and exited), in microseconds."""
    fields = _stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) * _TICK_US


def proc_counters(pid: int) -> dict[str, float]:
    """Context switches (all live threads) and user/sys CPU (whole process) of a process."""
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
    return {"vcs": vcs, "nvcs": nvcs, "user_us": int(fields[11]) * _TICK_US, "sys_us": int(fields[12]) * _TICK_US}
