"""Profiler (Kineto) trace events re-homed onto the merged timeline: the
worker's process instead of the OS pid, the clock shift, flow ids unique
across traces, and (with ``--since``/``--until``) only the events in the
window."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from .model import TraceInput

# Kineto's per-process metadata, replaced by the worker's own.
PROCESS_META = ("process_name", "process_labels", "process_sort_index")
_FLOW_PHASES = ("s", "t", "f")


class Window:
    """A time window on a trace's own clock (us after its base); either end may be open."""

    def __init__(self, t: TraceInput, lo_ns: int | None, hi_ns: int | None) -> None:
        self.lo = None if lo_ns is None else (lo_ns - t.base_ns) / 1000.0
        self.hi = None if hi_ns is None else (hi_ns - t.base_ns) / 1000.0

    def outside(self, ev: dict[str, Any]) -> bool:
        """Whether an event lies wholly outside the window (metadata never does)."""
        ts = ev.get("ts")
        if ev.get("ph") == "M" or not isinstance(ts, (int, float)) or isinstance(ts, bool):
            return False
        dur = ev.get("dur") if ev.get("ph") == "X" else 0
        end = ts + dur if isinstance(dur, (int, float)) else ts
        return (self.lo is not None and end < self.lo) or (self.hi is not None and ts > self.hi)


def _flow_key(ev: dict[str, Any]) -> tuple:
    return ev.get("cat"), ev.get("name"), str(ev.get("id"))


def convert_trace(t: TraceInput, fi: int, shift: float, pid_main: int, sort_base: int,
                  extra_pids: dict[tuple[str, Any], int], flow_id: Callable[[tuple], int],
                  window: Window | None, cut: list[int]) -> Iterator[dict[str, Any]]:
    """Re-home one profiler trace's events: pids, clock shift, flow ids.

    The main process's events move to the worker's process; other pids (GPU
    streams, forked helpers) get processes numbered right after it.  Events
    outside ``window`` are counted in ``cut[0]``; a flow with an end outside
    is left out whole, so no arrow dangles."""
    w = t.worker
    events = t.data.get("traceEvents") or []
    t.data = {}  # let the loaded document go once converted
    cut_flows: set[tuple] = set()
    if window is not None:
        cut_flows = {_flow_key(ev) for ev in events if isinstance(ev, dict)
                     and ev.get("ph") in _FLOW_PHASES and "id" in ev and window.outside(ev)}
    for ev in events:
        if not isinstance(ev, dict):
            continue
        ph = ev.get("ph")
        if window is not None and (window.outside(ev) or (cut_flows and ph in _FLOW_PHASES
                                                          and _flow_key(ev) in cut_flows)):
            cut[0] += 1
            continue
        pid = ev.get("pid")
        is_main = type(pid) is not int or pid == t.main_pid
        if ph == "M" and ev.get("name") in PROCESS_META:
            if is_main:
                continue  # replaced by the worker's own metadata
            new = ev["pid"] = _extra_pid(extra_pids, w, pid, pid_main)
            args = ev.get("args")
            if not isinstance(args, dict):
                args = {}
            if ev["name"] == "process_name":
                ev["args"] = {"name": f"{w} {args.get('name', pid)}"}
            elif ev["name"] == "process_sort_index":
                ev["args"] = {"sort_index": sort_base + new - pid_main}
            yield ev
            continue
        ev["pid"] = pid_main if is_main else _extra_pid(extra_pids, w, pid, pid_main)
        ts = ev.get("ts")
        if isinstance(ts, (int, float)) and not isinstance(ts, bool):
            ev["ts"] = round(ts + shift, 3)
        elif isinstance(ts, str):
            try:
                ev["ts"] = round(float(ts) + shift, 3)
            except ValueError:
                pass
        # Kineto numbers its flows per trace: made unique across the merged traces.
        if ph in _FLOW_PHASES and "id" in ev:
            ev["id"] = flow_id(("p", fi, ev.get("cat"), ev.get("name"), str(ev["id"])))
        if "bind_id" in ev:
            ev["bind_id"] = flow_id(("b", fi, str(ev["bind_id"])))
        yield ev


def _extra_pid(extra_pids: dict[tuple[str, Any], int], worker: str, pid: Any, pid_main: int) -> int:
    """The merged pid of ``worker``'s non-main process ``pid`` (allocated on first sight)."""
    new = extra_pids.get((worker, pid))
    if new is None:
        new = extra_pids[(worker, pid)] = pid_main + 1 + sum(1 for k in extra_pids if k[0] == worker)
    return new
