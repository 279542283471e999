"""Start-up: the `rpc_observe.pth` hook and the post-import hook on torch.distributed.rpc.

The .pth line only reads RPC_OBSERVE; when it is set it calls `run()`, which installs
a finder that patches torch.distributed.rpc right after the module executes, before
any user code can call init_rpc. At that moment torch itself is half imported, so only
the rpc modules are touched.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
from collections.abc import Callable
from typing import Any

_logger = logging.getLogger("rpc_observe")


class _Loader(importlib.abc.Loader):
    def __init__(self, loader: Any, callback: Callable[[Any], None]) -> None:
        self._loader, self._callback = loader, callback

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def __getattr__(self, name: str) -> Any:  # get_source, get_resource_reader, ...: the real loader's
        return getattr(self._loader, name)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        try:
            self._callback(module)
        except Exception:
            from .telemetry import health

            health.internal_error("import_hook")


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, callback: Callable[[Any], None]):
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # fires once; also keeps the search below from recursing
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(fullname, path, target) if find_spec else None
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, self.callback)
                return spec
        return None


def on_import(name: str, callback: Callable[[Any], None]) -> None:
    """Calls callback(module) right after `name` is imported (now, if it already is)."""
    if name in sys.modules:
        callback(sys.modules[name])
        return
    cancel(name)
    sys.meta_path.insert(0, _PostImportFinder(name, callback))


def cancel(name: str) -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not (isinstance(f, _PostImportFinder) and f.name == name)]


_started = False


def run() -> None:
    """Called from rpc_observe.pth when RPC_OBSERVE is set in the environment.

    Some interpreters (pyenv-built venvs) process site-packages twice: run once.
    """
    global _started
    if _started:
        return
    _started = True
    try:
        from . import config

        if config.enabled():
            from . import instrument

            instrument()
    except Exception:
        _logger.warning("rpc_observe: start-up failed; torch RPC runs uninstrumented", exc_info=True)
