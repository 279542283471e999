"""RPC workloads run by the end-to-end tests, in real worker processes.

Run as `python scenarios.py NAME RANK WORLD_SIZE INIT_FILE RESULT_FILE`: each process
joins torch RPC on 127.0.0.1 (TensorPipe, file:// rendezvous) as `worker{RANK}`; rank 0
drives the scenario and every rank writes what it saw to RESULT_FILE as JSON. The
add-on is switched on only by the environment the test gives the process.
"""

from __future__ import annotations

import contextvars
import json
import os
import sys
import threading
import time

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

MARKER = "SECRET-MARKER-7f3a"


# -- functions called over RPC (module level, so every worker can unpickle them) ----
def add(t, n):
    return t + n


def fail(kind):
    if kind == "key":
        raise KeyError(f"missing {kind}")
    raise ValueError(f"bad {kind}")


def sleep_for(seconds):
    time.sleep(seconds)
    return seconds


def nested(t, hops):
    """Calls the next worker, `hops` more times: a chain across workers is one trace."""
    me = rpc.get_worker_info()
    if hops == 0:
        return t + 1, [me.name]
    nxt = f"worker{(me.id + 1) % rpc.api._get_current_rpc_agent().get_worker_infos().__len__()}"
    value, path = rpc.rpc_sync(nxt, nested, args=(t, hops - 1))
    return value + 1, [me.name] + path


@rpc.functions.async_execution
def async_add(t, n, delay):
    fut = Future()

    def _complete():
        time.sleep(delay)
        fut.set_result(t + n)

    threading.Thread(target=_complete, daemon=True).start()
    return fut


@torch.jit.script
def script_add(t: torch.Tensor, n: int) -> torch.Tensor:
    return t + n


def call_method(method, rref, *args):
    """The PyTorch examples' `_call_method` helper."""
    return method(rref.local_value(), *args)


class Counter:
    def __init__(self):
        self.value = 0

    def incr(self, n=1):
        self.value += n
        return self.value

    def get(self):
        return self.value


def view_size(t):
    """What travelled: the received tensor's own and storage bytes."""
    return [t.numel() * t.element_size(), t.untyped_storage().nbytes()]


def _outcome(fn):
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001 - the scenario records what torch raised
        return {"error": type(e).__name__}
    return {"value": _plain(value)}


