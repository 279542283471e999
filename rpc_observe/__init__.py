"""rpc_observe: torch.profiler events, OpenTelemetry traces and Prometheus metrics for torch RPC.

Set ``RPC_OBSERVE=1`` in the environment of every worker (the installed
``rpc_observe.pth`` does the rest), or call :func:`instrument` before ``init_rpc``::

    import rpc_observe
    rpc_observe.instrument()
    rpc.init_rpc("worker0", rank=0, world_size=3)
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["instrument", "uninstrument", "__version__"]


def instrument() -> None:
    """Instruments torch.distributed.rpc in this process; call before init_rpc. Idempotent."""
    from .instrumentor import RpcObserveInstrumentor

    RpcObserveInstrumentor().instrument()


def uninstrument() -> None:
    """Restores every torch object rpc_observe replaced and stops its telemetry. Idempotent."""
    from .instrumentor import RpcObserveInstrumentor

    RpcObserveInstrumentor().uninstrument()
