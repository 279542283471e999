"""One RPC worker process of benchmarks/overhead.py, driven over a control channel.

Run as `python [-S] _worker.py CONFIG RANK INIT_FILE`. Rank 0 (worker0) is the caller,
rank 1 (worker1) the callee (the server). In a saturation group (BENCH_WORLD=5) ranks 0, 2, 3
and 4 are clients, each running threads of `rpc_async(...).wait()` against worker1.
Commands arrive as JSON lines on stdin; each answer is one JSON line on the file descriptor
that was stdout when the process started (stdout itself is redirected to stderr, so nothing
torch or the add-on prints can corrupt the channel).

Configs `a`, `a2`, `h` and `l` are started with `python -S`: no .pth file is processed (so neither
rpc_observe.pth nor the editable install's path entry), and the site-packages
directories named in BENCH_SITE_DIRS are appended to sys.path by hand, which does not
process .pth files either. benchmarks/ itself is sys.path[0] (this script's directory),
so bench.stats (standard library only) imports in every config.

What this worker relies on in rpc_observe (all of it looked up, nothing imported, so that
configs a and b stay free of the add-on): the `__rpc_observe_original__` attribute that
rpc_observe sets on the torch functions it wraps, each wrapper's closure holding torch's
original (BENCH_SELF_TIME), and `current` of the runtime module (RPC_OBSERVE_MODULES).

Config `h` ("hand-written OpenTelemetry", no rpc_observe) is the user's alternative: the caller
wraps each call in an SDK CLIENT span and injects the context into the call's kwargs with
`propagate.inject`; the server UDF extracts it and runs in a SERVER span; a prometheus_client
Histogram (children bound once) observes the duration on each side. The SDK's BatchSpanProcessor
(rpc_observe's queue, batch and delay settings) exports to a small SpanExporter that writes OTLP
JSON lines to a file, formatted as rpc_observe's file sink formats them. Config `l` is plain
torch with torch's legacy profiler (`torch.autograd.profiler_legacy.profile()`, which turns on
torch's own RPC profiling) around each measurement on the caller.
"""

from __future__ import annotations

import os
import sys

if sys.flags.no_site:
    for _d in os.environ.get("BENCH_SITE_DIRS", "").split(os.pathsep):
        if _d and _d not in sys.path:
            sys.path.append(_d)

import collections  # noqa: E402
import gc  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed.rpc as rpc  # noqa: E402
from bench.procstat import python_thread_names, snapshot, window  # noqa: E402
from bench.stats import quantile  # noqa: E402

CONFIG = sys.argv[1]
RANK = int(sys.argv[2])
INIT_FILE = sys.argv[3]
WORLD = int(os.environ.get("BENCH_WORLD", "2"))
PEER = "worker1"  # the callee / server
NO_SITE_CONFIGS = ("a", "a2", "ap", "h", "l")
_ns = time.perf_counter_ns
_perf = time.perf_counter

# rpc_observe's modules this worker looks into (in sys.modules only: never imported from here),
# each by its current name first and its name before the package was split into sub-packages.
RPC_OBSERVE_MODULES: dict[str, tuple[str, ...]] = {
    "runtime": ("rpc_observe.telemetry.runtime", "rpc_observe._runtime"),  # `current`: the Runtime or None
}

# The answer channel: the original stdout; fd 1 then points at stderr.
_ctl = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr


