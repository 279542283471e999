"""What an RPC is called: torch's method name and profiling key, and the span attributes.

Client and server sites both name a call from its function, the way torch's
`_enable_rpc_profiler` does, so that a span, a metric label and a profiler event of the
same call carry the same name on both workers.
"""

from __future__ import annotations

from typing import Any

import torch

_method_names: dict[Any, str] = {}
_MAX_CACHED = 10_000


def method_name(func: Any) -> str:
    """The name torch puts in the profiling key (cached: the callee asks for every request)."""
    try:
        return _method_names[func]
    except (KeyError, TypeError):
        pass
    name = _method_name(func)
    try:
        if len(_method_names) > _MAX_CACHED:
            _method_names.clear()
        _method_names[func] = name
    except TypeError:  # an unhashable callable
        pass
    return name


def _method_name(func: Any) -> str:
    """Builtin, TorchScript or Python qualname, as torch's `_enable_rpc_profiler` picks it."""
    builtin = torch.jit._builtins._find_builtin(func)
    if builtin is not None:
        return builtin
    if isinstance(func, torch.jit.ScriptFunction):
        return torch._jit_internal._qualified_name(func)
    return getattr(func, "__qualname__", None) or type(func).__qualname__


def is_internal(func: Any) -> bool:
    """torch's own RPCs (init_rpc's all-gather, shutdown, RRef type queries)."""
    return (getattr(func, "__module__", None) or "").startswith("torch.distributed")


def profiling_key(mode: str, method: str, src: str, dst: str) -> str:
    """torch's key, as `internal._build_rpc_profiling_key` builds it."""
    return f"rpc_{mode}#{method}({src} -> {dst})"


def span_attributes(method: str, src: str, dst: str, mode: str, key: str, internal: bool) -> dict[str, Any]:
    """The attributes every span of one call site shares (OpenTelemetry's RPC conventions first)."""
    return {
        "rpc.system": "torch_rpc", "rpc.system.name": "torch_rpc", "rpc.method": method,
        "torch.rpc.src": src, "torch.rpc.dst": dst, "torch.rpc.exec_mode": mode,
        "torch.rpc.profiling_key": key, "torch.rpc.internal": internal,
    }
