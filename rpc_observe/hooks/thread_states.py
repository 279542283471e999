"""torch's RPC pool threads keep their Python thread state (RPC_OBSERVE_KEEP_THREAD_STATES, on by default).

The agent's pool threads are C++ threads. Each time one takes the GIL to unpickle a message, run a
UDF or pickle a response (pybind11's `gil_scoped_acquire`), CPython makes it a new thread state and
deletes it at the release: a state allocated, its 16 KiB frame stack mapped, faulted in and
unmapped, and every cache of that thread's Python side cold, 2-3 times per RPC on the callee
(BENCHMARKS.md, "Thread states"). The first time a hook runs on a thread, `keep` takes one
reference more on its state (`PyGILState_Ensure`, never released), so pybind11 keeps the state
and takes the GIL with it from then on.

What Python code on those threads sees: a `threading.local` keeps its values from one GIL hold to
the next, as on any other thread. A UDF still starts in an empty `contextvars` context, as on a new
thread state (the hooks run it in one). A kept state lives as long as the process (about 20 KiB a
pool thread).

The C core does the same in its hooks (hooks/_core.c, `keep_thread_state`); this module is its
reference, used by the pure-Python hooks, and the switch for both.
"""

from __future__ import annotations

import ctypes
import threading

from ..telemetry import health
from . import trailer

_core = trailer.core
_pointer_of = ctypes.PYFUNCTYPE(ctypes.c_void_p)  # the GIL held, as every C API call needs
_this_thread_state = _pointer_of(("PyGILState_GetThisThreadState", ctypes.pythonapi))
_current_thread_state = _pointer_of(("PyThreadState_Get", ctypes.pythonapi))
_add_reference = ctypes.PYFUNCTYPE(ctypes.c_int)(("PyGILState_Ensure", ctypes.pythonapi))
_seen = threading.local()  # `.kept` lives exactly as long as the thread state it was set on

enabled = False


def configure(keep: bool) -> None:
    """Whether the hooks keep the thread states of the threads they run on (the runtime's config)."""
    global enabled
    enabled = keep
    if _core is not None:
        _core.keep_thread_states(keep)


def keep() -> None:
    """Keeps this thread's Python thread state alive after the GIL is released (once a thread state)."""
    if enabled and not getattr(_seen, "kept", False):
        try:
            _seen.kept = True
            # Ensure on the state this thread already runs with only counts a reference: it takes no lock. A
            # state that is not the thread's PyGILState one (a sub-interpreter's) is left as it is.
            if _this_thread_state() == _current_thread_state():
                _add_reference()
        except Exception:
            health.internal_error("thread_state")