# -- UDFs (module level in __main__ of every worker, so they unpickle on the callee) ----
def echo(*tensors: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
    return tensors[0] if len(tensors) == 1 else tensors


def sink(*tensors: torch.Tensor) -> None:
    return None


def rss(_: Any = None) -> dict[str, int]:
    return status()


_SERVED = itertools.count()  # the saturation server's calls: `next` is one C call, atomic under the GIL


def sat_noop(t: torch.Tensor) -> torch.Tensor:
    """The saturation section's no-op UDF; counts its calls on the server."""
    next(_SERVED)
    return t


# -- (h): hand-written OpenTelemetry SDK spans + prometheus_client histograms, no rpc_observe ------
_H: dict[str, Any] = {}  # tracer, propagate, SpanKind, histogram children, exporter, provider


def h_setup() -> None:
    """Config (h) only, before init_rpc: a TracerProvider with a BatchSpanProcessor (rpc_observe's
    defaults: queue 16384, batch 2048, 1 s delay) and a JSON-lines file exporter, and two Histograms."""
    from opentelemetry import propagate, trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
    from opentelemetry.trace import SpanKind
    from prometheus_client import Histogram

    class JsonLinesSpanExporter(SpanExporter):
        """Each batch as one OTLP/HTTP JSON `ExportTraceServiceRequest` line, formatted by hand with
        each call site's name/kind/attributes encoded once, as rpc_observe's OtlpJsonFileSink does."""

        def __init__(self, path: str, service: str) -> None:
            self._file = open(path, "ab", buffering=0)
            resource = json.dumps({"attributes": [{"key": "service.name", "value": {"stringValue": service}}]},
                                  separators=(",", ":"))
            self._head = ('{"resourceSpans":[{"resource":%s,"scopeSpans":[{"scope":{"name":"bench.handwritten"},'
                          '"spans":[' % resource).encode()
            self._site: dict[tuple[str, int], str] = {}
            self.spans = 0

        def _site_json(self, span: Any) -> str:
            key = (span.name, span.kind.value)
            text = self._site.get(key)
            if text is None:
                attrs = [{"key": k, "value": {"boolValue": v} if isinstance(v, bool) else {"stringValue": str(v)}}
                         for k, v in span.attributes.items()]
                text = self._site[key] = ',"name":%s,"kind":%d,"attributes":%s' % (
                    json.dumps(span.name), span.kind.value + 1, json.dumps(attrs, separators=(",", ":")))
            return text

        def export(self, spans: Any) -> Any:
            parts = []
            for s in spans:
                ctx = s.context
                parent = ',"parentSpanId":"%016x"' % s.parent.span_id if s.parent is not None else ""
                parts.append(('{"traceId":"%032x","spanId":"%016x"%s,"startTimeUnixNano":"%d",'
                              '"endTimeUnixNano":"%d"%s,"status":{"code":%d}}'
                              % (ctx.trace_id, ctx.span_id, parent, s.start_time, s.end_time, self._site_json(s),
                                 s.status.status_code.value)).encode())
            if parts:
                self._file.write(self._head + b",".join(parts) + b"]}]}]}\n")
                self.spans += len(parts)
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            self._file.close()

    out_dir = os.path.join(os.environ.get("RPC_OBSERVE_DIR", "."), "spans")
    os.makedirs(out_dir, exist_ok=True)
    service = f"worker{RANK}"
    exporter = JsonLinesSpanExporter(os.path.join(out_dir, f"h-{service}-{os.getpid()}.jsonl"), service)
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=16384, schedule_delay_millis=1000,
                                                   max_export_batch_size=2048))
    trace.set_tracer_provider(provider)
    client = Histogram("bench_rpc_client_duration_seconds", "RPC duration, caller", ["rpc_method", "peer"])
    server = Histogram("bench_rpc_server_duration_seconds", "UDF duration, callee", ["rpc_method", "peer"])
    _H.update(tracer=trace.get_tracer("bench.handwritten"), propagate=propagate, CLIENT=SpanKind.CLIENT,
              SERVER=SpanKind.SERVER, provider=provider, exporter=exporter,
              client={m: client.labels(m, PEER) for m in ("echo", "sat_noop")},
              server={m: server.labels(m, "caller") for m in ("echo", "sat_noop")})


def _h_attributes(method: str, mode: str) -> dict[str, Any]:
    """The attributes of rpc_observe's spans (hooks.naming.span_attributes), for the same span content."""
    key = f"rpc_{mode}#{method}(worker{RANK} -> {PEER})"
    return {"rpc.system": "torch_rpc", "rpc.system.name": "torch_rpc", "rpc.method": method,
            "torch.rpc.src": f"worker{RANK}", "torch.rpc.dst": PEER, "torch.rpc.exec_mode": mode,
            "torch.rpc.profiling_key": key, "torch.rpc.internal": False}


