"""torch's RPC pool threads keep their Python thread state (hooks/thread_states.py), on two real workers: a
`threading.local` on a pool thread keeps its values from one call to the next, a UDF still starts in an empty
`contextvars` context, and with the add-on off or RPC_OBSERVE_KEEP_THREAD_STATES=0 torch is as it is alone."""

from __future__ import annotations

import pytest

from cluster import Cluster

KEPT = {
    "on": {"RPC_OBSERVE": "1"},
    "on, pure Python": {"RPC_OBSERVE": "1", "RPC_OBSERVE_NO_EXTENSIONS": "1"},
}
NOT_KEPT = {
    "off": {"RPC_OBSERVE": "0"},
    "on, not kept": {"RPC_OBSERVE": "1", "RPC_OBSERVE_KEEP_THREAD_STATES": "0"},
}


def _run(tmp_path, env):
    return Cluster(tmp_path, "thread_states", world=2, env=env).wait()[0]


@pytest.mark.parametrize("env", KEPT.values(), ids=KEPT.keys())
def test_kept_thread_states_keep_thread_locals_and_not_contexts(tmp_path, env):
    result = _run(tmp_path, env)
    for where, calls in (("served", 250), ("callbacks", 100)):
        visits = result[where]
        assert visits["calls"] == calls
        # Each pool thread's first visit finds nothing; every later one finds the visits before it.
        assert visits["seen_before"] == calls - visits["inline"] - visits["threads"], (where, visits)
        assert 0 < visits["threads"] < calls // 4 and visits["inline"] < calls // 2, (where, visits)
    assert result["served"]["leaked"] == 0  # every UDF starts in an empty context, as on a new thread state
    # (done-callbacks share their thread's context, as on any Python thread: docs/hooks.md, not asserted)


@pytest.mark.parametrize("env", NOT_KEPT.values(), ids=NOT_KEPT.keys())
def test_without_it_every_call_gets_a_new_thread_state(tmp_path, env):
    result = _run(tmp_path, env)
    for where in ("served", "callbacks"):
        assert result[where]["seen_before"] == 0, (where, result[where])
        assert result[where]["leaked"] == 0