def _plain(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


# -- scenarios (rank 0 drives) -------------------------------------------------------
def basic(world):
    t = torch.ones(4)
    out = {}
    out["sync"] = _outcome(lambda: rpc.rpc_sync("worker1", add, args=(t, 1)))
    out["async"] = _outcome(lambda: rpc.rpc_async("worker1", add, args=(t, 2)).wait())
    out["remote"] = _outcome(lambda: rpc.remote("worker2", add, args=(t, 3)).to_here())
    out["builtin"] = _outcome(lambda: rpc.rpc_sync("worker1", torch.add, args=(t, 4)))
    out["script"] = _outcome(lambda: rpc.rpc_sync("worker2", script_add, args=(t, 5)))
    out["async_execution"] = _outcome(lambda: rpc.rpc_async("worker1", async_add, args=(t, 6, 0.2)).wait())
    out["nested"] = _outcome(lambda: rpc.rpc_sync("worker1", nested, args=(t, 2)))
    out["fail_value"] = _outcome(lambda: rpc.rpc_sync("worker1", fail, args=("value",)))
    out["fail_key_sync"] = _outcome(lambda: rpc.rpc_sync("worker2", fail, args=("key",)))
    out["fail_key_remote"] = _outcome(lambda: rpc.remote("worker2", fail, args=("key",)).to_here())
    counter = rpc.remote("worker1", Counter)
    out["proxy_sync"] = _outcome(lambda: counter.rpc_sync().incr(1))
    out["proxy_async"] = _outcome(lambda: counter.rpc_async().incr(2).wait())
    out["proxy_remote"] = _outcome(lambda: counter.remote().get().to_here())
    out["helper"] = _outcome(lambda: rpc.rpc_sync("worker1", call_method, args=(Counter.incr, counter, 5)))
    out["timeout"] = _outcome(lambda: rpc.rpc_sync("worker2", sleep_for, args=(1.5,), timeout=0.3))
    return out


def _pickled_len(func, args):
    """len() of the pickle torch sends for this call, by torch's own (unwrapped) pickler."""
    from torch.distributed.rpc import internal

    serialize = internal._InternalRPCPickler.serialize
    serialize = getattr(serialize, "__rpc_observe_original__", serialize)
    data, tensors = serialize(internal._internal_rpc_pickler, internal.PythonUDF(func, args, {}))
    return len(data), len(tensors)


def metrics(world):
    """Known calls, so that the test can check the counters exactly."""
    t = torch.ones(4)
    calls = {"add_sync": 7, "add_async": 5, "add_remote": 3, "fail": 2, "threads": 16, "per_thread": 25}
    for _ in range(calls["add_sync"]):
        rpc.rpc_sync("worker1", add, args=(t, 1))
    futs = [rpc.rpc_async("worker2", add, args=(t, 1)) for _ in range(calls["add_async"])]
    torch.futures.wait_all(futs)
    for _ in range(calls["add_remote"]):
        rpc.remote("worker2", add, args=(t, 1)).to_here()
    for _ in range(calls["fail"]):
        try:
            rpc.rpc_sync("worker1", fail, args=("value",))
        except ValueError:
            pass
    # A small view of a big storage, and a big view of one: what travels differs.
    big = torch.zeros(1 << 20)  # 4 MiB storage
    small_view, large_view = big[:1000], big[: (1 << 20) - 1000]
    received = [rpc.rpc_sync("worker1", view_size, args=(v,)) for v in (small_view, large_view)]
    many = [torch.ones(3) for _ in range(6)]
    rpc.rpc_sync("worker1", view_size_many, args=(many,))

    def _hammer():
        for _ in range(calls["per_thread"]):
            rpc.rpc_sync("worker1", echo, args=(t,))

    threads = [threading.Thread(target=_hammer) for _ in range(calls["threads"])]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return {
        "calls": calls,
        "received": received,
        "views": [[v.numel() * v.element_size(), v.untyped_storage().nbytes()] for v in (small_view, large_view)],
        "add_request": _pickled_len(add, (t, 1)),
        "many_request": _pickled_len(view_size_many, (many,)),
    }


def echo(t):
    return t


def view_size_many(ts):
    return len(ts)


def marker(world):
    """Arguments and return values carry a marker string that must never be exported."""
    t = torch.ones(2)
    rpc.rpc_sync("worker1", echo_kw, args=(MARKER,), kwargs={"secret": MARKER, "t": t})
    rpc.rpc_async("worker2", echo_kw, args=(MARKER,), kwargs={"secret": MARKER, "t": t}).wait()
    rpc.remote("worker1", echo_kw, args=(MARKER,), kwargs={"secret": MARKER, "t": t}).to_here()
    return {"ok": True}


def echo_kw(value, secret=None, t=None):
    return value, secret, t


def noop(t):
    return t


def latency(world):
    """p50 of a no-op rpc_sync, in ms."""
    t = torch.ones(4)
    for _ in range(50):
        rpc.rpc_sync("worker1", noop, args=(t,))
    times = []
    for _ in range(int(os.environ.get("SCENARIO_CALLS", "300"))):
        start = time.perf_counter()
        rpc.rpc_sync("worker1", noop, args=(t,))
        times.append(time.perf_counter() - start)
    times.sort()
    return {"p50_ms": times[len(times) // 2] * 1e3}


def _raw_request(dst, func, args, trailer):
    """A real RPC whose pickle ends with `trailer` (what a broken or hostile peer sends)."""
    from torch.distributed.rpc import api, internal

    serialize = internal._InternalRPCPickler.serialize
    serialize = getattr(serialize, "__rpc_observe_original__", serialize)
    data, tensors = serialize(internal._internal_rpc_pickler, internal.PythonUDF(func, args, {}))
    info = rpc.get_worker_info(dst)
    return api._invoke_rpc_python_udf(info, data + trailer, tensors, 10.0, False).wait()


def hostile(world):
    magic = b"\x00rpcobs1"

    def framed(payload: bytes, length: int | None = None) -> bytes:
        return payload + (len(payload) if length is None else length).to_bytes(2, "little") + magic

    trailers = {
        "length_beyond_message": framed(b"q", 60000),
        "not_utf8": framed(b"q\x1f\xff\xfe\x1fsync\x1f\x1ftraceparent=\xff"),
        "unknown_kind": framed(b"z\x1fworker0\x1fsync\x1f"),
        "bad_call_id": framed(b"q\x1fworker0\x1fsync\x1f12; rm -rf"),
        "bad_traceparent": framed(b"q\x1fworker0\x1fsync\x1f\x1ftraceparent=00-zz-yy-01"),
        "zero_trace_id": framed(
            ("q\x1fworker0\x1fsync\x1f7\x1ftraceparent=00-" + "0" * 32 + "-" + "1" * 16 + "-01").encode()
        ),
        "oversized": framed(
            b"q\x1fworker0\x1fsync\x1f\x1f" + b"\x1f".join(b"k%d=%s" % (i, b"v" * 40) for i in range(40))
        ),
        "wrong_types": framed(b"q"),
        "magic_only": magic,
    }
    t = torch.ones(3)
    out = {}
    for name, trailer in trailers.items():
        start = time.perf_counter()
        out[name] = {
            "value": _raw_request("worker1", add, (t, 1), trailer).tolist(),
            "ms": (time.perf_counter() - start) * 1e3,
        }
    return out


def die():
    os.kill(os.getpid(), 9)


def death(world):
    """worker2 is SIGKILLed while calls to it are in flight."""
    futs = [rpc.rpc_async("worker2", sleep_for, args=(5,)) for _ in range(4)]
    time.sleep(0.3)
    rpc.rpc_async("worker2", die)
    errors = []
    for fut in futs:
        try:
            fut.wait()
            errors.append(None)
        except Exception as e:  # noqa: BLE001
            errors.append(type(e).__name__)
    return {"errors": errors, "alive": rpc.rpc_sync("worker1", add, args=(torch.ones(1), 1)).tolist()}


def make_tensor(n):
    return torch.ones(n)


def make_dict():
    return {"a": 1, "b": 2}


def make_weight():
    return torch.ones(4, requires_grad=True)


def linear(w, x):
    return (w * x).sum()


def traffic(world):
    """Traffic the pickler never sees: tensor RRef fetches, dist_autograd.backward, DistributedOptimizer.step.

    Keeps `keep` owner RRefs alive on worker1 while the test scrapes its RRef gauges.
    """
    import torch.distributed.autograd as dist_autograd
    from torch.distributed.optim import DistributedOptimizer

    global _kept
    _kept = [rpc.remote("worker1", make_tensor, args=(1000 + i,)) for i in range(3)]
    fetched = [r.to_here().numel() for r in _kept]  # three tensor fetches, 4 kB each
    fetched.append(len(rpc.remote("worker1", make_dict).to_here()))  # a Python value: pickled
    fetched.append(rpc.remote("worker1", torch.add, args=(torch.ones(2), 1)).to_here().numel())  # a builtin's tensor
    w_rref = rpc.remote("worker1", make_weight)
    w_rref.to_here()
    optimizer = DistributedOptimizer(torch.optim.SGD, [w_rref], lr=0.1)
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync("worker1", linear, args=(w_rref.to_here(), torch.ones(4)))
        loss = rpc.rpc_sync("worker2", linear, args=(torch.ones(4, requires_grad=True), torch.ones(4))) + loss
        dist_autograd.backward(context_id, [loss])
        optimizer.step(context_id)
    async_sum = rpc.rpc_async("worker1", async_add, args=(torch.ones(2), 1, 0.05)).wait()  # replied from a user thread
    # A builtin's rpc_sync has no done-callback (hooks/client.py, ClientSite.swept): it ends where its wait returns.
    from rpc_observe.hooks.calls import in_flight

    builtin = rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 2))
    left = [c.site.key for c in list(in_flight.values()) if c.site.swept and c.site.mode == "sync"]
    return {"fetched": fetched, "async": async_sum.tolist(), "builtin": builtin.tolist(), "sync_left": left,
            "contexts_after": int(dist_autograd._get_debug_info()["num_autograd_contexts"])}


_kept = []


class _WaitAtFinalization:
    """Held by a module global, so it is freed while the interpreter finalizes (after atexit): it waits
    there for `future`, so that the reply reaches this process during finalization."""

    def __init__(self, future, sleep=time.sleep, now=time.monotonic):
        self.future, self.sleep, self.now = future, sleep, now

    def __del__(self):
        deadline = self.now() + 10
        while not self.future.done() and self.now() < deadline:
            self.sleep(0.01)


_HELD = []


def pending_at_exit(world):
    """rank 0 leaves through an exception, without rpc.shutdown(), while a remote() call it made is still
    running on worker1; its reply arrives while rank 0's interpreter finalizes (the pipeline example's exit)."""
    t = torch.ones(4)
    rref = rpc.remote("worker1", async_add, args=(t, 1, float(os.environ.get("SCENARIO_DELAY", "1.0"))))
    _HELD.append(_WaitAtFinalization(rref._get_future()))
    _touch(os.environ["SCENARIO_READY"] + "0")
    time.sleep(float(os.environ.get("SCENARIO_LINGER", "0")))  # scraped meanwhile
    raise RuntimeError("the job failed")


def pending_at_exit_peer():
    """worker1: serves the delayed remote() call, outlives rank 0, then fails too."""
    _touch(os.environ["SCENARIO_READY"] + "1")
    time.sleep(float(os.environ.get("SCENARIO_DELAY", "1.0")) + 3.0)
    raise RuntimeError("the job failed here too")


def sigterm(world):
    """rank 0: calls in flight, main thread blocked in C++, when the test SIGTERMs this process."""
    t = torch.ones(4)
    long_calls = [rpc.rpc_async("worker1", sleep_for, args=(60,)) for _ in range(4)]

    def _loop():
        while True:
            rpc.rpc_sync("worker1", add, args=(t, 1))

    for _ in range(4):
        threading.Thread(target=_loop, daemon=True).start()
    time.sleep(1.0)
    _touch(os.environ["SCENARIO_READY"] + "0")
    for fut in long_calls:
        fut.wait()
    return {}


def sigterm_peer():
    """rank 1: two long calls to rank 0 (which the test SIGTERMs), then shutdown, blocked until SIGTERMed too."""
    futs = [rpc.rpc_async("worker0", sleep_for, args=(60,)) for _ in range(2)]
    _touch(os.environ["SCENARIO_READY"] + "1")
    for fut in futs:
        try:
            fut.wait()
        except Exception:  # noqa: BLE001 - rank 0 is gone
            pass
    _touch(os.environ["SCENARIO_READY"] + "1-failed")
    time.sleep(120)


def _touch(path):
    with open(path, "w"):
        pass


class _TaggedPickler(rpc.internal._InternalRPCPickler):
    """A custom pickler, installed with torch's own hook."""

    def __init__(self):
        super().__init__()
        self._register_reducer(Tagged, lambda obj: (Tagged, (obj.tag + "!",)))


class Tagged:
    def __init__(self, tag):
        self.tag = tag


def tag_of(obj):
    return obj.tag


def custom_pickler(world):
    with rpc.api._use_rpc_pickler(_TaggedPickler()):
        value = rpc.rpc_sync("worker1", tag_of, args=(Tagged("x"),))
    return {"value": value}


def rref_in_args(world):
    """An RRef travels inside the arguments (serialization inside serialization)."""
    rref = rpc.remote("worker2", add, args=(torch.ones(2), 2))
    return {"value": rpc.rpc_sync("worker1", fetch, args=(rref,)).tolist()}


def fetch(rref):
    return rref.to_here()


def soak(world):
    """16 threads of mixed calls; returns exactly what was called."""
    per_thread = int(os.environ.get("SCENARIO_CALLS", "60"))
    counts = {"sync": 0, "async": 0, "remote": 0, "fail": 0}
    lock = threading.Lock()
    t = torch.ones(4)

    def _run(index):
        mine = {"sync": 0, "async": 0, "remote": 0, "fail": 0}
        for i in range(per_thread):
            dst = f"worker{1 + (index + i) % (world - 1)}"
            kind = ("sync", "async", "remote", "fail")[(index + i) % 4]
            if kind == "sync":
                rpc.rpc_sync(dst, add, args=(t, 1))
            elif kind == "async":
                rpc.rpc_async(dst, add, args=(t, 1)).wait()
            elif kind == "remote":
                rpc.remote(dst, add, args=(t, 1)).to_here()
            else:
                try:
                    rpc.rpc_sync(dst, fail, args=("value",))
                except ValueError:
                    pass
            mine[kind] += 1
        with lock:
            for k, v in mine.items():
                counts[k] += v

    rss = []
    for _half in range(2):
        threads = [threading.Thread(target=_run, args=(i,)) for i in range(16)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        rss.append(_rss_kb())
    return {"counts": counts, "rss_kb": rss}


def small(i):
    return i + 1


def last_call(i):
    return -i


def span_flood(world):
    """4 threads of small rpc_sync calls to worker1 for SCENARIO_SECONDS (many spans, fast), then 5 `last_call`s,
    whose spans are the newest. With SCENARIO_FILL, a file of that path fills its disk for the middle third."""
    seconds = float(os.environ.get("SCENARIO_SECONDS", "3"))
    fill = os.environ.get("SCENARIO_FILL")
    start = time.monotonic()
    counts, wrong = [0] * 4, [0] * 4

    def _run(index):
        i = 0
        while time.monotonic() - start < seconds:
            wrong[index] += rpc.rpc_sync("worker1", small, args=(i,)) != i + 1
            counts[index] += 1
            i += 1

    threads = [threading.Thread(target=_run, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    filled = 0
    if fill:
        time.sleep(seconds / 3)
        with open(fill, "wb", buffering=0) as f:
            try:
                while True:
                    filled += f.write(b"\0" * 65536)
            except OSError:  # ENOSPC: the disk is full
                pass
        time.sleep(seconds / 3)
        os.remove(fill)
    for th in threads:
        th.join()
    time.sleep(0.3)  # the flood's last batch is written before the last calls: they are a batch of their own
    last = [rpc.rpc_sync("worker1", last_call, args=(i,)) for i in range(5)]
    return {"calls": sum(counts), "wrong": sum(wrong), "last": last, "filled": filled}


# -- why stuck, why slow (issue 22) ---------------------------------------------------
def ring_hop(ring, i, secret=None):
    """Calls the next worker of `ring` with rpc_sync: on pools of one thread, a ring that comes back
    to a busy worker is the classic nested-rpc_sync deadlock."""
    if i >= len(ring):
        return i
    return rpc.rpc_sync(ring[i], ring_hop, args=(ring, i + 1, secret))  # the blocking line of every hop


STUCK = threading.Event()  # never set: a UDF that waits on it is stuck in user code


def wait_for_ever(secret):
    STUCK.wait(120)  # the line a stuck UDF's stack must point at
    return secret


def deadlock(world):
    """worker1 -> worker2 -> worker0 -> worker1 (queued: worker1's one pool thread is busy), on pools of 1."""
    global _kept
    _kept = [rpc.rpc_async("worker1", ring_hop, args=(["worker2", "worker0", "worker1"], 0, MARKER))]
    time.sleep(0.5)
    return {"started": True}


def stuck(world):
    """A UDF on worker1 waits on an Event for ever; a call to worker2 is in flight (the test stops worker2)."""
    global _kept
    _kept = [rpc.rpc_async("worker1", wait_for_ever, args=(MARKER,)),
             rpc.rpc_async("worker2", sleep_for, args=(30,))]
    time.sleep(0.5)
    return {"started": True}


def nested_spans_udf(rounds):
    """A trainer's UDF (the ddp_rpc example's `_run_trainer`): RPCs, dist_autograd.backward and
    DistributedOptimizer.step, several times, all inside one served call."""
    import torch.distributed.autograd as dist_autograd
    from torch.distributed.optim import DistributedOptimizer

    w_rref = rpc.remote("worker2", make_weight)
    optimizer = DistributedOptimizer(torch.optim.SGD, [w_rref], lr=0.1)
    for _ in range(rounds):
        with dist_autograd.context() as context_id:
            loss = rpc.rpc_sync("worker2", linear, args=(w_rref.to_here(), torch.ones(4)))
            dist_autograd.backward(context_id, [loss])
            optimizer.step(context_id)
            rpc.rpc_sync("worker2", add, args=(torch.ones(1), 1))
    return rounds


def nested_spans(world):
    return {"rounds": rpc.rpc_sync("worker1", nested_spans_udf, args=(3,))}


LOG_FORMAT = "%(otelTraceID)s|%(otelSpanID)s|%(otelServiceName)s|%(otelTraceSampled)s|%(message)s"


CALLER_LOGGED = threading.Event()  # set by `caller_logged`: the caller has logged while its call was in flight


def caller_logged():
    CALLER_LOGGED.set()


def logging_udf(depth, hold=False):
    """Logs inside the UDF, and around a nested rpc_async when `depth` > 0; with `hold`, returns only once
    the caller has logged (so the caller's record is made while the call is surely in flight)."""
    import logging

    log = logging.getLogger("scenario")
    log.info("udf depth=%d", depth)
    if hold:
        CALLER_LOGGED.wait(60)
    if depth:
        fut = rpc.rpc_async("worker2", logging_udf, args=(depth - 1,))
        log.info("udf waiting depth=%d", depth)
        fut.wait()
        log.info("udf after depth=%d", depth)
    return depth


def logs(world):
    """Log records around calls, inside UDFs and while calls are in flight (OTEL_PYTHON_LOG_CORRELATION)."""
    import logging

    log = logging.getLogger("scenario")
    log.info("before")
    rpc.rpc_sync("worker1", logging_udf, args=(1,))
    log.info("between")
    fut = rpc.rpc_async("worker1", logging_udf, args=(0, True))
    log.info("in flight")
    rpc.rpc_sync("worker1", caller_logged)
    fut.wait()
    log.info("after")
    return {"logged": True}


def profiler_stop_race(world):
    """torch.profiler sessions stopped right after rpc_sync returned (a crash of the heap once: the caller
    stopped the profiler while a pool thread still ended the call's profiler event; hooks/client.py `_watch`)."""
    from torch.profiler import ProfilerActivity, profile

    t, events = torch.ones(4), 0
    for _ in range(int(os.environ.get("SCENARIO_SESSIONS", "200"))):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(50):
                rpc.rpc_sync("worker1", echo, args=(t,))
        events = sum(1 for e in prof.events() if e.name.startswith("rpc_sync#"))
    return {"events_in_last_session": events}


def split(world):
    """8 callers of a 20 ms UDF on worker1 (a pool of 1): the callee's time stays ~20 ms, the rest grows."""
    def _run(_):
        return [rpc.rpc_sync("worker1", sleep_for, args=(0.02,)) for _ in range(5)]

    threads = [threading.Thread(target=_run, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return {"calls": 40}


def busy(world):
    """A healthy job under load, nested calls included, while the test reads /debug/rpc in a loop."""
    deadline = time.monotonic() + float(os.environ.get("SCENARIO_SECONDS", "4"))
    results, errors = [], []

    def _run(index):
        t = torch.ones(2)
        while time.monotonic() < deadline:
            try:
                value, path = rpc.rpc_sync(f"worker{1 + index % 2}", nested, args=(t, 2), timeout=10)
                results.append(value.tolist() == [4.0, 4.0] and len(path) == 3)
                results.append(rpc.rpc_async("worker2", add, args=(t, index), timeout=10).wait().tolist()
                               == [1.0 + index] * 2)
            except Exception as e:  # noqa: BLE001 - counted: the test expects none
                errors.append(type(e).__name__)

    threads = [threading.Thread(target=_run, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return {"calls": len(results), "wrong": results.count(False), "errors": errors}


_THREAD = threading.local()
_UDF_VAR: contextvars.ContextVar[str] = contextvars.ContextVar("scenario_udf_var")


def visit_thread(_fut=None):
    """(native thread id, how often this thread's `threading.local` saw a visit before, whether a context variable
    an earlier UDF set is seen): what a Python thread state kept between GIL holds changes, and what it must not."""
    before = getattr(_THREAD, "visits", 0)
    _THREAD.visits = before + 1
    leaked = _UDF_VAR.get(None) is not None
    _UDF_VAR.set("set by an earlier UDF")
    return threading.get_native_id(), before, leaked


def _visits(seen):
    """Visits that found an earlier one on their pool thread, and the pool threads: all but each thread's first,
    when kept. A done-callback added to a future that is already done runs here, on the main thread, whose state
    Python keeps anyway: `inline`, left out of the rest."""
    main = threading.main_thread().native_id
    pool = [visit for visit in seen if visit[0] != main]
    return {"calls": len(seen), "inline": len(seen) - len(pool), "threads": len({tid for tid, _, _ in pool}),
            "seen_before": sum(1 for _, before, _ in pool if before), "leaked": sum(1 for *_, leaked in pool if leaked)}


def thread_states(world):
    """UDFs on worker1's pool threads, and done-callbacks on this worker's: do their thread states outlive a call?"""
    served = [rpc.rpc_sync("worker1", visit_thread) for _ in range(200)]
    served += [f.wait() for f in [rpc.rpc_async("worker1", visit_thread) for _ in range(50)]]
    t = torch.ones(2)
    callbacks = [rpc.rpc_async("worker1", echo, args=(t,)).then(visit_thread).wait() for _ in range(100)]
    return {"served": _visits(served), "callbacks": _visits(callbacks)}


def _rss_kb():
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1])


SCENARIOS = {
    "basic": basic,
    "metrics": metrics,
    "marker": marker,
    "latency": latency,
    "hostile": hostile,
    "death": death,
    "sigterm": sigterm,
    "traffic": traffic,
    "pending_at_exit": pending_at_exit,
    "custom_pickler": custom_pickler,
    "rref_in_args": rref_in_args,
    "soak": soak,
    "span_flood": span_flood,
    "deadlock": deadlock,
    "stuck": stuck,
    "nested_spans": nested_spans,
    "split": split,
    "busy": busy,
    "logs": logs,
    "profiler_stop_race": profiler_stop_race,
    "thread_states": thread_states,
}


def _break_telemetry():
    """Fault injection into rpc_observe itself: its metrics and its exporter raise."""
    from rpc_observe.telemetry import runtime as _runtime

    def broken(*args, **kwargs):
        raise RuntimeError("injected telemetry failure")

    runtime = _runtime.current
    runtime.metrics.record = broken  # what every call site binds when it is first seen
    if runtime is not None and runtime.tracer is not None:
        for sink in runtime.tracer._sinks:
            sink.export = broken


_START = time.monotonic()


def deadline_for(seconds: float) -> float:
    return _START + seconds


def main() -> None:
    name, rank, world, init_file, result_file = sys.argv[1:6]
    rank, world = int(rank), int(world)
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"file://{init_file}", num_worker_threads=int(os.environ.get("SCENARIO_POOL", "16")),
        _transports=["uv"], _channels=["basic"], rpc_timeout=float(os.environ.get("SCENARIO_RPC_TIMEOUT", "60")),
    )
    if name == "logs":
        import logging

        logging.basicConfig(filename=f"worker{rank}.log", format=LOG_FORMAT, level=logging.INFO)
        logging.getLogger("scenario").info("before init_rpc")  # the attributes exist from interpreter start
    profile_dir = os.environ.get("SCENARIO_PROFILE_DIR")
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile_dir else None
    if profiler:
        profiler.start()
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=options)
    if os.environ.get("SCENARIO_BREAK"):
        _break_telemetry()
    if name == "sigterm" and rank == 1:
        sigterm_peer()
    if name == "pending_at_exit" and rank != 0:
        pending_at_exit_peer()
    result = SCENARIOS[name](world) if rank == 0 else {}
    hold = os.environ.get("SCENARIO_HOLD")
    if hold and rank == 0:
        # Keep every worker's endpoint up (the others wait in shutdown) until the test releases us.
        ready = os.path.join(os.path.dirname(hold), "ready")
        with open(ready + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(ready + ".tmp", ready)
        deadline = time.monotonic() + 120
        while os.path.exists(hold) and time.monotonic() < deadline:
            time.sleep(0.05)
    if name == "death" and rank != 0 and hold:
        # No graceful shutdown barrier with a dead peer: wait for rank 0 and the test instead.
        ready = os.path.join(os.path.dirname(hold), "ready")
        while (not os.path.exists(ready) or os.path.exists(hold)) and time.monotonic() < deadline_for(120):
            time.sleep(0.05)
    started = time.monotonic()
    rpc.shutdown(graceful=name != "death")
    result["shutdown_s"] = time.monotonic() - started
    if profiler:
        profiler.stop()
        profiler.export_chrome_trace(os.path.join(profile_dir, f"worker{rank}.json"))
    with open(result_file, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