def _h_serve(method: str, fn: Any, args: tuple, carrier: dict[str, str] | None) -> Any:
    start = _perf()
    ctx = _H["propagate"].extract(carrier or {})
    with _H["tracer"].start_as_current_span(method, context=ctx, kind=_H["SERVER"],
                                            attributes=_H["attrs"][("server", method)]):
        out = fn(*args)
    _H["server"][method].observe(_perf() - start)
    return out


def h_echo(*tensors: torch.Tensor, otel: dict[str, str] | None = None) -> Any:
    return _h_serve("echo", echo, tensors, otel)


def h_sat_noop(t: torch.Tensor, otel: dict[str, str] | None = None) -> Any:
    return _h_serve("sat_noop", sat_noop, (t,), otel)


def _caller(fn: Any, h_fn: Any, method: str, mode: str) -> Any:
    """The call the measurements make: `rpc_sync`, or `rpc_async(...).wait()` (mode "async"),
    of `fn` on the server; in config (h) of `h_fn`, inside a CLIENT span, with the context injected."""
    if CONFIG != "h":
        if mode == "sync":
            return lambda args: rpc.rpc_sync(PEER, fn, args=args)
        return lambda args: rpc.rpc_async(PEER, fn, args=args).wait()

    def call(args: tuple) -> Any:
        start = _perf()
        with _H["tracer"].start_as_current_span(method, kind=_H["CLIENT"], attributes=_H["attrs"][(mode, method)]):
            carrier: dict[str, str] = {}
            _H["propagate"].inject(carrier)
            if mode == "sync":
                out = rpc.rpc_sync(PEER, h_fn, args=args, kwargs={"otel": carrier})
            else:
                out = rpc.rpc_async(PEER, h_fn, args=args, kwargs={"otel": carrier}).wait()
        _H["client"][method].observe(_perf() - start)
        return out

    return call


def make_callers() -> None:
    global ECHO_SYNC, ECHO_ASYNC, SAT_ASYNC
    if CONFIG == "h":
        _H["attrs"] = {(mode, m): _h_attributes(m, mode) for mode in ("sync", "async") for m in ("echo", "sat_noop")}
        _H["attrs"].update({("server", m): {**_h_attributes(m, "sync"), "torch.rpc.src": "caller",
                                            "torch.rpc.dst": f"worker{RANK}"} for m in ("echo", "sat_noop")})
    ECHO_SYNC = _caller(echo, h_echo, "echo", "sync")
    ECHO_ASYNC = _caller(echo, h_echo, "echo", "async")
    SAT_ASYNC = _caller(sat_noop, h_sat_noop, "sat_noop", "async")


ECHO_SYNC: Any = None
ECHO_ASYNC: Any = None
SAT_ASYNC: Any = None


# -- helpers ---------------------------------------------------------------------------
def status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value, _unit = line.split()
                out[key[:-1]] = int(value) * 1024
    return out


def rpc_observe_module(role: str) -> tuple[str, ModuleType] | tuple[None, None]:
    """The loaded rpc_observe module for `role` of RPC_OBSERVE_MODULES, under whichever name it has."""
    for name in RPC_OBSERVE_MODULES[role]:
        module = sys.modules.get(name)
        if module is not None:
            return name, module
    return None, None


def instrumentation_state() -> dict[str, Any]:
    api = sys.modules["torch.distributed.rpc.api"]
    state = {
        "rpc_observe_imported": "rpc_observe" in sys.modules,
        "invoke_rpc_patched": hasattr(api._invoke_rpc, "__rpc_observe_original__"),
        "no_site": bool(sys.flags.no_site),
        "env_RPC_OBSERVE": os.environ.get("RPC_OBSERVE"),
        "opentelemetry_sdk_imported": "opentelemetry.sdk.trace" in sys.modules,
    }
    if state["rpc_observe_imported"]:
        state["rpc_observe_dir"] = os.path.dirname(os.path.dirname(sys.modules["rpc_observe"].__file__))
        state["runtime_module"], rt = rpc_observe_module("runtime")
        cur = getattr(rt, "current", None)
        state["runtime"] = None if cur is None else {
            "metrics": cur.metrics is not None,
            "tracer": cur.tracer is not None,
            "profiler_events": cur.profiler is not None,
            "spans_path": cur.spans_path,
        }
    return state


