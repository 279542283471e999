"""A client call's torch profiler event under a real Kineto session: begun on the calling thread and ended as
its future completes, by the calling thread for rpc_sync (which waits in `_invoke_rpc`, its next step anyway),
by torch's profiled future for any other call. No RPC: a torch future completed by a timer thread.

Not in the ASan run (.ci/asan): it exercises no C code, and a failing torch future raises through a C++
exception, which the ASan run's preloaded runtime aborts on."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from rpc_observe.hooks.client import ClientSite
from rpc_observe.hooks.profiler_events import ProfilerEvents

KEY = "rpc_x#f(worker0 -> worker1)"


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("fails", [False, True])
def test_a_client_profiler_event_ends_when_its_future_completes(mode: str, fails: bool) -> None:
    """rpc_sync's future comes back complete (this thread waited) and its error is not raised here; the event
    covers the 50 ms until the future completed, and is a user annotation as torch's record_function makes."""

    def outcome(_: Any) -> int:
        if fails:
            raise ValueError("the UDF's")
        return 7

    events, site, source = ProfilerEvents("worker0", ""), ClientSite.__new__(ClientSite), torch.futures.Future()
    site.mode = mode
    future = source.then(outcome)  # its error set in C++, as an RPC's is (set_exception's is unwrapped in Python)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        rf = events.client_start(KEY)
        timer = threading.Timer(0.05, source.set_result, args=(None,))
        timer.start()
        returned = events.client_end_on(rf, future, site)
        assert returned.done() == (mode == "sync")
        if fails:
            with pytest.raises(RuntimeError, match="ValueError: the UDF's"):
                returned.wait()
        else:
            assert returned.wait() == 7
        timer.join()
    (event,) = [e for e in prof.events() if e.name == KEY]
    assert 45_000 <= event.cpu_time_total < 5_000_000  # us: until the future completed, and ended then
    assert event.is_user_annotation


def test_an_event_that_raised_before_its_future_ends_on_its_thread() -> None:
    """`client_end` (a call that raised before it had a future, or `to_here`) ends the event where it began."""
    events = ProfilerEvents("worker0", "")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        events.client_end(events.client_start(KEY))
    (event,) = [e for e in prof.events() if e.name == KEY]
    assert event.is_user_annotation and event.cpu_time_total < 1_000_000
