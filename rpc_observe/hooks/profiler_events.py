"""Each RPC's profiling key as a torch profiler event, under torch.profiler (Kineto) too.

Two paths, because Kineto only records the threads it was started on:
- on a thread the profiler records (the caller's training loop), a real
  `record_function` with torch's key (a user annotation), ended when the RPC's future
  completes, so it is in `prof.events()`, `key_averages()` and the exported trace, like
  torch's own events;
- on the RPC agent's pool threads (server-side UDFs, nested calls), which a plain
  `torch.profiler.profile()` never sees, the event is kept in a bounded in-memory ring
  while a profiler has been started in this process, and added to the Chrome trace
  when the profiler exports it (`export_chrome_trace`, `tensorboard_trace_handler`).
  Nothing else in the trace changes; no profiler option is switched on behind the
  user's back.
Under the legacy autograd profiler torch records the client key itself: never twice.
With no profiler on, the cost is one thread-local check (~0.1 us).
"""

from __future__ import annotations

import collections
import json
import os
import threading
from typing import Any

import torch

from .. import _patching
from ..telemetry import health

_profiler_enabled = torch.autograd._profiler_enabled
_LEGACY = torch._C._profiler.ActiveProfilerType.LEGACY
_profiler_type = torch._C._autograd._profiler_type
CATEGORY = "rpc_observe"
# An event begun and ended by the calls torch's own profiler uses for user annotations (`_record_function_with_args_
# enter`/`_exit`: one pybind call each, the record_function's scope, ~1 us), not `record_function`'s ops (~8 us each:
# a Python object per event, each op looked up through torch.ops and dispatched). Kineto ends an event only on a
# thread that holds the profiler's state, as the one that began it does; an event that another thread ends is
# ended by torch's `_call_end_callbacks_on_jit_fut` (the one op kept: ~20 us, a copy of the thread's state and a
# future), called under DisableTorchFunctionSubclass as `record_function` calls it (torch's issue 76410).
_enter = torch.autograd._record_function_with_args_enter
_exit = torch.autograd._record_function_with_args_exit
_end_on = torch.ops.profiler._call_end_callbacks_on_jit_fut._RecordFunction._op
_no_torch_function = torch._C.DisableTorchFunctionSubclass
_SYNC = "sync"  # a site's mode when rpc_sync made the call


