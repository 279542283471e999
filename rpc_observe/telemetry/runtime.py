"""The telemetry of one worker process: started by the wrapped `init_rpc`, before torch's.

torch's own init_rpc already makes RPCs, and peers may call this worker before its
init_rpc returns, so everything here is ready before the original init_rpc runs.
Until then `current` is None and every wrapper goes straight to torch's original.
This package never imports torch: the hooks attach what needs it (profiler events,
torch's debug state, the call sweep) through `start(..., setup=...)` and
`add_housekeeping`.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ..config import RPC_OBSERVE_DIR, Config
from . import exposition, health, signals

if TYPE_CHECKING:  # imported when started, if at all: prometheus_client and OpenTelemetry cost import time
    from wsgiref.simple_server import WSGIServer

    from .metrics import MessageCells, Metrics
    from .otlp_metrics import OtlpMetricsPusher
    from .recorder import FlightRecorder
    from .state import StateGauges
    from .tracing import SpanRecord, Tracer

_logger = logging.getLogger("rpc_observe")
current: Runtime | None = None
_start_lock = threading.Lock()
HOUSEKEEPING_PERIOD_S = 0.1
_DRAIN_SLICE = 256


class Profiler(Protocol):
    """What the hooks attach as `Runtime.profiler` (hooks.profiler_events.ProfilerEvents), which imports
    torch: this package does not. `rf` is the torch `record_function` a Kineto-profiled thread's call holds."""

    armed: bool  # a torch profiler has started in this process

    def client_start(self, key: str) -> Any: ...

    def client_end_on(self, rf: Any, future: Any, site: Any) -> Any: ...

    def client_end(self, rf: Any) -> None: ...

    def record(self, key: str, kind: str, start_ns: int, end_ns: int, tid: int, span: SpanRecord | None) -> None: ...


class ProfileSession(Protocol):
    """RPC_OBSERVE_PROFILE's session (hooks.profiler_events.ProfileSession), attached by the hooks."""

    def finish(self) -> None: ...