def check_config() -> None:
    """Fails loudly if this process is not in the state its config promises."""
    api = sys.modules["torch.distributed.rpc.api"]
    patched = hasattr(api._invoke_rpc, "__rpc_observe_original__")
    if CONFIG in NO_SITE_CONFIGS:
        assert sys.flags.no_site, f"config {CONFIG} must run with python -S"
        assert "rpc_observe" not in sys.modules, f"config {CONFIG}: rpc_observe was imported"
        assert not patched, f"config {CONFIG}: torch RPC is patched"
        assert (CONFIG == "h") == ("opentelemetry.sdk.trace" in sys.modules), f"config {CONFIG}: OpenTelemetry SDK"
    elif CONFIG == "b":
        assert not patched, "config b: torch RPC is patched although RPC_OBSERVE is unset"
        assert "rpc_observe" not in sys.modules, "config b: rpc_observe was imported"
    else:
        assert patched, f"config {CONFIG}: torch RPC is not patched"


class Profiled:
    """Configs e and ap: a torch.profiler (Kineto, CPU) session around each measurement; config l:
    torch's legacy profiler (which enables torch's RPC profiling) instead.

    A new session per measurement keeps the profiler's memory bounded; stopping it
    (which parses the events) happens after the timed part. Both profilers record the thread
    they were started on (the caller's main thread), not the throughput loop's threads.
    """

    def __init__(self) -> None:
        self.prof: Any = None
        self.events: dict[str, int] | None = None

    def __enter__(self) -> Profiled:
        if CONFIG.removesuffix("_t") in ("e", "e0", "ap"):  # e_t, e0_t: --profile's self-timed (e)
            from torch.profiler import ProfilerActivity, profile

            self.prof = profile(activities=[ProfilerActivity.CPU])
            self.prof.__enter__()
        elif CONFIG == "l":
            from torch.autograd import profiler_legacy

            self.prof = profiler_legacy.profile()
            self.prof.__enter__()
        return self

    def stop(self) -> None:
        if self.prof is not None:
            self.prof.__exit__(None, None, None)
            prof, self.prof = self.prof, None
            names: dict[str, int] = {}
            for e in (prof.function_events if CONFIG == "l" else prof.events()):
                if e.name.startswith("rpc_"):
                    names[e.name] = names.get(e.name, 0) + 1
            self.events = names

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- CPU windows: every process's CPU, and its threads' -----------------------------------------
class CpuWindow:
    """CPU of the processes `pids` between `start()` and `end()` (bench.procstat.window: the sum of
    every thread's run time, or utime+stime when a thread ended in between), and of each thread.
    This thread is read last at the start and first at the end, so its own reading work stays
    outside the window; `snap_ms` is how long each reading took."""

    def __init__(self, pids: list[int] | None) -> None:
        self.pids = pids or []
        self.own = str(threading.get_native_id())
        self.snap0: list[dict[str, Any]] = []
        self.result: dict[str, Any] = {}
        self.snap_ms: list[float] = []

    def start(self) -> None:
        s = _perf()
        self.snap0 = snapshot(self.pids, last=self.own)
        self.snap_ms.append((_perf() - s) * 1e3)

    def end(self) -> dict[str, Any]:
        s = _perf()
        snap1 = snapshot(self.pids, first=self.own)
        self.snap_ms.append((_perf() - s) * 1e3)
        if self.pids:
            win = window(self.snap0, snap1)
            self.result = {"cpu_us": [w["us"] for w in win], "cpu_stat_us": [w["stat_us"] for w in win],
                           "cpu_exact": [w["exact"] for w in win], "snap_ms": self.snap_ms}
            self.result["thread_cpu"] = [w["threads"] for w in win]  # per process: {tid: [comm, us]}
        return self.result


# -- measurements (caller) ---------------------------------------------------------------
def _timed_echoes(t: torch.Tensor, n: int, warmup: int,
                  pids: list[int] | None = None) -> tuple[list[float], Any, dict[str, int] | None, dict[str, Any]]:
    """Latencies (us) of `n` rpc_sync echoes of `t` after `warmup`, the last reply, profiler events and the
    CPU window of the timed calls."""
    call = ECHO_SYNC
    for _ in range(warmup):
        call((t,))
    lat = [0] * n
    window = CpuWindow(pids)
    with Profiled() as p:
        window.start()
        for i in range(n):
            s = _ns()
            out = call((t,))
            lat[i] = _ns() - s
        window.end()
        p.stop()
    return [round(x / 1e3, 1) for x in lat], out, p.events, window.result


