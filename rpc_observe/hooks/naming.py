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
# An RRef fetch (`RRef.to_here()`) is a C++ message with no Python function: this names it
# on the caller (its client call) and on the owner (the response it pickles).
RREF_FETCH = "RRef.to_here"


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


def _proxy_functions() -> frozenset[Any]:
    from torch.distributed.rpc import rref_proxy

    return frozenset((rref_proxy._local_invoke, rref_proxy._local_invoke_async_execution))


PROXY_FUNCTIONS = _proxy_functions()  # what RRef proxies (`rref.rpc_sync().f()`) send


def proxy_method(args: Any, local: bool) -> str | None:
    """`Type.method` that an RRef proxy call runs, from its UDF arguments `(rref, func_name, args, kwargs)`.

    `local`: the callee's owner RRef (its value is here); else the caller's, whose type the
    proxy has already fetched (never fetched here: that would be an RPC). None if unknown.
    """
    try:
        rref, func_name = args[0], args[1]
        if local:
            rref_type = type(rref.local_value())
        else:
            fut = rref._get_type(blocking=False)
            if not fut.done():
                return None
            rref_type = fut.value()
        return f"{rref_type.__qualname__}.{func_name}"
    except Exception:
        return None


def helper_target(args: Any) -> str | None:
    """The method a `_call_method(method, rref, *args)`-shaped helper runs (the PyTorch examples'
    pattern): its qualname, if the first argument is a function and the second an RRef."""
    try:
        method, rref = args[0], args[1]
    except (TypeError, IndexError, KeyError):
        return None
    if type(rref).__name__ != "PyRRef" or not callable(method):
        return None
    return getattr(method, "__qualname__", None)


# The modules of torch's RPC plumbing: init_rpc's all-gather, shutdown, RRef type queries,
# group membership. Work that torch does for the user (RRef proxies, DistributedOptimizer,
# RemoteModule) is not internal.
_PLUMBING = frozenset(("torch.distributed.rpc.api", "torch.distributed.rpc.internal", "torch.distributed.rpc._utils",
                       "torch.distributed.rpc.backend_registry", "torch.distributed.rpc.constants"))


def is_internal(func: Any) -> bool:
    """torch's own plumbing that the user did not ask for, never the user's work that torch carries."""
    return getattr(func, "__module__", None) in _PLUMBING


def is_proxy(func: Any) -> bool:
    try:
        return func in PROXY_FUNCTIONS
    except TypeError:  # unhashable
        return False


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
