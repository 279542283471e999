"""The hooks' C modules (built by hatch_build.py where a C compiler works): used where built, unless
RPC_OBSERVE_NO_EXTENSIONS=1 asks for their Python references, which CI runs too."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

NO_EXTENSIONS = "RPC_OBSERVE_NO_EXTENSIONS"  # config.py validates its value and says what it accepts


def extensions_off() -> bool:
    return os.environ.get(NO_EXTENSIONS, "").strip().lower() in ("1", "true", "yes", "on")


def load(name: str) -> ModuleType | None:
    """`rpc_observe.hooks.<name>`, or None: not built here, or switched off."""
    if extensions_off():
        return None
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except ImportError:
        return None