def cmd_noop(n: int, warmup: int, raw: bool = False, pids: list[int] | None = None, **_: Any) -> dict[str, Any]:
    lat_us, _, events, cpu = _timed_echoes(torch.ones(4), n, warmup, pids)
    out = {"p50_us": quantile(lat_us, 0.5), "p99_us": quantile(lat_us, 0.99), "mean_us": statistics.fmean(lat_us),
           "n": n, "profiler_rpc_events": events, **cpu}
    if raw:
        out["lat_us"] = lat_us
    return out


def cmd_big(n: int, warmup: int, numel: int = 1 << 20, raw: bool = False, **_: Any) -> dict[str, Any]:
    lat_us, out, _, _ = _timed_echoes(torch.ones(numel), n, warmup)
    assert out.numel() == numel
    res = {"p50_us": quantile(lat_us, 0.5), "p90_us": quantile(lat_us, 0.9), "n": n, "bytes_each_way": numel * 4}
    if raw:
        res["lat_us"] = lat_us
    return res


def cmd_thr(threads: int, seconds: float, warmup_s: float = 0.2, inflight: int = 1, pids: list[int] | None = None,
            **_: Any) -> dict[str, Any]:
    """`threads` threads, each keeping `inflight` rpc_async calls in flight (1: call, wait, repeat).

    Every thread counts all its calls; the window's calls are the difference of the counts read
    right after each CPU reading (so calls and CPU cover the same span, within the reading's time)."""
    t = torch.ones(4)
    stop = threading.Event()
    counts = [0] * threads
    start_barrier = threading.Barrier(threads + 1)
    call = ECHO_ASYNC

    def loop(k: int) -> None:
        start_barrier.wait()
        if inflight == 1:
            while not stop.is_set():
                call((t,))
                counts[k] += 1
        else:
            window = collections.deque(rpc.rpc_async(PEER, echo, args=(t,)) for _ in range(inflight))
            while not stop.is_set():
                window.popleft().wait()
                counts[k] += 1
                window.append(rpc.rpc_async(PEER, echo, args=(t,)))
            for f in window:
                f.wait()

    pool = [threading.Thread(target=loop, args=(k,), name=f"bench-thr-{k}", daemon=True) for k in range(threads)]
    for th in pool:
        th.start()
    cpu = CpuWindow(pids)
    with Profiled() as p:
        start_barrier.wait()
        time.sleep(warmup_s)
        cpu.start()
        n0, s = sum(counts), time.perf_counter()
        time.sleep(seconds)
        cpu.end()
        n1, elapsed = sum(counts), time.perf_counter() - s
        stop.set()
        for th in pool:
            th.join()
        p.stop()
    total = n1 - n0
    return {"calls_per_s": total / elapsed, "calls": total, "seconds": elapsed, "threads": threads,
            "inflight": inflight, "calls_total": sum(counts), **cpu.result}


# -- saturation (BENCH_WORLD=5): clients run threads until told to stop; the server counts -----
_SAT: dict[str, Any] = {}


def cmd_sat_start(threads: int, **_: Any) -> dict[str, Any]:
    """Client: `threads` threads of `rpc_async(worker1, sat_noop).wait()`, until `sat_stop`."""
    t = torch.ones(4)
    stop = threading.Event()
    counts = [0] * threads
    errors: list[str] = []
    call = SAT_ASYNC

    def loop(k: int) -> None:
        try:
            while not stop.is_set():
                call((t,))
                counts[k] += 1
        except Exception as e:  # noqa: BLE001
            errors.append(f"{type(e).__name__}: {e}")

    pool = [threading.Thread(target=loop, args=(k,), name=f"bench-sat-{k}", daemon=True) for k in range(threads)]
    for th in pool:
        th.start()
    _SAT.update(stop=stop, counts=counts, pool=pool, errors=errors, started=time.perf_counter())
    return {"threads": threads}


