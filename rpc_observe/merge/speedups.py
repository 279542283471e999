"""The merge's two per-span loops in C (``_speedups.c``), when they are built.

``C`` is the compiled module, configured for :class:`~.model.Span`, or None:
not built (no C compiler at install), or switched off with
``RPC_OBSERVE_MERGE_SPEEDUPS=0``.  Everything it does, the Python code does
too, and gives the same result (tests/unit/test_merge_speedups.py); the C
code does the common case and hands every other span back.
"""

from __future__ import annotations

import dataclasses
import os
from types import ModuleType

from .model import Span

ENV = "RPC_OBSERVE_MERGE_SPEEDUPS"


def bad_switch() -> str | None:
    """What is wrong with ``RPC_OBSERVE_MERGE_SPEEDUPS`` (the C loops then stay on), or None; said once, by the CLI."""
    value = os.environ.get(ENV, "").strip()
    if value in ("", "0", "1"):
        return None
    return f"{ENV}={value!r} is not 0 (pure Python) or 1 (the C loops, where built); using 1"


def _load() -> ModuleType | None:
    if os.environ.get(ENV, "").strip() == "0" or os.environ.get(
            "RPC_OBSERVE_NO_EXTENSIONS", "").strip().lower() in ("1", "true", "yes", "on"):  # as hooks/native.py
        return None
    try:
        from . import _speedups
    except ImportError:
        return None
    fields = tuple(f.name for f in dataclasses.fields(Span))
    try:
        _speedups.configure_span(Span, fields, Span("", "", "", "", 0, 0, 0, "", {}))
    except (TypeError, ValueError):  # built from another version of this code: pure Python
        return None
    return _speedups


C = _load()
