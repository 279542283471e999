"""torch's own RPC state, read at scrape time for the metrics (never on the hot path)."""

from __future__ import annotations

from typing import Any


def agent_debug_info() -> dict[str, Any]:
    """The RPC agent's debug info (thread pool, active calls, GIL wait); raises before init_rpc."""
    from torch.distributed.rpc import api

    return api._get_current_rpc_agent().get_debug_info()
