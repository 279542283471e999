"""Patching torch.distributed.rpc, and putting it back exactly as it was.

`RpcObserveInstrumentor` follows opentelemetry-instrumentation's `BaseInstrumentor`
(a flag, `_instrument` / `_uninstrument`, safe to call twice), and is registered as an
`opentelemetry_instrumentor` entry point for `opentelemetry-instrument`.
If torch.distributed.rpc is not imported yet, patching waits for its import (a
post-import hook), so a process that never imports torch never pays for it.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Collection
from typing import Any

from . import _bootstrap, _patching, config
from .hooks import log_correlation
from .telemetry import health
from .telemetry import runtime as _runtime

_logger = logging.getLogger("rpc_observe")
RPC_MODULE = "torch.distributed.rpc"


def _patch_rpc(rpc: Any = None) -> None:
    """Wraps the client calls, the pickler, the UDF runner, init_rpc and shutdown of `rpc`."""
    from .hooks import compat

    if not compat.check("rpc"):  # all or nothing: a changed torch is never half patched
        return
    from torch.distributed.rpc import api, internal

    from .hooks import client, pickler, server

    rpc = rpc if rpc is not None else sys.modules[RPC_MODULE]
    _patching.patch(api, "_invoke_rpc", client.wrap_invoke_rpc)
    _patching.patch(api, "remote", client.wrap_remote)
    _patching.share(rpc, "remote", api, "remote")
    _patching.patch(internal, "_run_function", server.wrap_run_function)
    _patching.patch(internal._InternalRPCPickler, "serialize", pickler.wrap_serialize)
    _patching.patch(internal._InternalRPCPickler, "deserialize", pickler.wrap_deserialize)
    _patching.patch(rpc, "init_rpc", _wrap_init_rpc)
    _patching.patch(api, "shutdown", _wrap_shutdown)
    _patching.share(rpc, "shutdown", api, "shutdown")


def _start(worker: str, rank: int | None, world_size: int | None = None) -> None:
    """Starts this process's telemetry, with the hooks' torch-side parts attached."""
    from . import hooks

    _runtime.start(_Settings.get(), worker, rank, world_size, setup=hooks.attach)


def _wrap_init_rpc(original: Callable[..., Any]) -> Callable[..., Any]:
    def init_rpc(name: Any, *args: Any, **kwargs: Any) -> Any:
        # Telemetry first: torch's init_rpc already makes (and serves) RPCs.
        try:
            rank = kwargs.get("rank", args[1] if len(args) > 1 else -1)
            world_size = kwargs.get("world_size", args[2] if len(args) > 2 else None)
            _start(
                str(name), rank if isinstance(rank, int) else None, world_size if isinstance(world_size, int) else None
            )
        except Exception:
            health.internal_error("init_rpc")
        result = original(name, *args, **kwargs)
        if _Settings.get().gil_profiling:
            try:  # the agent then reports its threads' GIL wait: torch_rpc_agent_gil_wait_seconds
                import torch.distributed.rpc as rpc

                rpc.enable_gil_profiling(True)
            except Exception:
                health.internal_error("gil_profiling")
        return result

    return init_rpc


def _wrap_shutdown(original: Callable[..., Any]) -> Callable[..., Any]:
    def shutdown(*args: Any, **kwargs: Any) -> Any:
        runtime = _runtime.current
        result = original(*args, **kwargs)
        if runtime is not None:  # shutdown makes RPCs too: end what is left and flush after it returns
            try:
                runtime.stopping()
                runtime.flush()
                runtime.finish_profile()
            except Exception:
                health.internal_error("shutdown")
        return result

    return shutdown


class _Settings:
    """The Config of this process, read once, when instrumentation starts."""

    value: config.Config | None = None

    @classmethod
    def get(cls) -> config.Config:
        if cls.value is None:
            cls.value = config.load()
        return cls.value


def _agent_running() -> bool:
    try:
        from torch.distributed.rpc import api

        return api._is_current_rpc_agent_set()
    except Exception:
        return False


class RpcObserveInstrumentor:
    """Instruments torch.distributed.rpc; `instrument()` and `uninstrument()` are idempotent."""

    _lock = threading.Lock()
    _instrumented = False

    def instrumentation_dependencies(self) -> Collection[str]:
        return ("torch >= 2.13",)

    def instrument(self, **kwargs: Any) -> None:
        with self._lock:
            if RpcObserveInstrumentor._instrumented:
                _logger.debug("rpc_observe: already instrumented")
                return
            self._instrument(**kwargs)
            RpcObserveInstrumentor._instrumented = True

    def uninstrument(self, **kwargs: Any) -> None:
        with self._lock:
            if not RpcObserveInstrumentor._instrumented:
                return
            self._uninstrument(**kwargs)
            RpcObserveInstrumentor._instrumented = False

    def _instrument(self, **kwargs: Any) -> None:
        if _Settings.get().log_correlation:  # before any user code logs: a format string naming the ids never raises
            log_correlation.install()
        if RPC_MODULE not in sys.modules:
            _bootstrap.on_import(RPC_MODULE, _patch_rpc)
            return
        _patch_rpc()
        if _agent_running():
            from torch.distributed.rpc import api

            _logger.warning(
                "rpc_observe: instrument() was called after init_rpc: client calls are observed, "
                "but server-side spans and metrics need instrument() (or RPC_OBSERVE=1) before init_rpc"
            )
            info = api.get_worker_info()
            _start(info.name, info.id)

    def _uninstrument(self, **kwargs: Any) -> None:
        _bootstrap.cancel(RPC_MODULE)
        _bootstrap.cancel("torch.distributed.optim")  # the hooks' post-import hook for DistributedOptimizer
        _patching.restore_all()
        log_correlation.uninstall()
        _runtime.stop()