class ProfilerEvents:
    """Profiler events of one process."""

    __slots__ = ("worker", "run_id", "armed", "_ring")  # `armed` is read by the C core on every call, at its offset

    def __init__(self, worker: str, run_id: str, capacity: int = 50_000) -> None:
        self.worker = worker
        self.run_id = run_id
        self.armed = False  # set once any torch profiler has started in this process
        self._ring: collections.deque = collections.deque(maxlen=capacity)

    def client_start(self, key: str) -> Any:
        """A record_function event for `key` (torch's handle), begun, if the profiler that is on (the caller
        checked `_profiler_enabled()`) is Kineto's, else None."""
        if _profiler_type() == _LEGACY:
            return None
        return _enter(key)

    @staticmethod
    def client_end_on(rf: Any, future: Any, site: Any) -> Any:
        """The future the caller gets once the event is ended as `future` completes.

        For rpc_sync (its `_invoke_rpc` returns to a wait on this thread, nothing between), this thread waits
        and ends the event: `future` itself, completed. Otherwise torch's own async profiling: a future that
        completes as `future` does, once a pool thread has ended the event."""
        if site.mode != _SYNC:
            with _no_torch_function():
                return _end_on(rf, future)
        try:
            future.wait()  # its error, if any, is raised to the caller by rpc_sync's own wait
        except Exception:  # noqa: BLE001 - the RPC's outcome, not ours
            pass
        finally:
            _exit(rf)
        return future

    @staticmethod
    def client_end(rf: Any) -> None:
        """Ends the event on the thread that began it."""
        _exit(rf)

    def record(self, key: str, kind: str, start_ns: int, end_ns: int, tid: int, span: Any) -> None:
        """Keeps an event of a thread the profiler does not see (only while armed)."""
        ids = (f"{span.trace_id:032x}", f"{span.span_id:016x}") if span is not None else ("", "")
        self._ring.append((key, kind, start_ns, end_ns, tid) + ids)

    def inject(self, path: str) -> None:
        """Adds the kept events that fall in the trace's time window to a Chrome trace file."""
        with open(path, encoding="utf-8") as f:
            trace = json.load(f)
        events = trace.get("traceEvents", [])
        base_ns = trace.get("baseTimeNanoseconds", 0)
        spans = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("ph") == "X" and "ts" in e]
        pid = os.getpid()
        if spans:
            low = min(s for s, _ in spans) * 1000 + base_ns
            high = max(e for _, e in spans) * 1000 + base_ns
            tids = set()
            for key, kind, start, end, tid, trace_id, span_id in list(self._ring):
                if start >= low and end <= high:
                    tids.add(tid)
                    events.append({"ph": "X", "cat": CATEGORY, "name": key, "pid": pid, "tid": tid,
                                   "ts": (start - base_ns) / 1000.0, "dur": (end - start) / 1000.0,
                                   "args": {"kind": kind, "trace_id": trace_id, "span_id": span_id}})
            for tid in tids:
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                               "args": {"name": f"rpc_observe ({self.worker} RPC pool thread {tid})"}})
        trace["rpc_observe"] = {"worker": self.worker, "pid": pid, "run_id": self.run_id}
        with open(path, "w", encoding="utf-8") as f:
            json.dump(trace, f)

    def patch_profiler(self) -> None:
        """Arms the ring when a profiler starts, and fills exported traces from it."""
        events = self

        def _start_trace(original: Any) -> Any:
            def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
                events.armed = True
                return original(self, *args, **kwargs)
            return wrapper

        def _export_chrome_trace(original: Any) -> Any:
            def wrapper(self: Any, path: str, *args: Any, **kwargs: Any) -> Any:
                result = original(self, path, *args, **kwargs)
                try:
                    events.inject(path)
                except Exception:
                    health.internal_error("profiler_export")
                return result
            return wrapper

        profile = torch.autograd.profiler.profile
        _patching.patch(profile, "_start_trace", _start_trace)
        _patching.patch(profile, "export_chrome_trace", _export_chrome_trace)
        self.armed = self.armed or _profiler_enabled()


class ProfileSession:
    """RPC_OBSERVE_PROFILE=1: torch.profiler from init_rpc to shutdown, written per worker.

    It records every thread (torch's `profile_all_threads`), since UDFs run on the agent's
    pool threads; this is our own session, not the user's, so switching that on surprises
    nobody. Memory stays bounded: the session stops after RPC_OBSERVE_PROFILE_MAX_SECONDS
    (default 300 s) even if shutdown never comes, and writes what it has.
    """

    def __init__(self, path: str, worker: str, rank: int | None, world_size: int | None,
                 max_seconds: float) -> None:
        from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile

        self.path = path
        self._lock = threading.Lock()
        self._profile = profile(activities=[ProfilerActivity.CPU],
                                experimental_config=_ExperimentalConfig(profile_all_threads=True))
        self._profile.start()
        # HolisticTraceAnalysis reads the rank from here (needs `"rank": N` with a space).
        self._profile.add_metadata_json("distributedInfo", json.dumps(
            {"backend": "tensorpipe", "rank": rank if rank is not None else -1,
             "world_size": world_size if world_size is not None else -1, "worker": worker}))
        self._timer = threading.Timer(max_seconds, self.finish)
        self._timer.daemon = True
        self._timer.start()

    def finish(self) -> None:
        """Stops the profiler and writes the trace, once."""
        with self._lock:
            if self._profile is None:
                return
            profile, self._profile = self._profile, None  # type: ignore[assignment]
        self._timer.cancel()
        try:
            profile.stop()
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            profile.export_chrome_trace(self.path)
        except Exception:
            health.internal_error("profile_session")
