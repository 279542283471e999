"""The life of one client call, in one place: its id, the table of calls waiting for an
echoed response, the sweep, and the reference way a call ends.

A call starts in `client` (a `Call` per call), gets an id when its request is pickled
(`pickler.serialize`, only for calls whose response the callee echoes: see
`ClientSite.echoed`) and ends in exactly one of these ways, all through `Call.finish`:
- its echoed response is unpickled (`pickler.deserialize`, the common case; the
  successful, unprofiled ending is done inline there with these names, and
  tests/unit/test_endings.py holds it to `Call.finish` on the same inputs);
- a done-callback (`Call.on_done`), for Python calls whose responses carry no echo
  (async_execution functions, a peer without rpc_observe);
- where an `rpc_sync`'s wait returns (`client._EndsOnWait`), for a builtin or TorchScript
  function: these, and `remote`, never take a Python callback (`ClientSite.swept`);
- `end_unfinished`, at rpc.shutdown(), exit and SIGTERM, with error.type=shutdown;
- `sweep`, for calls that completed without an echoed response: the swept ones, a timeout,
  a lost peer, or a peer without rpc_observe (whose call sites then stop waiting for echoes);
- `end_raised`, when torch raised before the call had a future.
The callee's half of the echo is `pending_replies`: `server` leaves the caller's call id
there for the thread that pickles the UDF's response.

The flight recorder (`recorder`) reads three tables kept here: `in_flight`, `serving` (the
UDF each pool thread runs, by thread id) and `finished` (the last finished calls). A call
remembers the thread that issued it and the UDF that thread was serving then (`parent`):
that link turns the workers' tables into one wait-for graph.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable, Iterator, MutableMapping
from typing import TYPE_CHECKING, Any

from torch.autograd import _profiler_enabled
from torch.distributed.rpc.internal import RemoteException

from ..telemetry import health
from ..telemetry.metrics import fold_finished, fold_split
from . import native

if TYPE_CHECKING:
    from ..telemetry.runtime import Runtime
    from .client import ClientSite
    from .server import ServerSite

local = threading.local()  # .call: the call being sent (set_current_call); .fetch: an RRef.to_here() site
# Every started call that has a future, by call id: those whose echoed response ends them,
# and those a done-callback ends (so that shutdown, exit and SIGTERM can end what is left).
in_flight: dict[int, Call] = {}
# Its bound: past it, calls are still observed, but end by a done-callback (no echo) and are
# not ended by shutdown or SIGTERM. A process rarely has this many calls in flight.
MAX_IN_FLIGHT = 100_000
next_id = itertools.count(1).__next__
# The site and caller's call id of the UDF whose response is pickled next on a thread, by
# thread id: torch's pool threads get a fresh Python thread state (and an empty
# threading.local) every time they take the GIL, between running a UDF and pickling its response,
# unless hooks/thread_states.py keeps it (RPC_OBSERVE_KEEP_THREAD_STATES=0, or a state it cannot keep).
# The reference of the C core's thread local (set_pending_reply / take_pending_reply, below).
pending_replies: dict[int, tuple[ServerSite, str, float]] = {}  # (site, caller's call id, request's perf_counter)
_sweep_lock = threading.Lock()
_time_ns = time.time_ns
_native_id = threading.get_native_id
_get_ident = threading.get_ident
Error = tuple[str, str]  # (error.type, message)
# The UDF each thread runs, by thread id: (ServerSite, the caller's call id text, start ns, trace id or 0).
Served = tuple["ServerSite", str, int, int]
# A finished call: (ClientSite, call id, start ns, end ns, error.type or None).
Finished = tuple["ClientSite", int, int, int, "str | None"]


class FinishedCalls:
    """The last `maxlen` finished calls, oldest first: the reference of `_core.FinishedCalls`, where the echoed
    ending keeps a call's numbers without a tuple. One object for the process's life (the C paths hold it)."""

    def __init__(self, maxlen: int) -> None:
        self._calls: collections.deque[Finished] = collections.deque(maxlen=maxlen)

    def append(self, finished: Finished, /) -> None:
        self._calls.append(finished)

    def resize(self, maxlen: int, /) -> None:
        """Keeps the newest `maxlen` calls, and that many from now on."""
        self._calls = collections.deque(self._calls, maxlen=maxlen)

    def clear(self) -> None:
        self._calls.clear()

    @property
    def maxlen(self) -> int:
        return self._calls.maxlen or 0

    def __len__(self) -> int:
        return len(self._calls)

    def __iter__(self) -> Iterator[Finished]:
        return iter(list(self._calls))


# A call's fields, in a C struct where the core is built (`_core.CallBase`: its hot paths read them with no
# lookup, and a call made there creates no int object); the same names in Python slots otherwise.
CALL_FIELDS = ("runtime", "site", "start_ns", "span", "rf", "tid", "id", "future", "thread", "parent")


class _CallFields:
    __slots__ = CALL_FIELDS


_core = native.load("_core")
NO_MORE_FIELDS: tuple[str, ...] = ()  # a name, not a literal: type checkers take the fields from the annotations
_CallBase: type = _core.CallBase if _core is not None else _CallFields
# The last finished calls (RPC_OBSERVE_RECORDER_SIZE of them: hooks.attach resizes it).
finished: FinishedCalls = (_core.FinishedCalls if _core is not None else FinishedCalls)(1000)
# The UDF each thread runs: the dict is the reference of `_core.serving`, where a run's entry is set in its thread's
# slot in C (no int, tuple or write to a table every pool thread shares); read with get/items/values/len.
# (`_core.ServingTable` has the mapping methods used here: get, pop, items, values, clear, update, len, [])
serving: MutableMapping[int, Served] = _core.serving if _core is not None else {}


def _current_call() -> Call | None:
    return getattr(local, "call", None)


def _set_current_call(call: Call | None) -> None:
    local.call = call


# The client call whose request this thread is sending (set around torch's call, read where its request is
# pickled): a C thread local where the core is built; the functions above are its reference.
current_call: Callable[[], Call | None] = _core.current_call if _core is not None else _current_call
set_current_call: Callable[[Call | None], None] = _core.set_current_call if _core is not None else _set_current_call


def _set_pending_reply(site: ServerSite, echo: str, request_start: float) -> None:
    pending_replies[_get_ident()] = (site, echo, request_start)


def _take_pending_reply() -> tuple[ServerSite, str, float] | None:
    return pending_replies.pop(_get_ident(), None)


# The reply a thread owes, set where its UDF's run ends, taken where the response is pickled (the caller's call id
# echoed, "" for none; the request's perf_counter, 0.0 if not known): a C thread local where the core is built.
set_pending_reply: Callable[[ServerSite, str, float], None] = (_core.set_pending_reply if _core is not None
                                                               else _set_pending_reply)
take_pending_reply: Callable[[], tuple[ServerSite, str, float] | None] = (_core.take_pending_reply
                                                                          if _core is not None else _take_pending_reply)


class Call(_CallBase):  # the base is chosen at import
    """One client call in flight."""

    __slots__ = NO_MORE_FIELDS
    runtime: Runtime
    site: ClientSite
    start_ns: int
    span: Any
    rf: Any
    tid: int
    id: int
    future: Any
    thread: int
    parent: Served | None

    def __init__(self, runtime: Runtime, site: ClientSite) -> None:
        self.runtime, self.site = runtime, site
        self.start_ns = _time_ns()
        self.id = 0
        self.future = None
        self.thread = thread = _get_ident()
        self.parent = serving.get(thread) if serving else None  # the UDF this call waits inside, if any
        tracer, profiler = runtime.tracer, runtime.profiler
        self.span = tracer.start_client(site.span_name, site.attributes, self.start_ns) if tracer else None
        self.tid = 0
        if profiler is not None:
            self.rf = profiler.client_start(site.key) if _profiler_enabled() else None
            if profiler.armed:
                self.tid = _native_id()
        else:
            self.rf = None
        if site.record is not None:
            site.record(site.started)

    def finish(self, end_ns: int | None = None, error: Error | None = None, callee_ns: int = -1) -> None:
        """Ends the call at `end_ns` (now if None): the reference ending, that every other one matches.

        `callee_ns`: the callee's own time for the call, from its response (-1: not known)."""
        end_ns = _time_ns() if end_ns is None else end_ns
        runtime, site = self.runtime, self.site
        finished.append((site, self.id, self.start_ns, end_ns, error[0] if error is not None else None))
        if error is not None and error[0] == TIMEOUT and runtime.recorder is not None:
            runtime.recorder.request_dump(TIMEOUT)  # written by the housekeeping thread, never here
        if site.record is not None:
            if callee_ns >= 0 and error is None:
                site.record((fold_split, site.cells, (end_ns - self.start_ns) / 1e9, callee_ns / 1e9, self.span))
            else:
                site.record((fold_finished, site.cells, (end_ns - self.start_ns) / 1e9, self.span))
            if error is not None:
                runtime.metrics.count_error(  # type: ignore[union-attr]  # a record implies metrics
                    "client", site.method, site.dst, error[0])
        if self.span is not None:
            self.span.callee_ns = callee_ns
            if error is None:
                runtime.tracer.end(self.span, end_ns)  # type: ignore[union-attr]  # a span implies a tracer
            else:
                runtime.tracer.end(self.span, end_ns, error[1], error[0])  # type: ignore[union-attr]
        profiler = runtime.profiler
        if profiler is not None and self.rf is None and profiler.armed:
            profiler.record(site.key, "client", self.start_ns, end_ns, self.tid, self.span)

    def fail(self, error: BaseException | None) -> None:
        self.finish(None, (classify(error), str(error)) if error is not None else None)

    def on_done(self, future: Any) -> None:
        try:
            # id 0: never in the table (it was full); else a sweep or end_unfinished may have ended it
            if not self.id or in_flight.pop(self.id, None) is not None:
                self.fail(future_error(future))
        except Exception:
            health.internal_error("client_done")


