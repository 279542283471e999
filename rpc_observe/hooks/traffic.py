"""RPC traffic that never reaches the Python pickler, seen from its Python entry points.

- `RRef.to_here()` (`PyRRef.to_here`): a CLIENT span and client metrics on the caller,
  `rpc_to_here#RRef.to_here(caller -> owner)`; it blocks the user, its duration is what
  they wait for. Its response is named too: a Python value is unpickled on this thread
  (`local.fetch` tells the pickler whose it is); a tensor held as a TorchScript value never
  meets the pickler, and its storage bytes are counted here. A local RRef (this worker owns
  it) is no RPC and is left alone.
- `torch.distributed.autograd.backward`: an INTERNAL span with its duration and the
  workers the autograd context reached (`torch.rpc.dist_autograd.workers`, from torch).
- `DistributedOptimizer.step`: an INTERNAL span, parent of its per-worker
  `_local_optimizer_step` calls (the span is this thread's parent while it runs).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ..telemetry import health
from ..telemetry import runtime as _runtime
from ..telemetry.metrics import fold_message
from .calls import Call, end_raised, local
from .client import ClientSite
from .naming import RREF_FETCH
from .pickler import tensor_sizes

_time_ns = time.time_ns
TO_HERE = "to_here"


def _rref_fetch() -> None:
    """Stands for an RRef fetch in call-site keys and names: the fetch is a C++ message, no Python function."""


_rref_fetch.__qualname__ = RREF_FETCH


def _owner_name(rref: Any) -> str:
    try:
        return str(rref.owner_name())
    except Exception:
        return "unknown"


def wrap_to_here(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps `PyRRef.to_here(self, timeout=...)`."""

    def to_here(self: Any, *args: Any, **kwargs: Any) -> Any:
        runtime = _runtime.current
        call = None
        if runtime is not None:
            try:
                if not self.is_owner():
                    dst = _owner_name(self)
                    sites, key = runtime.client_sites, (_rref_fetch, TO_HERE, dst)
                    site = sites.get(key)
                    if site is None:
                        site = sites[key] = ClientSite(runtime, _rref_fetch, TO_HERE, dst)
                    call = Call(runtime, site)
            except Exception:
                health.internal_error("to_here_start")
        if call is None:
            return original(self, *args, **kwargs)
        # A Python value comes back pickled and is unpickled on this thread: the pickler names it.
        outer, local.fetch = getattr(local, "fetch", None), call.site
        try:
            value = original(self, *args, **kwargs)
        except BaseException as e:
            local.fetch = outer
            end_raised(call, e)
            raise
        unpickled = getattr(local, "fetch", None) is None  # the pickler counted the response
        local.fetch = outer
        try:
            if call.rf is not None:
                runtime.profiler.client_end(call.rf)  # type: ignore[union-attr]
            call.finish()
            site = call.site
            if site.record is not None and not unpickled and type(value) is torch.Tensor:
                # A tensor held as a TorchScript value (e.g. `RRef(tensor)`, a builtin's result) travels
                # without the pickler: count its storage as the response's bytes (the message's own
                # few bytes are not seen).
                logical, traveling = tensor_sizes([value])
                site.record((fold_message, site.response_cells, 0, 1, logical, traveling, 0.0, site.received,
                             traveling))
        except Exception:
            health.internal_error("to_here_end")
        return value

    return to_here


def _internal_span(name: str, attributes: Callable[[tuple[Any, ...]], dict[str, Any]] | None = None,
                   after: Callable[[Any, tuple[Any, ...]], None] | None = None
                   ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A wrapper factory: an INTERNAL span around the call, the parent of the RPCs it makes on this thread.

    `attributes(args)` gives the span's attributes (once per call: these are not per-RPC paths);
    `after(span, args)` adds what is known only at the end.
    """

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            runtime = _runtime.current
            tracer = runtime.tracer if runtime is not None else None
            if tracer is None:
                return original(*args, **kwargs)
            try:
                attrs = {"rpc.system": "torch_rpc", **(attributes(args) if attributes else {})}
                span = tracer.start_internal(name, attrs, _time_ns())
                token = tracer.attach(span)
            except Exception:
                health.internal_error("span_start")
                return original(*args, **kwargs)
            error: BaseException | None = None
            try:
                return original(*args, **kwargs)
            except BaseException as e:
                error = e
                raise
            finally:
                try:
                    tracer.detach(token)
                    if after is not None:
                        after(span, args)
                    tracer.end(span, _time_ns(), error)
                except Exception:
                    health.internal_error("span_end")

        return wrapper

    return make


def _backward_workers(span: Any, args: tuple[Any, ...]) -> None:
    """The workers the autograd context reached, as torch knows them."""
    import torch.distributed.autograd as dist_autograd

    try:
        context = dist_autograd._retrieve_context(args[0])
        workers = sorted(context._known_worker_ids())
    except Exception:
        return
    span.attributes = {**span.attributes, "torch.rpc.dist_autograd.workers": ",".join(map(str, workers))}


def _context_id_at(index: int) -> Callable[[tuple[Any, ...]], dict[str, Any]]:
    """The attributes of a call whose argument `index` is the distributed autograd context id."""

    def attributes(args: tuple[Any, ...]) -> dict[str, Any]:
        context_id = args[index] if len(args) > index else None
        return {"torch.rpc.dist_autograd.context_id": context_id} if isinstance(context_id, int) else {}

    return attributes


wrap_backward = _internal_span("dist_autograd.backward", _context_id_at(0), _backward_workers)
wrap_optimizer_step = _internal_span("DistributedOptimizer.step", _context_id_at(1))  # (self, context_id)
