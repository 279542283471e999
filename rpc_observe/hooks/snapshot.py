"""The flight recorder's torch half: what `calls` and `server` keep, read into plain data.

Read on the endpoint's or the housekeeping thread, never on an RPC's: the tables are copied
(one C call each, under the GIL) and the calls' futures only asked `done()`. Stacks are
file, line and function of each frame: never locals, arguments or tensor contents.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
import traceback
from collections.abc import Iterable
from typing import Any

from ..config import DEFAULT_HANG_SECONDS
from . import calls, native, torch_state

MAX_FRAMES = 64  # the innermost frames of a stack
# Stacks only of threads whose call or UDF is this old: a stuck thread's, not every busy one's.
STACK_AFTER_S = 1.0


_native = native.load("_stacks")  # the C stack reader, where built
_AGENT_KEYS = (("pool_size", "agent.thread_pool_size"), ("idle_threads", "agent.num_idle_threads"),
               ("client_active_calls", "agent.client_active_calls"),
               ("server_active_calls", "agent.server_active_calls"),
               ("server_active_async_calls", "agent.server_active_async_calls"))


def _open_calls(first: bool = False) -> list[calls.Call]:
    """The calls in flight, oldest first (the table's order), or only the oldest: in the table and not
    completed (a completed call may wait there for the sweep)."""
    found = []
    for call in list(calls.in_flight.values()):
        if call.future is None or not call.future.done():
            found.append(call)
            if first:
                break
    return found


def _call_id(text: str) -> int | None:
    return int(text) if text.isdigit() else None


def _start(entry: tuple[int, calls.Served]) -> int:
    return entry[1][2]  # the UDFs a snapshot lists, oldest first


def _hex(number: int, width: int) -> str | None:
    return f"{number:0{width}x}" if number else None


def oldest() -> tuple[float, str]:
    """(age in s, what) of the oldest client call in flight or UDF running; (0.0, "") if none."""
    now = time.time_ns()
    best, what = now, ""
    for call in _open_calls(first=True):
        best, what = call.start_ns, f"the call {call.site.key} (call {call.id})"
    for site, call_id, start_ns, _ in list(calls.serving.values()):
        if start_ns < best:
            best, what = start_ns, f"the UDF {site.key} (the caller's call {call_id or '?'})"
    return (now - best) / 1e9, what


def ages() -> tuple[float, float]:
    """(age of the oldest call in flight, age of the oldest UDF running), in s; 0 when none."""
    now = time.time_ns()
    open_calls = _open_calls(first=True)
    call_age = (now - open_calls[0].start_ns) / 1e9 if open_calls else 0.0
    starts = [served[2] for served in list(calls.serving.values())]
    return call_age, (now - min(starts)) / 1e9 if starts else 0.0


def age_gauges(hang_seconds: float) -> list[tuple[str, float]]:
    """The watchdog's gauges, for the scrape: (metric name, value); the threshold is exported so that an
    alert compares each worker's ages with that worker's own RPC_OBSERVE_HANG_SECONDS."""
    call_age, udf_age = ages()
    return [("torch_rpc_client_oldest_call_age_seconds", call_age),
            ("torch_rpc_server_oldest_udf_age_seconds", udf_age),
            ("rpc_observe_hang_threshold_seconds", hang_seconds or DEFAULT_HANG_SECONDS)]


def _agent() -> dict[str, int] | None:
    try:
        info = torch_state.agent_debug_info()
    except Exception:  # no agent: before init_rpc, after shutdown
        return None
    return {name: int(info[key]) for name, key in _AGENT_KEYS if key in info}


def python_stacks(idents: Iterable[int], limit: int) -> dict[int, list[str]]:
    """What `_stacks.stacks` returns, in Python: its reference, and the fallback where it is not built.

    Bytecode runs here, so the GIL can pass to a walked thread halfway; `tables` asks only for threads
    that have waited STACK_AFTER_S (parked: their frames do not move). The collector is off, as in the
    C code: sys._current_frames() under CPython 3.11 can deadlock in a collection (gh-106883)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        frames = sys._current_frames()
        found = {}
        for ident in idents:
            if ident in frames:
                summary = traceback.StackSummary.extract(traceback.walk_stack(frames[ident]), limit=limit,
                                                         lookup_lines=False)
                found[ident] = [f"{f.filename}:{f.lineno} in {f.name}" for f in reversed(summary)]  # innermost last
        return found
    finally:
        if enabled:
            gc.enable()


def stacks(idents: Iterable[int]) -> dict[int, list[str]]:
    """The Python stacks of threads `idents` (those with a frame), innermost last, MAX_FRAMES at most."""
    wanted = list(idents)
    if not wanted:
        return {}
    if _native is not None:
        return _native.stacks(wanted, MAX_FRAMES)
    return python_stacks(wanted, MAX_FRAMES)


def tables(read_torch: bool = True) -> dict[str, Any]:
    """The hooks' part of a snapshot: agent, calls, serving, finished, stacks (docs/stuck.md); the agent is
    null when `read_torch` is False (RPC is stopping)."""
    now = time.time_ns()  # the tables' times are time.time_ns() too
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    open_calls = []
    for call in _open_calls():
        site, parent, span = call.site, call.parent, call.span
        open_calls.append({
            "call_id": call.id, "method": site.method, "peer": site.dst, "mode": site.mode,
            "age_s": (now - call.start_ns) / 1e9,
            "trace_id": _hex(span.trace_id, 32) if span is not None else None,
            "span_id": _hex(span.span_id, 16) if span is not None else None,
            "thread": call.thread, "thread_name": names.get(call.thread),
            "nested_in": None if parent is None else {
                "caller": parent[0].src, "call_id": _call_id(parent[1]), "method": parent[0].method},
        })
    served = []
    for thread, (udf_site, call_id, start_ns, trace_id) in sorted(calls.serving.items(), key=_start):
        served.append({"caller": udf_site.src, "call_id": _call_id(call_id), "method": udf_site.method,
                       "mode": udf_site.attributes.get("torch.rpc.exec_mode"), "age_s": (now - start_ns) / 1e9,
                       "thread": thread, "trace_id": _hex(trace_id, 32)})
    finished = [{"call_id": call_id, "method": site.method, "peer": site.dst, "mode": site.mode,
                 "duration_s": (end_ns - start_ns) / 1e9, "status": error or "ok",
                 "ended_unix_s": end_ns / 1e9}
                for site, call_id, start_ns, end_ns, error in list(calls.finished)]
    waiting = {entry["thread"] for entry in open_calls + served if entry["age_s"] >= STACK_AFTER_S}
    return {"agent": _agent() if read_torch else None, "calls": open_calls, "serving": served, "finished": finished,
            "stacks": {str(ident): lines for ident, lines in stacks(waiting).items()}}
