"""torch's own RPC state, read at scrape time for the metrics (never on the hot path)."""

from __future__ import annotations

from typing import Any


def agent_debug_info() -> dict[str, Any]:
    """The RPC agent's debug info (thread pool, active calls, GIL wait); raises before init_rpc."""
    from torch.distributed.rpc import api

    return api._get_current_rpc_agent().get_debug_info()


# torch's debug counters, as (metric name, source, key); read at scrape time, declared in telemetry.declarations.
DEBUG_GAUGES = (
    ("torch_rpc_rref_owners", "rref", "num_owner_rrefs"),
    ("torch_rpc_rref_pending_users", "rref", "num_pending_users"),
    ("torch_rpc_rref_forks", "rref", "num_forks"),
    ("torch_rpc_rref_pending_futures", "rref", "num_pending_futures"),
    ("torch_rpc_dist_autograd_contexts", "autograd", "num_autograd_contexts"),
    ("torch_rpc_dist_autograd_backward_passes", "autograd", "num_current_backward_passes"),
)


def debug_state() -> list[tuple[str, float]]:
    """(metric name, value) of torch's RRef and distributed autograd debug info."""
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc

    sources: dict[str, dict[str, Any]] = {}
    try:
        sources["rref"] = rpc._rref_context_get_debug_info()
    except Exception:  # no RRef context (before init_rpc, after shutdown)
        pass
    try:
        sources["autograd"] = dist_autograd._get_debug_info()
    except Exception:
        pass
    found = []
    for name, source, key in DEBUG_GAUGES:
        value = sources.get(source, {}).get(key)
        if value is not None:
            found.append((name, float(value)))
    return found
