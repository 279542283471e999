"""rpc_observe: torch.profiler events, OpenTelemetry traces and Prometheus metrics for torch RPC.

Set ``RPC_OBSERVE=1`` in the environment of every worker (the installed
``rpc_observe.pth`` does the rest), or call :func:`instrument` before ``init_rpc``::

    import rpc_observe
    rpc_observe.instrument()
    rpc.init_rpc("worker0", rank=0, world_size=3)
"""

from __future__ import annotations

import os
import sys

__version__ = "0.1.0"
__all__ = ["instrument", "uninstrument", "hot_path", "__version__"]


def _use_finders(python_only: bool) -> None:
    """A finder per package directory that imports a compiled module (hatch_build.py) only when
    it is wanted and not older than its .py file (a stale in-place build would run old code)."""
    from importlib.machinery import (
        BYTECODE_SUFFIXES,
        EXTENSION_SUFFIXES,
        SOURCE_SUFFIXES,
        ExtensionFileLoader,
        FileFinder,
        SourceFileLoader,
        SourcelessFileLoader,
    )

    python = ((SourceFileLoader, SOURCE_SUFFIXES), (SourcelessFileLoader, BYTECODE_SUFFIXES))

    class Finder(FileFinder):
        def find_spec(self, fullname: str, target: object = None):  # type: ignore[no-untyped-def]
            spec = super().find_spec(fullname, target)  # type: ignore[arg-type]
            if spec is None or not isinstance(spec.loader, ExtensionFileLoader) or spec.origin is None:
                return spec
            source = os.path.join(self.path, fullname.rpartition(".")[2] + ".py")
            try:
                stale = os.path.getmtime(source) > os.path.getmtime(spec.origin)
            except OSError:
                stale = False
            if stale:
                import logging

                logging.getLogger("rpc_observe").warning(
                    "rpc_observe: %s is older than %s: the .py file is imported (rebuild: python hatch_build.py)",
                    spec.origin, source)
            return FileFinder(self.path, *python).find_spec(fullname, target) if stale else spec  # type: ignore

    loaders = python if python_only else ((ExtensionFileLoader, EXTENSION_SUFFIXES), *python)
    root = os.path.dirname(__file__)
    for path in [root] + [os.path.join(root, d) for d in os.listdir(root)
                          if os.path.isfile(os.path.join(root, d, "__init__.py"))]:
        sys.path_importer_cache[path] = Finder(path, *loaders)


def _python_only_asked() -> bool:
    """RPC_OBSERVE_NO_EXTENSIONS, read here (not in config): it must act before any module is imported."""
    value = os.environ.get("RPC_OBSERVE_NO_EXTENSIONS", "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value not in ("", "0", "false", "no", "off"):
        import logging

        logging.getLogger("rpc_observe").warning(
            "rpc_observe: RPC_OBSERVE_NO_EXTENSIONS=%r is not a flag (1/true/yes/on or 0/false/no/off): "
            "the compiled modules are used", value)
    return False


_use_finders(python_only=_python_only_asked())


def hot_path() -> str:
    """`compiled` if the per-RPC modules run as C extensions (built with the wheel), else `python`."""
    from importlib.util import find_spec

    spec = find_spec("rpc_observe.telemetry.tracing")  # compiled with the hooks; imports no torch
    origin = spec.origin if spec is not None else None
    return "compiled" if origin and not origin.endswith((".py", ".pyc")) else "python"


def instrument() -> None:
    """Instruments torch.distributed.rpc in this process; call before init_rpc. Idempotent."""
    from .instrumentor import RpcObserveInstrumentor

    RpcObserveInstrumentor().instrument()


def uninstrument() -> None:
    """Restores every torch object rpc_observe replaced and stops its telemetry. Idempotent."""
    from .instrumentor import RpcObserveInstrumentor

    RpcObserveInstrumentor().uninstrument()
