"""Regression check for a crash found by benchmarks/overhead.py config (e): with RPC_OBSERVE=1,
stopping a torch.profiler session right after rpc_sync returned corrupted the heap.
Fixed in rpc_observe/_client.py, now rpc_observe/hooks/client.py (`_watch` returns torch's
profiling future); the plain mode now runs its 400 sessions cleanly.

    python benchmarks/repro_profiler_stop_race.py            # segfault / abort within ~10-400 sessions
    python benchmarks/repro_profiler_stop_race.py --settle   # sleep 20 ms before each stop: no crash

Why: rpc_observe's client wrapper starts a record_function for the call (Kineto active on
this thread) and ends it with `rf._call_end_callbacks_on_future(fut)`, but returns the
original `fut` to rpc_sync. `Future.wait()` wakes the caller as soon as the future is
marked complete, before its callbacks have run, so the caller can stop the profiler while
a pool thread is still ending the record_function into the profiler's freed state.
torch's own (legacy-profiler) path returns the future from `_call_end_callbacks_on_future`
instead, so the caller cannot get ahead of the end callback; rpc_observe now does
the same.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile


def echo(t):
    return t


def worker(rank: int, init: str, sessions: int, mode: str) -> None:
    import time

    import torch
    import torch.distributed.rpc as rpc
    from torch.profiler import ProfilerActivity, profile

    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{init}", num_worker_threads=16)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 0:
        t = torch.ones(4)
        for _session in range(sessions):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(50):
                    rpc.rpc_sync("worker1", echo, args=(t,))
                if mode == "settle":
                    time.sleep(0.02)
            n = sum(1 for e in prof.events() if e.name.startswith("rpc_sync#"))
        print(f"OK: {sessions} profiler sessions of 50 rpc_sync, {n} rpc_sync events in the last", flush=True)
    rpc.shutdown()


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5])
        return 0
    mode = "settle" if "--settle" in sys.argv else "plain"
    sessions = 400
    tmp = tempfile.mkdtemp()
    env = dict(os.environ, RPC_OBSERVE="1", RPC_OBSERVE_DIR=os.path.join(tmp, "out"))
    args = [sys.executable, os.path.abspath(__file__), "--worker"]
    callee = subprocess.Popen(args + ["1", os.path.join(tmp, "init"), "0", mode], env=env,
                              stderr=subprocess.DEVNULL)
    caller = subprocess.run(args + ["0", os.path.join(tmp, "init"), str(sessions), mode], env=env,
                            capture_output=True, text=True)
    lines = [ln for ln in (caller.stdout + caller.stderr).splitlines() if "USDT" not in ln]
    if caller.returncode != 0:
        callee.kill()
        print(f"mode={mode}: caller died, rc={caller.returncode} "
              f"({'signal ' + str(-caller.returncode) if caller.returncode < 0 else 'error'})")
        print("\n".join(lines[-5:]))
        return 1
    callee.wait(60)
    print(f"mode={mode}: " + "\n".join(ln for ln in lines if ln.startswith("OK")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
