"""A self-check of every torch object the hooks rely on, before any of them is patched.

The hooks wrap private torch internals (`_InternalRPCPickler`, `_run_function`,
`api._invoke_rpc`, ...). A torch release that renames one, or changes the parameters a
wrapper passes on, must not leave torch half patched: each group is checked as a whole
first, and if anything differs, one warning names the torch version and the objects, and
nothing of that group is touched. The RPC group is checked when torch.distributed.rpc is
imported (torch itself is half initialised then: only rpc modules are read), the profiler
group when the runtime starts.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

_logger = logging.getLogger("rpc_observe")
# (what, how to get it, the leading parameter names the wrapper passes on, or None: only callable)
Expectation = tuple[str, Callable[[], Any], tuple[str, ...] | None]


def _rpc_expectations() -> list[Expectation]:
    import torch.distributed.rpc as rpc
    from torch.distributed.rpc import api, internal, rref_proxy

    pickler = internal._InternalRPCPickler
    return [
        ("torch.distributed.rpc.internal._InternalRPCPickler.serialize", lambda: pickler.serialize, ("self", "obj")),
        ("torch.distributed.rpc.internal._InternalRPCPickler.deserialize", lambda: pickler.deserialize,
         ("self", "binary_data", "tensor_table")),
        ("torch.distributed.rpc.internal._run_function", lambda: internal._run_function, ("python_udf",)),
        ("torch.distributed.rpc.internal.PythonUDF", lambda: internal.PythonUDF, ("func", "args", "kwargs")),
        ("torch.distributed.rpc.internal.RemoteException", lambda: internal.RemoteException,
         ("msg", "exception_type")),
        ("torch.distributed.rpc.api._invoke_rpc", lambda: api._invoke_rpc, ("to", "func", "rpc_type")),
        ("torch.distributed.rpc.api.remote", lambda: api.remote, ("to", "func")),
        ("torch.distributed.rpc.api.rpc_async", lambda: api.rpc_async, ("to", "func")),
        ("torch.distributed.rpc.api.shutdown", lambda: api.shutdown, None),
        ("torch.distributed.rpc.api._to_worker_info", lambda: api._to_worker_info, None),
        ("torch.distributed.rpc.api._get_current_rpc_agent", lambda: api._get_current_rpc_agent, None),
        ("torch.distributed.rpc.api._is_current_rpc_agent_set", lambda: api._is_current_rpc_agent_set, None),
        ("torch.distributed.rpc.init_rpc", lambda: rpc.init_rpc, ("name",)),
        ("torch.distributed.rpc.rref_proxy._invoke_rpc", lambda: rref_proxy._invoke_rpc,
         ("rref", "rpc_api", "func_name", "timeout")),
        # rref_proxy tells async proxies apart by `rpc_api is rpc_async`: the name must be api's object.
        ("torch.distributed.rpc.rref_proxy.rpc_async", lambda: _same(rref_proxy.rpc_async, api.rpc_async), None),
    ]


def _profiler_expectations() -> list[Expectation]:
    import torch

    profile = torch.autograd.profiler.profile
    return [
        ("torch.autograd.profiler.profile._start_trace", lambda: profile.__dict__["_start_trace"], ("self",)),
        ("torch.autograd.profiler.profile.export_chrome_trace", lambda: profile.__dict__["export_chrome_trace"],
         ("self", "path")),
        ("torch.autograd.profiler.record_function._call_end_callbacks_on_future",
         lambda: torch.autograd.profiler.record_function._call_end_callbacks_on_future, ("self", "fut")),
        ("torch.autograd._profiler_enabled", lambda: torch.autograd._profiler_enabled, None),
        ("torch._C._autograd._profiler_type", lambda: torch._C._autograd._profiler_type, None),
        ("torch._C._profiler.ActiveProfilerType.LEGACY",
         lambda: _callable(torch._C._profiler.ActiveProfilerType.LEGACY), None),
    ]


def _traffic_expectations() -> list[Expectation]:
    import torch.distributed.autograd as dist_autograd
    from torch._C._distributed_rpc import PyRRef

    return [
        ("torch._C._distributed_rpc.PyRRef.to_here", lambda: PyRRef.__dict__["to_here"], None),
        ("torch._C._distributed_rpc.PyRRef.is_owner", lambda: PyRRef.is_owner, None),
        ("torch._C._distributed_rpc.PyRRef.owner_name", lambda: PyRRef.owner_name, None),
        ("torch.distributed.autograd.backward", lambda: dist_autograd.backward, None),
        ("torch.distributed.autograd._retrieve_context", lambda: dist_autograd._retrieve_context, None),
    ]


def _optimizer_expectations() -> list[Expectation]:
    from torch.distributed.optim import DistributedOptimizer  # only once the job has imported it

    return [("torch.distributed.optim.DistributedOptimizer.step", lambda: DistributedOptimizer.step,
             ("self", "context_id"))]


_GROUPS = {"rpc": _rpc_expectations, "profiler": _profiler_expectations, "traffic": _traffic_expectations,
           "optimizer": _optimizer_expectations}


def _same(a: Any, b: Any) -> Any:
    if a is not b:
        raise TypeError("is not torch.distributed.rpc.api.rpc_async")
    return a


def _callable(value: Any) -> Callable[[], Any]:
    return lambda: value


def _problem(getter: Callable[[], Any], parameters: tuple[str, ...] | None) -> str | None:
    """What is wrong with the object, or None."""
    try:
        obj = getter()
    except Exception as e:  # missing attribute, changed identity
        return f"{type(e).__name__}: {e}"
    if not callable(obj):
        return "is not callable"
    if parameters is None:
        return None
    try:
        names = tuple(inspect.signature(obj).parameters)
    except (TypeError, ValueError):  # a C function without a signature: callable is all we can tell
        return None
    if names[: len(parameters)] != parameters:
        return f"takes ({', '.join(names)}), expected ({', '.join(parameters)}, ...)"
    return None


def check(group: str, expectations: list[Expectation] | None = None) -> bool:
    """True if every object of `group` (rpc, profiler, traffic, optimizer) is as the hooks expect; else warns once."""
    try:
        if expectations is None:
            expectations = _GROUPS[group]()
    except Exception as e:
        problems = [f"torch {group} modules: {type(e).__name__}: {e}"]
    else:
        problems = [f"{what} {problem}" for what, getter, parameters in expectations
                    if (problem := _problem(getter, parameters)) is not None]
    if problems:
        _logger.warning("rpc_observe: torch %s differs from what rpc_observe hooks (%s): %s. %s",
                        _torch_version(), TESTED, "; ".join(problems), _CONSEQUENCE[group])
    return not problems


TESTED = "tested with torch 2.13.0 and 2.14.1"
_CONSEQUENCE = {
    "rpc": "Nothing of torch is patched; torch RPC runs uninstrumented.",
    "profiler": "torch's profiler is left unpatched and profiler events are off; spans and metrics go on.",
    "traffic": "RRef.to_here and dist_autograd.backward are left unpatched (unseen).",
    "optimizer": "DistributedOptimizer.step is left unpatched (unseen).",
}


def _torch_version() -> str:
    try:
        import torch

        return torch.__version__
    except Exception:
        return "(unknown version)"
