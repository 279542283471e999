"""The join of the workers' snapshots: each in-flight call is matched with the UDF that runs
it on its peer, the served calls form a wait-for graph, and its cycles are deadlocks.

Pure functions on snapshots in the schema "rpc_observe.debug/1" (as
:func:`rpc_observe.doctor.sources.parse_snapshot` returns them): no I/O, no clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .sources import Worker

DEFAULT_THRESHOLD_S = 30.0
# A call younger than this takes no part in cycles: a snapshot of a busy, healthy job catches
# pool threads waiting on nested calls that are about to return.
CYCLE_MIN_AGE_S = 1.0
# Frames that are not where the user's code waits: the RPC machinery, the add-on, Event.wait.
_MACHINERY = ("/torch/", "/rpc_observe/")
_OWN_USER_CODE = "/rpc_observe/demo/"  # the demo's workload is user code, though it ships with the add-on

Node = tuple[str, int]  # a served call: (worker, the pool thread running it)


@dataclass
class CallView:
    """One in-flight call joined with its peer; ``state`` is running, queued, unreachable or unknown."""

    caller: str
    callee: str
    method: str
    call_id: int | None
    age_s: float
    mode: str
    state: str
    thread: int | None  # the caller's thread that waits on it
    nested_in: dict[str, Any] | None
    callee_thread: int | None = None  # the callee's thread running it (running only)
    stack: list[str] = field(default_factory=list)  # that thread's stack, innermost last


@dataclass
class Hop:
    """One step of a cycle: ``worker`` waits on ``call``, at ``line`` of its waiting thread."""

    worker: str
    call: CallView
    line: str


@dataclass
class StuckUdf:
    """A UDF older than the threshold whose thread waits on no RPC: it waits in user code."""

    worker: str
    caller: str
    method: str
    call_id: int | None
    age_s: float
    line: str


@dataclass
class Diagnosis:
    """Everything :func:`diagnose` found; ``verdict`` is one line, ``status`` the exit status."""

    workers: dict[str, Worker]
    threshold_s: float
    calls: list[CallView]
    cycles: list[list[Hop]]
    stuck_udfs: list[StuckUdf]
    unreachable: dict[str, list[CallView]]
    stuck_calls: list[CallView]
    verdict: str = ""

    @property
    def status(self) -> int:
        """1 when something is stuck (a cycle, a worker out of reach that is waited on, an old call), else 0."""
        waited_on = any(self.unreachable.values())
        return 1 if self.cycles or waited_on or self.stuck_udfs or self.stuck_calls else 0

    @property
    def from_dumps_only(self) -> bool:
        return not any(w.reachable for w in self.workers.values())

    def oldest_calls(self, count: int = 5) -> list[CallView]:
        return sorted(self.calls, key=lambda c: -c.age_s)[:count]


def default_threshold(workers: Mapping[str, Worker]) -> float:
    """The smallest ``hang_seconds`` the snapshots carry (the workers' own watchdog), else 30 s."""
    seen = [w.snapshot["hang_seconds"] for w in workers.values()
            if w.snapshot and isinstance(w.snapshot.get("hang_seconds"), float) and w.snapshot["hang_seconds"] > 0]
    return min(seen) if seen else DEFAULT_THRESHOLD_S


def _cut_off(worker: Worker | None, any_live: bool) -> bool:
    """Whether calls to ``worker`` are "unreachable": it answered nothing and left no dump, or,
    while others answer, its endpoint failed (a stopped process; its dump still feeds the graph)."""
    if worker is None or worker.reachable:
        return False
    return worker.snapshot is None or (any_live and worker.fetch_error is not None)


def _serving_entry(callee: Worker | None, caller: str, call_id: int | None) -> dict[str, Any] | None:
    """The UDF running a call on its callee: joined by (caller, call_id), both known."""
    serving = callee.snapshot["serving"] if callee and callee.snapshot and call_id is not None else []
    return next((s for s in serving if s["caller"] == caller and s["call_id"] == call_id), None)


def issuing_serve(snapshot: Mapping[str, Any], call: Mapping[str, Any]) -> dict[str, Any] | None:
    """The served call (UDF) on whose thread ``call`` was issued: by ``nested_in``, else by thread."""
    outer = call.get("nested_in")
    if outer and outer.get("call_id") is not None:
        for served in snapshot["serving"]:
            if served["caller"] == outer["caller"] and served["call_id"] == outer["call_id"]:
                return served
    if call["thread"] is not None:
        for served in snapshot["serving"]:
            if served["thread"] == call["thread"]:
                return served
    return None


def diagnose(workers: Mapping[str, Worker], threshold_s: float | None = None) -> Diagnosis:
    """Join the snapshots, find cycles, stuck UDFs and waiters on unreachable workers, and say which matters."""
    threshold = default_threshold(workers) if threshold_s is None else threshold_s
    min_cycle_age = min(CYCLE_MIN_AGE_S, threshold)
    any_live = any(w.reachable for w in workers.values())
    calls: list[CallView] = []
    edges: dict[Node, list[tuple[Node, CallView]]] = {}
    busy_serves: set[tuple[str, int]] = set()  # (worker, thread) of served calls that issued a call in flight
    for name in sorted(workers):
        snapshot = workers[name].snapshot
        if snapshot is None:
            continue
        for call in sorted(snapshot["calls"], key=lambda c: -c["age_s"]):
            view, targets = _join(name, call, workers, any_live)
            calls.append(view)
            outer = issuing_serve(snapshot, call)
            if outer is not None and outer["thread"] is not None:
                busy_serves.add((name, outer["thread"]))
                if view.age_s >= min_cycle_age:
                    edges.setdefault((name, outer["thread"]), []).extend((t, view) for t in targets)
    cycles = [[Hop(node[0], view, waiting_line(workers[node[0]].snapshot, view.thread, node[1]))
               for node, view in cycle] for cycle in cycles_of(edges)]
    unreachable = {name: [c for c in calls if c.callee == name] for name, w in workers.items()
                   if _cut_off(w, any_live)}
    diagnosis = Diagnosis(dict(workers), threshold, calls, cycles, _stuck_udfs(workers, busy_serves, threshold),
                          unreachable, sorted((c for c in calls if c.age_s >= threshold), key=lambda c: -c.age_s))
    diagnosis.verdict = verdict_of(diagnosis)
    return diagnosis


def _join(caller: str, call: dict[str, Any], workers: Mapping[str, Worker],
          any_live: bool) -> tuple[CallView, list[Node]]:
    """The call's state, and the served calls on its peer it waits on (the wait-for edges)."""
    callee = workers.get(call["peer"])
    served = _serving_entry(callee, caller, call["call_id"])
    targets: list[Node] = []
    state, callee_thread, stack = "unknown", None, []
    if callee is not None and callee.snapshot is not None:
        if served is not None:
            state, callee_thread = "running", served["thread"]
            stack = list(callee.snapshot["stacks"].get(str(callee_thread), []))
            if callee_thread is not None:
                targets = [(callee.name, callee_thread)]
        elif callee.agent.get("idle_threads") == 0:
            # Every pool thread of the peer is busy: the request waits for whichever ends first.
            state = "queued"
            targets = [(callee.name, s["thread"]) for s in callee.snapshot["serving"] if s["thread"] is not None]
    if _cut_off(callee, any_live):
        state, callee_thread, stack = "unreachable", None, []
    view = CallView(caller, call["peer"], call["method"], call["call_id"], call["age_s"], call["mode"], state,
                    call["thread"], call["nested_in"], callee_thread, stack)
    return view, targets


def _stuck_udfs(workers: Mapping[str, Worker], busy_serves: set[tuple[str, int]],
                threshold: float) -> list[StuckUdf]:
    stuck = []
    for name in sorted(workers):
        snapshot = workers[name].snapshot
        for served in (snapshot or {}).get("serving", []):
            if served["age_s"] < threshold or (name, served["thread"]) in busy_serves:
                continue
            stuck.append(StuckUdf(name, served["caller"], served["method"], served["call_id"], served["age_s"],
                                  waiting_line(snapshot, served["thread"], None)))
    return sorted(stuck, key=lambda u: -u.age_s)


def waiting_line(snapshot: Mapping[str, Any] | None, thread: int | None, fallback_thread: int | None) -> str:
    """Where a thread waits in user code: the innermost frame of its stack outside torch, the
    add-on and threading.py (so a UDF blocked in Event.wait points at the line that called it)."""
    stacks = (snapshot or {}).get("stacks") or {}
    stack = stacks.get(str(thread)) or stacks.get(str(fallback_thread)) or []
    for frame in reversed(stack):
        path = frame.rsplit(" in ", 1)[0].rsplit(":", 1)[0]
        machinery = any(part in path for part in _MACHINERY) and _OWN_USER_CODE not in path
        if not machinery and not path.endswith("threading.py"):
            return frame
    return ""


def cycles_of(edges: Mapping[Node, list[tuple[Node, CallView]]]) -> list[list[tuple[Node, CallView]]]:
    """One cycle per strongly connected part of the wait-for graph, as (waiting node, the call it
    waits on) hops from the alphabetically first worker: the shortest cycle through its first node."""
    found = (_shortest_cycle(min(part), part, edges) for part in _strongly_connected(edges))
    return sorted((cycle for cycle in found if cycle), key=lambda cycle: [node for node, _ in cycle])


def _strongly_connected(edges: Mapping[Node, list[tuple[Node, CallView]]]) -> list[set[Node]]:
    """Kosaraju's two passes, without recursion (a large job's graph is deep)."""
    nodes = sorted(set(edges) | {target for out in edges.values() for target, _ in out})
    succ = {node: sorted({target for target, _ in edges.get(node, [])}) for node in nodes}
    pred: dict[Node, list[Node]] = {node: [] for node in nodes}
    for node in nodes:
        for target in succ[node]:
            pred[target].append(node)
    order: list[Node] = []
    seen: set[Node] = set()
    for root in nodes:
        if root in seen:
            continue
        seen.add(root)
        stack = [(root, iter(succ[root]))]
        while stack:
            node, out = stack[-1]
            following = next((t for t in out if t not in seen), None)
            if following is None:
                stack.pop()
                order.append(node)
            else:
                seen.add(following)
                stack.append((following, iter(succ[following])))
    parts, placed = [], set()
    for root in reversed(order):
        if root in placed:
            continue
        part, todo = {root}, [root]
        placed.add(root)
        while todo:
            for earlier in pred[todo.pop()]:
                if earlier not in placed:
                    placed.add(earlier)
                    part.add(earlier)
                    todo.append(earlier)
        parts.append(part)
    return parts


def _shortest_cycle(start: Node, part: set[Node],
                    edges: Mapping[Node, list[tuple[Node, CallView]]]) -> list[tuple[Node, CallView]]:
    via: dict[Node, tuple[Node, CallView]] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for target, call in edges.get(node, []):
            if target == start:
                hops = [(node, call)]
                while node != start:
                    node, call = via[node]
                    hops.append((node, call))
                return hops[::-1]
            if target in part and target not in via:
                via[target] = (node, call)
                queue.append(target)
    return []  # a part of one node without a self-loop


def verdict_of(d: Diagnosis) -> str:
    """The first line of the report: the worst thing found, in plain words."""
    if d.cycles:
        cycle = d.cycles[0]
        names, kind = [hop.worker for hop in cycle], "rpc_sync" if all(h.call.mode == "sync" for h in cycle) else "RPCs"
        why = (f"every pool thread waits on a nested RPC (pool exhausted by nested {kind})"
               if any(hop.call.state == "queued" for hop in cycle) else "each UDF waits on a nested RPC to the next")
        more = f" (and {len(d.cycles) - 1} more cycle(s))" if len(d.cycles) > 1 else ""
        return f"DEADLOCK: {' -> '.join(names + names[:1])}: {why}{more}"
    waited_on = sorted(name for name, calls in d.unreachable.items() if calls)
    if waited_on:
        count = sum(len(d.unreachable[name]) for name in waited_on)
        why = f"{waited_on[0]}: " * (len(waited_on) > 1) + (d.workers[waited_on[0]].fetch_error or "no dump")
        verb, them = ("does", "it") if len(waited_on) == 1 else ("do", "them")
        return f"UNREACHABLE: {', '.join(waited_on)} {verb} not answer ({why}); {count} call(s) wait on {them}"
    if d.stuck_udfs:
        udf = d.stuck_udfs[0]
        more = f" (and {len(d.stuck_udfs) - 1} more UDF(s))" if len(d.stuck_udfs) > 1 else ""
        return (f"STUCK IN USER CODE: {udf.worker} has run {udf.method} for {udf.caller} for {udf.age_s:.1f} s, "
                f"at {udf.line or 'an unknown line (no stack)'}{more}")
    if d.stuck_calls:
        c = d.stuck_calls[0]
        return (f"STUCK: {len(d.stuck_calls)} call(s) in flight for {d.threshold_s:g} s or more; the oldest: "
                f"{c.caller} -> {c.callee} {c.method}, {c.state} {c.age_s:.1f} s")
    oldest = f", the oldest {d.oldest_calls(1)[0].age_s:.1f} s" if d.calls else ""
    return f"OK: no call is stuck ({len(d.calls)} call(s) in flight{oldest}; threshold {d.threshold_s:g} s)"