def end_raised(call: Call, error: BaseException) -> None:
    """Ends a call that raised before it had a future."""
    try:
        if call.id:
            in_flight.pop(call.id, None)
        if call.rf is not None:
            call.runtime.profiler.client_end(call.rf)  # type: ignore[union-attr]  # an rf implies a profiler
        call.fail(error)
    except Exception:
        health.internal_error("client_end")


def sweep() -> None:
    """Ends the calls that completed without an echoed response: swept ones (`remote`, builtins and
    TorchScript functions via `rpc_async`), failed ones, and replies of peers without rpc_observe
    (their call sites stop waiting for an echo).

    One sweep at a time, so that a scrape that sweeps first also sees what a concurrent
    sweep (the housekeeping thread's) has taken out of `in_flight` but not yet recorded.
    """
    with _sweep_lock:
        for call_id, call in list(in_flight.items()):
            future = call.future
            if future is None or not future.done() or in_flight.pop(call_id, None) is None:
                continue
            error = future_error(future)
            if error is None and call.site.echoed:  # a reply without an echo: a peer without rpc_observe
                call.site.echoed = False
            try:
                call.fail(error)
            except Exception:
                health.internal_error("client_sweep")


SHUTDOWN = "shutdown"
TIMEOUT = "timeout"


def end_unfinished() -> None:
    """Ends every call still in flight with error.type=shutdown (at rpc.shutdown(), exit, SIGTERM),
    so that counters and spans agree on every started call."""
    sweep()
    with _sweep_lock:
        unfinished = [in_flight.pop(call_id, None) for call_id in list(in_flight)]
    for call in unfinished:
        if call is not None:
            try:
                call.finish(None, (SHUTDOWN, "the process shut down before the call completed"))
            except Exception:
                health.internal_error("client_shutdown")


def remote_error(obj: object) -> Error | None:
    """(error.type, message) of a response that is a UDF's exception (torch raises it on the caller)."""
    return (obj.exception_type.__name__, obj.msg) if type(obj) is RemoteException else None


def future_error(future: Any) -> BaseException | None:
    """The exception a completed torch Future holds (already on its way to the caller), or None."""
    try:
        future.value()
    except BaseException as e:
        return e
    return None


def classify(error: BaseException) -> str:
    """The error.type of a failed call: the exception class, or timeout / connection_error."""
    name = type(error).__name__
    if name == "RuntimeError":
        text = str(error)[:512].lower()
        if "timeout" in text or "timed out" in text:
            return TIMEOUT
        if "connection" in text or "pipe" in text or "eof" in text or "shut down" in text:
            return "connection_error"
    return name
