"""What ``rpc-observe doctor`` prints: the verdict, then the evidence, in plain words
(:func:`render_text`), or the same as one JSON object (:func:`as_json`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from .graph import CallView, Diagnosis, Hop, StuckUdf
from .sources import Worker

REMEDY = ("make the nested call with rpc_async and return its future from a @rpc.functions.async_execution "
          "function")


def render_text(d: Diagnosis, notes: Sequence[str] = (), now_unix_s: float | None = None) -> str:
    """The report: the verdict on the first line, then one section per finding, then the workers."""
    now = time.time() if now_unix_s is None else now_unix_s
    lines = [d.verdict]
    for number, cycle in enumerate(d.cycles):
        if number:
            names = [hop.worker for hop in cycle]
            lines.append(f"another cycle: {' -> '.join(names + names[:1])}")
        lines.extend(_hop_line(hop, d.workers) for hop in cycle)
        lines.append(_remedies(cycle, d.workers))
    for name, waiting in sorted(d.unreachable.items()):
        if waiting:
            lines.append(f"waiting on {name}, which does not answer:")
            lines.extend(f"  {c.caller}: {c.method}, {_call_id(c)}, {c.age_s:.1f} s" for c in waiting)
    if d.stuck_udfs:
        lines.append(f"UDFs running {d.threshold_s:g} s or more and waiting on no RPC (they wait in user code):")
        lines.extend(_udf_line(udf) for udf in d.stuck_udfs)
    if d.calls and not d.cycles:
        lines.append(f"oldest calls in flight (stuck at {d.threshold_s:g} s):")
        lines.extend(f"  {c.caller} -> {c.callee}: {c.method}, {_call_id(c)}, {_state(c, d.workers)}"
                     for c in d.oldest_calls())
    if d.from_dumps_only:
        lines.append(_dumps_line(d, now))
    lines.extend(f"note: {note}" for note in notes)
    lines.append("workers: " + "; ".join(_worker(w, now) for _, w in sorted(d.workers.items())))
    return "\n".join(lines) + "\n"


def as_json(d: Diagnosis, notes: Sequence[str] = ()) -> dict[str, Any]:
    """The report as one JSON object; ``verdict`` is the text's first line."""
    workers = {name: {"reachable": w.reachable, "pool_size": w.agent.get("pool_size"),
                      "idle_threads": w.agent.get("idle_threads"), "source": w.source, "origin": w.origin,
                      "time_unix_s": (w.snapshot or {}).get("time_unix_s"), "fetch_error": w.fetch_error}
               for name, w in sorted(d.workers.items())}
    return {
        "verdict": d.verdict, "status": d.status, "threshold_s": d.threshold_s, "from_dumps_only": d.from_dumps_only,
        "workers": workers,
        "calls": [_call_json(c) for c in d.calls],
        "cycles": [[hop.worker for hop in cycle] for cycle in d.cycles],
        "cycle_hops": [[{"worker": hop.worker, "callee": hop.call.callee, "method": hop.call.method,
                         "call_id": hop.call.call_id, "state": hop.call.state, "age_s": hop.call.age_s,
                         "line": hop.line} for hop in cycle] for cycle in d.cycles],
        "stuck_udfs": [_udf_json(udf) for udf in d.stuck_udfs],
        "unreachable": {name: [_call_json(c) for c in calls] for name, calls in sorted(d.unreachable.items())},
        "stuck_calls": [_call_json(c) for c in d.stuck_calls],
        "notes": list(notes),
    }


def _call_json(c: CallView) -> dict[str, Any]:
    return {"caller": c.caller, "callee": c.callee, "method": c.method, "age_s": c.age_s, "state": c.state,
            "call_id": c.call_id, "mode": c.mode, "nested_in": c.nested_in, "stack": c.stack}


def _udf_json(udf: StuckUdf) -> dict[str, Any]:
    return {"worker": udf.worker, "caller": udf.caller, "method": udf.method, "call_id": udf.call_id,
            "age_s": udf.age_s, "line": udf.line}


def _hop_line(hop: Hop, workers: dict[str, Worker]) -> str:
    c = hop.call
    return (f"  {hop.worker} waits on {c.callee}: {c.method}, {_call_id(c)}, {_state(c, workers)}, "
            f"at {hop.line or 'an unknown line (no stack)'}")


def _udf_line(udf: StuckUdf) -> str:
    call = f"call {udf.call_id}" if udf.call_id is not None else "no call id"
    return (f"  {udf.worker} runs {udf.method} for {udf.caller} ({call}) for {udf.age_s:.1f} s, "
            f"at {udf.line or 'an unknown line (no stack)'}")


def _remedies(cycle: list[Hop], workers: dict[str, Worker]) -> str:
    exhausted = sorted({hop.call.callee for hop in cycle if hop.call.state == "queued"})
    pools = ", ".join(f"{_n(workers[name].agent.get('pool_size'))} on {name}" for name in exhausted)
    more = f", or raise num_worker_threads in TensorPipeRpcBackendOptions (now {pools})" if exhausted else ""
    return f"Remedies: {REMEDY}{more}."


def _call_id(c: CallView) -> str:
    return f"call {c.call_id}" if c.call_id is not None else "no call id"


def _state(c: CallView, workers: dict[str, Worker]) -> str:
    """``running 9.8 s``; a queued call says how busy its peer's pool is."""
    said = f"{c.state} {c.age_s:.1f} s"
    if c.state == "queued":
        agent = workers[c.callee].agent
        said += f" ({c.callee}: {_n(agent.get('idle_threads'))} of {_n(agent.get('pool_size'))} pool threads idle)"
    return said


def _worker(w: Worker, now: float) -> str:
    pool = (f"pool {_n(w.agent.get('pool_size'))}, {_n(w.agent.get('idle_threads'))} idle" if w.agent
            else "no pool info")
    if w.reachable:
        return f"{w.name} live, {pool}"
    said = f"{w.name} unreachable ({w.fetch_error})" if w.fetch_error else w.name
    if w.snapshot is None:
        return f"{said}, no dump"
    reason = f" ({w.snapshot['reason']})" if w.snapshot["reason"] != "?" else ""
    return f"{said}, dump of {_when(w.snapshot['time_unix_s'], now)}{reason}, {pool}"


def _dumps_line(d: Diagnosis, now: float) -> str:
    written = sorted((w.snapshot["time_unix_s"], name) for name, w in d.workers.items()
                     if w.snapshot and w.snapshot["time_unix_s"] is not None)
    when = (f"the oldest ({written[0][1]}) of {_when(written[0][0], now)}, the newest ({written[-1][1]}) of "
            f"{_when(written[-1][0], now)}" if written else "written at unknown times")
    return f"from dumps only (no worker answered): {when}; ages are as of each dump"


def _when(unix_s: float | None, now: float) -> str:
    """``2025-01-02 12:00:01, 35 s ago``; a time the platform cannot show is an unknown time."""
    if unix_s is None:
        return "an unknown time"
    try:
        return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(unix_s))}, {_duration(now - unix_s)} ago"
    except (OverflowError, OSError, ValueError):
        return "an unknown time"


def _n(count: int | None) -> str:
    return "?" if count is None else str(count)


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if abs(seconds) >= 2 * size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"