def cmd_sat_stop(**_: Any) -> dict[str, Any]:
    _SAT["stop"].set()
    _ENDED_THREADS.update({str(th.native_id): th.name for th in _SAT["pool"] if th.native_id is not None})
    for th in _SAT["pool"]:
        th.join()
    return {"calls": sum(_SAT["counts"]), "seconds": time.perf_counter() - _SAT["started"],
            "errors": _SAT["errors"][:3]}


def cmd_served(**_: Any) -> dict[str, Any]:
    """Server: the number of sat_noop calls so far (each read takes one) and the time."""
    return {"count": next(_SERVED), "t": time.perf_counter()}


_ENDED_THREADS: dict[str, str] = {}  # {native id: name} of the saturation threads, which end before names are read


def cmd_threads(**_: Any) -> dict[str, str]:
    """This process's Python threads {native id: name}, to group the per-thread CPU by name."""
    return {**_ENDED_THREADS, **python_thread_names()}

def cmd_ser(n: int, warmup: int, **_: Any) -> dict[str, Any]:
    """rpc_sync time for payloads of many small tensors vs one big tensor (echoed back)."""
    cases = {
        "1x16B": [torch.ones(4)],
        "8x16B": [torch.ones(4) for _ in range(8)],
        "64x16B": [torch.ones(4) for _ in range(64)],
        "1x4KB": [torch.ones(1024)],
        "1x4MB": [torch.ones(1 << 20)],
    }
    out = {}
    for name, tensors in cases.items():
        count = n if "MB" not in name else max(10, n // 20)
        for _ in range(warmup if "MB" not in name else max(3, warmup // 20)):
            rpc.rpc_sync(PEER, echo, args=tuple(tensors))
        lat = []
        for _ in range(count):
            s = _ns()
            rpc.rpc_sync(PEER, echo, args=tuple(tensors))
            lat.append((_ns() - s) / 1e3)
        out[name] = {"p50_us": quantile(lat, 0.5), "mean_us": statistics.fmean(lat), "n": count}
    return out


def cmd_pickler(n: int, **_: Any) -> dict[str, Any]:
    """In-process cost of the pickler alone: torch's serialize+deserialize vs the wrapped one.

    Only meaningful in an instrumented worker (c/d/e); in a/b both columns are torch's.
    """
    from torch.distributed.rpc import internal

    cls = internal._InternalRPCPickler
    pickler = internal._internal_rpc_pickler
    wrapped_ser, wrapped_de = cls.serialize, cls.deserialize
    orig_ser = getattr(wrapped_ser, "__rpc_observe_original__", wrapped_ser)
    orig_de = getattr(wrapped_de, "__rpc_observe_original__", wrapped_de)
    cases = {
        "1x16B": (torch.ones(4),),
        "8x16B": tuple(torch.ones(4) for _ in range(8)),
        "64x16B": tuple(torch.ones(4) for _ in range(64)),
        "1x4KB": (torch.ones(1024),),
        "1x4MB": (torch.ones(1 << 20),),
    }
    result = {}
    for name, tensors in cases.items():
        udf = internal.PythonUDF(echo, tensors, {})
        row = {}
        for label, ser, de in (("torch", orig_ser, orig_de), ("wrapped", wrapped_ser, wrapped_de)):
            best = []
            for _rep in range(5):
                s = _ns()
                for _ in range(n):
                    data, table = ser(pickler, udf)
                    de(pickler, data, table)
                best.append((_ns() - s) / n / 1e3)
            row[label + "_us"] = min(best)
        row["added_us"] = row["wrapped_us"] - row["torch_us"]
        result[name] = row
    return result


def cmd_memory(calls: int, sample_every: int, **_: Any) -> dict[str, Any]:
    """`calls` no-op RPCs; this process's and the callee's RSS every `sample_every` calls."""
    t = torch.ones(4)
    samples = [{"calls": 0, "caller": status(), "callee": rpc.rpc_sync(PEER, rss)}]
    s = time.perf_counter()
    for i in range(1, calls + 1):
        rpc.rpc_sync(PEER, echo, args=(t,))
        if i % sample_every == 0:
            samples.append({"calls": i, "caller": status(), "callee": rpc.rpc_sync(PEER, rss)})
    return {"samples": samples, "seconds": time.perf_counter() - s}


def cmd_loop(seconds: float, **_: Any) -> dict[str, Any]:
    """No-op RPCs for `seconds` (for an outside sampler such as py-spy)."""
    t = torch.ones(4)
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        rpc.rpc_sync(PEER, echo, args=(t,))
        n += 1
    return {"calls": n}


_SELF_NS: dict[str, list[int]] = {}  # "<wrapper>@<main|pool>" -> per-call self time, ns

# The torch functions whose rpc_observe wrappers the self-timer times, and the rpc_observe
# function that makes each wrapper (for reference: the wrappers are found on torch's side,
# by the `__rpc_observe_original__` that rpc_observe sets, not by rpc_observe's module names).
SELF_TIMED = (
    ("api", "_invoke_rpc"),  # rpc_observe.hooks.client.wrap_invoke_rpc (was rpc_observe._client)
    ("_InternalRPCPickler", "serialize"),  # rpc_observe.hooks.pickler.wrap_serialize (was rpc_observe._pickler)
    ("_InternalRPCPickler", "deserialize"),  # rpc_observe.hooks.pickler.wrap_deserialize
    ("internal", "_run_function"),  # rpc_observe.hooks.server.wrap_run_function (was rpc_observe._server)
)


def install_self_timer() -> None:
    """Diagnostics (BENCH_SELF_TIME=1, before init_rpc): times each rpc_observe wrapper's own
    work per call, in situ: the wrapper's total time minus the time inside torch's original
    it calls (found in the wrapper's closure and replaced by a timed version)."""
    import threading

    from torch.distributed.rpc import api, internal

    owners = {"api": api, "internal": internal, "_InternalRPCPickler": internal._InternalRPCPickler}
    main = threading.main_thread().ident
    inner: dict[tuple[int, str], int] = {}
    for owner_name, name in SELF_TIMED:
        owner = owners[owner_name]
        wrapper = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        original = getattr(wrapper, "__rpc_observe_original__", None)
        if original is None:
            raise RuntimeError(f"BENCH_SELF_TIME: {owner_name}.{name} is not wrapped by rpc_observe")
        native = type(wrapper).__name__ == "Hook"  # the C core's wrapper: a new one around the timed original
        cell = None if native else next((c for c in wrapper.__closure__ or () if c.cell_contents is original), None)
        if cell is None and not native:
            raise RuntimeError(f"BENCH_SELF_TIME: rpc_observe's wrapper of {owner_name}.{name} does not hold "
                               "torch's original in its closure; the self-timer cannot time it")

        def timed_original(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            start = _ns()
            try:
                return _original(*args, **kwargs)
            finally:
                key = (threading.get_ident(), _name)
                inner[key] = inner.get(key, 0) + _ns() - start

        if cell is not None:
            cell.cell_contents = timed_original
        else:
            wrapper = type(wrapper)(timed_original, wrapper.kind)

        def timed_wrapper(*args: Any, _wrapper: Any = wrapper, _name: str = name, **kwargs: Any) -> Any:
            ident = threading.get_ident()
            before = inner.get((ident, _name), 0)
            start = _ns()
            try:
                return _wrapper(*args, **kwargs)
            finally:
                total = _ns() - start
                key = f"{_name}@{'main' if ident == main else 'pool'}"
                _SELF_NS.setdefault(key, []).append(total - (inner.get((ident, _name), 0) - before))

        timed_wrapper.__rpc_observe_original__ = original
        setattr(owner, name, timed_wrapper)
    _time_the_sync_wait(inner)


def _time_the_sync_wait(inner: dict[tuple[int, str], int]) -> None:
    """Counts as torch's the wait for an rpc_sync's response that `_invoke_rpc`'s wrapper does when a profiler
    event is open (rpc_sync's own next step; since 45ae099): its profiler end, timed here, waits first."""
    try:
        from rpc_observe.hooks import profiler_events as events
    except ImportError:  # rpc_observe not installed: nothing to time
        return
    end_on = events.ProfilerEvents.client_end_on

    def timed_end_on(rf: Any, future: Any, site: Any = None) -> Any:
        if site is None:  # an older rpc_observe (--baseline): torch's future ends the event, no wait here
            return end_on(rf, future)
        if site.mode == "sync":
            start = _ns()
            try:
                future.wait()
            except Exception:  # noqa: BLE001 - the call's outcome: end_on sees it
                pass
            key = (threading.get_ident(), "_invoke_rpc")
            inner[key] = inner.get(key, 0) + _ns() - start
        return end_on(rf, future, site)

    events.ProfilerEvents.client_end_on = staticmethod(timed_end_on)


def self_time_report() -> dict[str, dict[str, float]]:
    """Median and mean self time (us) per wrapper since the last report; resets."""
    out = {k: {"calls": len(v), "median_us": statistics.median(v) / 1e3, "mean_us": statistics.mean(v) / 1e3}
           for k, v in _SELF_NS.items() if len(v) >= 100}
    _SELF_NS.clear()
    return out


def cmd_selftime(n: int = 3000, **_: Any) -> dict[str, Any]:
    """`n` no-op RPCs; each process's rpc_observe self time per wrapper (needs BENCH_SELF_TIME=1)."""
    t = torch.ones(4)
    self_time_report()
    rpc.rpc_sync(PEER, self_time_report)
    with Profiled():  # (e): under the caller's torch.profiler session
        for _ in range(n):
            rpc.rpc_sync(PEER, echo, args=(t,))
        caller = self_time_report()
    return {"caller": caller, "callee": rpc.rpc_sync(PEER, self_time_report)}


COMMANDS = {
    "noop": cmd_noop, "big": cmd_big, "thr": cmd_thr, "ser": cmd_ser, "pickler": cmd_pickler,
    "memory": cmd_memory, "loop": cmd_loop, "selftime": cmd_selftime,
    "sat_start": cmd_sat_start, "sat_stop": cmd_sat_stop, "served": cmd_served, "threads": cmd_threads,
}


def reply(obj: Any) -> None:
    _ctl.write(json.dumps(obj) + "\n")


def main() -> None:
    cpus = os.environ.get("BENCH_CPUS")
    if cpus:  # e.g. "0" for the caller and "1" for the callee
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    kwargs = {}
    transport = os.environ.get("BENCH_TRANSPORT", "default")
    if transport != "default":  # "uv": TCP over 127.0.0.1 only; "shm": shared memory only
        kwargs["_transports"] = [transport]
    channels = os.environ.get("BENCH_CHANNELS", "default")
    if channels != "default":  # "basic": tensors inline over the transport (no cma / mpt)
        kwargs["_channels"] = channels.split(",")
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{INIT_FILE}", num_worker_threads=16,
                                              rpc_timeout=120, **kwargs)
    if os.environ.get("BENCH_SELF_TIME"):
        install_self_timer()
    if CONFIG == "h":
        h_setup()
    make_callers()
    rpc.init_rpc(f"worker{RANK}", rank=RANK, world_size=WORLD, rpc_backend_options=options)
    check_config()
    reply({"ready": True, "pid": os.getpid(), "config": CONFIG, "rank": RANK, "state": instrumentation_state(),
           "status": status()})
    for line in sys.stdin:
        msg = json.loads(line)
        cmd = msg.pop("cmd")
        if cmd == "shutdown":
            rpc.shutdown()
            out: dict[str, Any] = {"ok": True, "status": status()}
            if "provider" in _H:  # (h): export what is queued
                _H["provider"].shutdown()
                out["h_spans_exported"] = _H["exporter"].spans
            reply(out)
            break
        if cmd == "status":
            reply({"ok": True, "status": status(), "state": instrumentation_state()})
            continue
        if cmd == "gc":
            gc.collect()
            reply({"ok": True})
            continue
        try:
            reply({"ok": True, "result": COMMANDS[cmd](**msg)})
        except Exception as e:  # report, keep serving
            import traceback

            traceback.print_exc()
            reply({"ok": False, "error": f"{type(e).__name__}: {e}"})
    _ctl.close()


if __name__ == "__main__":
    main()
