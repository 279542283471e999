"""The wrapped `_run_function` with the pool threads' thread states kept (hooks/thread_states.py): the UDF runs in
a new, empty contextvars context, as on a new thread state, whose changes do not outlive it, and torch's result
and errors pass as they are; with the setting off, it runs in the thread's context, as before. The Python
wrapper is the reference of the C Hook (the `codec` fixture runs both). The thread states themselves are kept
and checked on real workers: tests/test_thread_states_e2e.py."""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from typing import Any

import pytest
from torch.distributed.rpc.internal import PythonUDF

from rpc_observe.hooks import server, thread_states
from rpc_observe.telemetry import health, runtime

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("test_thread_states")


def noop() -> None:
    pass


@pytest.fixture
def keeping() -> Iterator[None]:
    thread_states.configure(True)
    yield
    thread_states.configure(False)  # as at import: a runtime's attach sets it from its config


def _body(seen: list[str | None], result: Any = "ran") -> Any:
    def body(python_udf: Any) -> Any:
        seen.append(VAR.get(None))
        VAR.set("set by the UDF")
        if isinstance(result, BaseException):
            raise result
        return result

    return body


def test_a_udf_starts_in_an_empty_context_and_leaves_nothing(codec: str, metrics_runtime: runtime.Runtime,
                                                             keeping: None) -> None:
    token = VAR.set("the thread's")
    try:
        seen: list[str | None] = []
        udf = PythonUDF(noop, (), {})
        assert server.wrap_run_function(_body(seen))(udf) == "ran"
        error = ValueError("the UDF's own")
        with pytest.raises(ValueError) as raised:
            server.wrap_run_function(_body(seen, error))(udf)
        assert raised.value is error
        assert seen == [None, None]  # empty at the start of each run, as on a new thread state
        assert VAR.get() == "the thread's"  # what a run set ended with it
        assert health.internal_errors == {}
    finally:
        VAR.reset(token)


def test_off_a_udf_runs_in_the_threads_context(codec: str, metrics_runtime: runtime.Runtime) -> None:
    thread_states.configure(False)
    token = VAR.set("the thread's")
    try:
        seen: list[str | None] = []
        assert server.wrap_run_function(_body(seen))(PythonUDF(noop, (), {})) == "ran"
        assert seen == ["the thread's"] and VAR.get() == "set by the UDF"
    finally:
        VAR.reset(token)
