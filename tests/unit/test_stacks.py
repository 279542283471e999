"""The flight recorder's stack reader (rpc_observe/hooks/_stacks.c) against its Python reference,
on real threads parked where a stuck RPC thread parks: in a wait, deep in user code."""

from __future__ import annotations

import gc
import shutil
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from rpc_observe.hooks import calls, snapshot

C = snapshot._native
needs_c = pytest.mark.skipif(C is None, reason="the stack reader is not built here")
SECRET = "do-not-leak-this-local"


def _inner(ready: threading.Event, release: threading.Event) -> None:
    local_value = SECRET  # a local: never in a stack
    ready.set()
    release.wait(30)  # the line the stack must end on
    del local_value


def _outer(ready: threading.Event, release: threading.Event, depth: int) -> None:
    if depth:
        _outer(ready, release, depth - 1)
    else:
        _inner(ready, release)


@pytest.fixture
def parked() -> Iterator[list[int]]:
    """Three threads parked in `_inner`, 1, 10 and 100 calls deep."""
    release, threads = threading.Event(), []
    for depth in (1, 10, 100):
        ready = threading.Event()
        thread = threading.Thread(target=_outer, args=(ready, release, depth), daemon=True)
        thread.start()
        assert ready.wait(10)
        threads.append(thread)
    yield [t.ident for t in threads if t.ident is not None]
    release.set()
    for thread in threads:
        thread.join(10)


def test_the_stack_reader_is_built_where_a_compiler_is() -> None:
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler here: stacks are read in Python")
    assert C is not None, "rpc_observe/hooks/_stacks.c is not built: reinstall (pip install -e .)"


@needs_c
@pytest.mark.parametrize("limit", [1, 5, 64, 1000])
def test_c_and_python_read_the_same_stacks(parked: list[int], limit: int) -> None:
    assert C is not None
    native, reference = C.stacks(parked, limit), snapshot.python_stacks(parked, limit)
    assert native == reference and set(native) == set(parked)
    for ident, depth in zip(parked, (1, 10, 100)):
        lines = native[ident]
        # threading's 3, _outer (depth + 1 times), _inner, Event.wait, Condition.wait
        assert len(lines) == min(limit, depth + 7)
        assert lines[-1].endswith(" in wait") and "threading.py:" in lines[-1]  # innermost last
        if limit > 3:
            assert lines[-3] == f"{__file__}:{_inner.__code__.co_firstlineno + 3} in _inner"
        assert all(SECRET not in line for line in lines)


@needs_c
def test_unknown_threads_are_left_out_and_bad_arguments_raise(parked: list[int]) -> None:
    assert C is not None
    assert C.stacks([parked[0] + 1, 0], 64) == {}
    with pytest.raises(TypeError):
        C.stacks(7, 64)
    with pytest.raises(TypeError):
        C.stacks(parked, "64")


@pytest.mark.parametrize("collector_on", [True, False])
def test_reading_stacks_leaves_the_collector_as_it_was(parked: list[int], collector_on: bool) -> None:
    was = gc.isenabled()
    (gc.enable if collector_on else gc.disable)()
    try:
        assert snapshot.stacks(parked) and gc.isenabled() is collector_on
        assert snapshot.python_stacks(parked, 64) and gc.isenabled() is collector_on
    finally:
        (gc.enable if was else gc.disable)()


def test_only_threads_waiting_a_second_get_a_stack(parked: list[int]) -> None:
    assert snapshot.tables(read_torch=False)["stacks"] == {}  # nothing waits: no stack is read
    site = SimpleNamespace(src="worker0", method="step", attributes={})  # the fields a snapshot reads
    now = time.time_ns()
    old, young, _ = parked
    calls.serving.update({old: (site, "7", now - 2 * 10**9, 0), young: (site, "8", now, 0)})
    try:
        taken = snapshot.tables(read_torch=False)
    finally:
        calls.serving.clear()
    assert [s["call_id"] for s in taken["serving"]] == [7, 8]
    assert list(taken["stacks"]) == [str(old)] and taken["stacks"][str(old)][-3].endswith(" in _inner")
