"""The torch hooks: everything that imports torch and runs for every RPC.

`client` (rpc_sync, rpc_async, remote), `pickler` (every message), `server` (every
Python UDF) and `profiler_events` feed `rpc_observe.telemetry`; `calls` is the life of
one client call, `trailer` the bytes that carry it between workers. Imports flow one
way: hooks -> telemetry, never back.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..telemetry.runtime import Runtime


def attach(runtime: Runtime) -> None:
    """Gives a new runtime what needs torch: the call sweep, the flight recorder, torch's debug state,
    profiler events, the pool threads' kept thread states."""
    from ..telemetry.recorder import FlightRecorder
    from . import calls, compat, snapshot, thread_states, torch_state, trailer

    config = runtime.config
    thread_states.configure(config.keep_thread_states)
    if calls.finished.maxlen != config.recorder_size:
        calls.finished.resize(config.recorder_size)
    runtime.recorder = FlightRecorder(runtime.worker, runtime.rank, runtime.run_id, runtime.out_dir,
                                      config.hang_seconds, snapshot.tables, snapshot.oldest)
    runtime.add_housekeeping(calls.sweep)
    runtime.add_closing(runtime.recorder.dump_if_calls_in_flight)  # first: before the calls are ended
    runtime.add_closing(calls.end_unfinished)
    if runtime.metrics is not None and trailer.core is not None:  # the queue and fold in C (references: metrics.py)
        runtime.metrics.use_queue(trailer.core.Records())
        runtime.metrics.fold_records = trailer.core.fold
    if runtime.tracer is not None and trailer.core is not None:  # the SERVER span by thread in C (reference: a dict)
        runtime.tracer.serving = trailer.core.serving_spans
    if runtime.metrics is not None and runtime.state is not None:
        runtime.metrics.agent_info = torch_state.agent_debug_info
        runtime.state.source = lambda: snapshot.age_gauges(config.hang_seconds) + torch_state.debug_state()
    if compat.check("traffic"):
        _patch_traffic()
    if (config.profiler_events or config.profile) and compat.check("profiler"):
        from .profiler_events import ProfilerEvents

        runtime.profiler = ProfilerEvents(runtime.worker, runtime.run_id)
        runtime.profiler.patch_profiler()
    if config.profile and runtime.out_dir is not None and runtime.profiler is not None:
        from .profiler_events import ProfileSession

        path = os.path.join(runtime.out_dir, "profiler", f"{runtime.worker}.json")
        runtime.profile_session = ProfileSession(path, runtime.worker, runtime.rank, runtime.world_size,
                                                 config.profile_max_seconds)


OPTIM_MODULE = "torch.distributed.optim"


def _patch_traffic() -> None:
    """The entry points of traffic the pickler never sees (hooks/traffic.py): patched at init_rpc,
    when torch is fully imported. torch.distributed.optim costs ~50 MB of RSS to import: it is
    patched when the job imports it, never imported here."""
    import torch.distributed.autograd as dist_autograd
    from torch._C._distributed_rpc import PyRRef

    from .. import _bootstrap, _patching
    from . import traffic

    _patching.patch(PyRRef, "to_here", traffic.wrap_to_here)
    _patching.patch(dist_autograd, "backward", traffic.wrap_backward)
    _bootstrap.on_import(OPTIM_MODULE, _patch_optimizer)


def _patch_optimizer(optim: Any) -> None:
    from . import compat

    if compat.check("optimizer"):
        from .. import _patching
        from . import traffic

        _patching.patch(optim.DistributedOptimizer, "step", traffic.wrap_optimizer_step)
