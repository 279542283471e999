"""The demo's worker processes: a parameter server and trainers, in torch RPC's own idioms.

- trainers read the weights through an RRef proxy (`ps_rref.rpc_sync().get_weights()`);
- they push gradients with `rpc_async` to an `@rpc.functions.async_execution` method
  that batches the updates of all trainers (as in torch's batch-updating PS tutorial);
- the server evaluates a model by calling a trainer back (a nested, three-hop call);
- `remote` creates statistics on the server, fetched with `to_here()`;
- every 50 steps, one call fails on purpose, and one sends a view of a large tensor,
  whose whole storage travels (the wasted-storage panel lights up).
The add-on is not imported here: the parent sets RPC_OBSERVE=1 in the environment.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

DIM = 256


class ParameterServer:
    def __init__(self, trainers: int):
        self.weights = torch.zeros(DIM)
        self._pending = torch.zeros(DIM)
        self._count = 0
        self._trainers = trainers
        self._future: Future = Future()
        self._lock = threading.Lock()
        # A batch waits at most 20 ms for slow trainers.
        threading.Thread(target=self._flush_periodically, daemon=True).start()

    def get_weights(self) -> torch.Tensor:
        return self.weights

    def _apply(self) -> None:
        if self._count:
            self.weights -= 0.01 * self._pending / self._count
            self._pending.zero_()
            self._count = 0
            future, self._future = self._future, Future()
            future.set_result(self.weights.clone())

    def _flush_periodically(self) -> None:
        while True:
            time.sleep(0.02)
            with self._lock:
                self._apply()

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch(ps_rref: rpc.RRef, grad: torch.Tensor) -> Future:
        self = ps_rref.local_value()
        with self._lock:
            self._pending += grad
            self._count += 1
            future = self._future
            if self._count >= self._trainers:
                self._apply()
        return future


_server: dict = {}
_server_ready = threading.Event()


def parameter_server() -> rpc.RRef:
    """The one ParameterServer, owned by `ps`; trainers fetch its RRef (with `remote`)."""
    _server_ready.wait(timeout=60)
    return _server["rref"]


def evaluate(weights: torch.Tensor, scorer: str) -> float:
    """Runs on the server; asks a trainer to score a batch: trainer -> ps -> trainer."""
    return float(rpc.rpc_sync(scorer, score_batch, args=(weights,)))


def score_batch(weights: torch.Tensor) -> torch.Tensor:
    batch = torch.randn(64, DIM)
    return (batch @ weights).abs().mean()


def make_stats(step: int) -> dict:
    return {"step": step, "norm": 0.0}


def save_checkpoint(path: str) -> None:
    raise PermissionError(f"read-only file system: {path}")


def store_activations(activations: torch.Tensor) -> int:
    return activations.numel()


def _train(rank: int, world: int, stop: Callable[[], bool]) -> int:
    ps_rref = rpc.remote("ps", parameter_server).to_here()
    scorer = f"trainer{rank % (world - 1) + 1}"
    big = torch.randn(1 << 20)
    step = 0
    while not stop():
        weights = ps_rref.rpc_sync().get_weights()
        grad = torch.randn(DIM) * 0.1 + weights * 0.01
        rpc.rpc_async("ps", ParameterServer.update_and_fetch, args=(ps_rref, grad)).wait()
        if step % 5 == 0:
            rpc.rpc_sync("ps", evaluate, args=(weights, scorer))
            rpc.remote("ps", make_stats, args=(step,)).to_here()
        if step % 50 == 3:  # now and then, so that a long (--serve) run keeps showing them
            try:  # torch re-raises the remote PermissionError as a RuntimeError
                rpc.rpc_sync("ps", save_checkpoint, args=("/checkpoints/model.pt",))
            except RuntimeError:
                pass
            # 55% of a 4 MiB storage: torch sends the whole storage.
            rpc.rpc_sync("ps", store_activations, args=(big[: 576_717],))
        step += 1
    return step


def main() -> None:
    rank, world, init_file, control = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    name = "ps" if rank == 0 else f"trainer{rank}"
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{init_file}", num_worker_threads=16)
    rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=options)
    rpc.enable_gil_profiling(True)  # the agent then reports its GIL wait (a dashboard panel)
    if rank == 0:
        _server["rref"] = rpc.RRef(ParameterServer(world - 1))
        _server_ready.set()
    duration = float(os.environ["DEMO_DURATION"])  # 0: until the parent says stop
    deadline = time.time() + duration if duration else 0.0
    with open(os.path.join(control, f"started-{rank}"), "w") as f:
        f.write(str(time.time()))
    stop_file = os.path.join(control, "stop")

    def stop() -> bool:
        return (deadline and time.time() >= deadline) or os.path.exists(stop_file)

    steps = _train(rank, world, stop) if rank > 0 else 0
    with open(os.path.join(control, f"done-{rank}"), "w") as f:
        f.write(str(steps))
    # Stay up (endpoints alive) until the parent has scraped the final numbers.
    hold = os.path.join(control, "hold")
    give_up = time.time() + 120
    while os.path.exists(hold) and time.time() < give_up:
        time.sleep(0.05)
    rpc.shutdown()


if __name__ == "__main__":
    main()