class Runtime:
    """Metrics, tracer and profiler events of this process, labelled with its worker name."""

    # Slots: the C hot paths read a runtime's attributes at their offsets (hooks/_core.c, get_attr).
    __slots__ = ("config", "worker", "rank", "world_size", "run_id", "metrics", "state", "tracer", "profiler",
                 "profile_session", "recorder", "otlp_metrics", "metrics_port", "target_path", "spans_path", "_server",
                 "client_sites", "server_sites", "request_cells", "_housekeeping", "_closing", "_closed", "_close_lock",
                 "out_dir", "_stopped", "_thread")

    def __init__(self, config: Config, worker: str, rank: int | None, world_size: int | None = None) -> None:
        self.config = config
        self.worker = worker
        self.rank = rank
        self.world_size = world_size
        self.run_id = config.run_id
        self.metrics: Metrics | None = None  # when RPC_OBSERVE_METRICS is on
        self.state: StateGauges | None = None  # with metrics
        self.tracer: Tracer | None = None  # when a traces exporter is set
        self.profiler: Profiler | None = None  # attached by the hooks
        self.profile_session: ProfileSession | None = None  # attached by the hooks
        self.recorder: FlightRecorder | None = None  # attached by the hooks
        self.otlp_metrics: OtlpMetricsPusher | None = None  # with OTEL_METRICS_EXPORTER=otlp
        self.metrics_port: int | None = None
        self.target_path: str | None = None
        self.spans_path: str | None = None
        self._server: WSGIServer | None = None
        # Per call site caches of the hooks (names, attributes, metric cells), keyed by what they see.
        # Keys are functions (any hashable the caller passes); the sites are the hooks' (hooks.client.ClientSite,
        # hooks.server.ServerSite), which this package cannot name.
        self.client_sites: dict[Any, Any] = {}
        self.server_sites: dict[Any, Any] = {}
        self.request_cells: dict[Any, MessageCells] = {}  # cells of incoming requests by function, of unknown messages
        self._housekeeping: list[Callable[[], None]] = []
        self._closing: list[Callable[[], None]] = []
        self._closed = False
        self._close_lock = threading.RLock()
        self.out_dir = self._make_out_dir()
        if config.metrics:
            self._start_metrics(rank, self.out_dir)
        if config.tracing:
            self._start_tracing(self.out_dir)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._housekeeping_loop, name="rpc_observe-housekeeping", daemon=True)

    def add_housekeeping(self, hook: Callable[[], None]) -> None:
        """Runs `hook` first in every housekeeping pass (every 0.1 s, and before each scrape and flush)."""
        self._housekeeping.append(hook)

    def run_hooks(self) -> None:
        for hook in self._housekeeping:
            hook()

    def add_closing(self, hook: Callable[[], None]) -> None:
        """Runs `hook` when RPC stops (rpc.shutdown(), exit, SIGTERM): the hooks end what is in flight."""
        self._closing.append(hook)

    def forget_torch(self) -> None:
        """From now on a scrape reads nothing of torch's state (torch is shutting down or exiting)."""
        if self.metrics is not None:
            self.metrics.agent_info = None
        if self.state is not None:
            self.state.source = None
        if self.recorder is not None:
            self.recorder.read_torch = False

    def stopping(self) -> None:
        """RPC is stopping: read nothing of torch's state from now on, and end the calls in flight."""
        self.forget_torch()
        for hook in self._closing:
            try:
                hook()
            except Exception:
                health.internal_error("closing")

    def housekeeping(self) -> None:
        """Runs the hooks (the hooks' call sweep), then folds queued metric records.

        In slices of 256 records: the GIL is free for the RPC threads between them.
        """
        self.run_hooks()
        while self.metrics is not None and self.metrics.drain(_DRAIN_SLICE):
            time.sleep(0)

    def _housekeeping_loop(self) -> None:
        while not self._stopped.wait(HOUSEKEEPING_PERIOD_S):
            try:
                self.housekeeping()
                if self.recorder is not None:  # here only: a scrape never writes a dump
                    self.recorder.check()
            except Exception:
                health.internal_error("housekeeping")

    def debug_json(self) -> bytes | None:
        """`GET /debug/rpc`: the flight recorder's snapshot, or None before the hooks attached it."""
        recorder = self.recorder
        return recorder.json_bytes() if recorder is not None else None

    def _make_out_dir(self) -> str | None:
        out_dir = self.config.out_dir
        try:
            for sub in ("spans", "targets"):
                os.makedirs(os.path.join(out_dir, sub), exist_ok=True)
            probe = os.path.join(out_dir, "spans", f".probe-{os.getpid()}")
            open(probe, "w").close()
            os.remove(probe)
            return out_dir
        except OSError as e:
            _logger.warning(
                "rpc_observe: %s=%r is not writable (%s): accepted a directory this process can "
                "create and write; span files and file_sd targets are off, metrics and OTLP export "
                "go on",
                RPC_OBSERVE_DIR,
                out_dir,
                e.strerror or e,
            )
            return None

    def _start_metrics(self, rank: int | None, out_dir: str | None) -> None:
        from prometheus_client import CollectorRegistry

        from .metrics import Metrics
        from .state import StateGauges

        self.metrics = Metrics(self.worker, self.config.max_methods, None, self.run_hooks,
                               max_peers=self.config.max_peers,
                               peer_histograms=self.config.peer_labels == "histograms")
        self.state = StateGauges(self.worker)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self.metrics)
        registry.register(self.state)
        if "otlp" in self.config.metrics_exporters:
            from .otlp_metrics import OtlpMetricsPusher

            self.otlp_metrics = OtlpMetricsPusher(self.config, registry.collect, self.resource_attributes())
        try:
            self._server, self.metrics_port = exposition.serve(registry, self.config, rank, self.debug_json)
        except Exception as e:
            _logger.warning(
                "rpc_observe: cannot serve metrics on %s (%s); metrics are still counted", self.config.metrics_addr, e
            )
            return
        if out_dir is not None:
            self.target_path = exposition.write_target(
                os.path.join(out_dir, "targets"), self.worker, self.config.metrics_addr, self.metrics_port, self.run_id,
                self.config.metrics_advertise_addr,
            )

    def resource_attributes(self) -> dict[str, Any]:
        """This worker's OpenTelemetry resource (OTEL_RESOURCE_ATTRIBUTES included), for spans and OTLP metrics."""
        from opentelemetry.sdk.resources import Resource

        return dict(Resource.create({
            "service.name": self.config.service_name or self.worker,
            "torch.rpc.worker": self.worker,
            "process.pid": os.getpid(),
            "rpc_observe.run_id": self.run_id,
        }).attributes)

    def _start_tracing(self, out_dir: str | None) -> None:
        from . import exporters, tracing

        spans_dir = os.path.join(out_dir, "spans") if out_dir is not None else None
        sinks = exporters.build_sinks(self.config, self.resource_attributes(), spans_dir, self.worker)
        self.spans_path = next((s.path for s in sinks if hasattr(s, "path")), None)
        self.tracer = tracing.Tracer(self.config, sinks)

    def flush(self) -> None:
        """Ends what completed, and exports queued spans (bounded by OTEL_BSP_EXPORT_TIMEOUT)."""
        self.housekeeping()
        if self.tracer is not None:
            self.tracer.flush()

    def finish_profile(self) -> None:
        if self.profile_session is not None:
            self.profile_session.finish()

    def close(self) -> None:
        """Ends what is in flight, writes the spans (bounded), closes the endpoint, removes the target file."""
        # A signal watcher, the main thread's signal handler and atexit may all close: the
        # second waits until the first is done (the process may end right after it returns).
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            _forget(self)  # calls that start from now on go unobserved, rather than half recorded
            if self.target_path is not None:  # first: Prometheus stops scraping a dead endpoint
                try:
                    os.remove(self.target_path)
                except OSError:
                    pass
            self.stopping()
            self.housekeeping()
            self._stopped.set()
            self.finish_profile()
            if self.otlp_metrics is not None:
                self.otlp_metrics.shutdown()
            if self.tracer is not None:
                self.tracer.shutdown()
            if self._server is not None:
                self._server.shutdown()
                self._server.server_close()


def start(
    config: Config,
    worker: str,
    rank: int | None,
    world_size: int | None = None,
    setup: Callable[[Runtime], None] | None = None,
) -> Runtime | None:
    """Starts this process's telemetry once; later calls return the running one.

    `setup(runtime)` runs before the runtime becomes `current`, so that no RPC sees it half built.
    """
    global current
    with _start_lock:
        if current is not None:
            return current
        try:
            runtime = Runtime(config, worker, rank, world_size)
            if setup is not None:
                setup(runtime)
            runtime._thread.start()
        except Exception:
            health.internal_error("start")
            return None
        current = runtime
        atexit.register(_close_at_exit, runtime)  # after torch's own: runs before torch tears down
        if config.signals:
            signals.install(runtime.close)
        return runtime


def _forget(runtime: Runtime) -> None:
    global current
    with _start_lock:
        if current is runtime:
            current = None


def _close_at_exit(runtime: Runtime) -> None:
    try:
        runtime.close()
    except Exception:
        pass


def stop() -> None:
    """Stops the telemetry (uninstrument): flushes spans, closes the endpoint."""
    global current
    with _start_lock:
        runtime, current = current, None
    signals.uninstall()
    if runtime is not None:
        try:
            runtime.close()
        except Exception:
            health.internal_error("stop")
