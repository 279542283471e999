"""Replacing attributes of torch's modules and classes, and putting the originals back.

Each patch remembers the original object. `restore_all` puts back only attributes that
still hold our wrapper (like opentelemetry-instrumentation's `unwrap`), so a later
monkey patch by someone else is left alone.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

_logger = logging.getLogger("rpc_observe")
_applied: list[tuple[Any, str, Any, Any]] = []  # (owner, name, original, wrapper)


def patch(owner: Any, name: str, make_wrapper: Callable[[Any], Any]) -> None:
    """Replaces owner.name by make_wrapper(original); does nothing if already patched."""
    current = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name)
    if hasattr(current, "__rpc_observe_original__"):
        return
    wrapper = make_wrapper(current)
    functools.update_wrapper(wrapper, current)  # type: ignore[arg-type]
    wrapper.__rpc_observe_original__ = current
    setattr(owner, name, wrapper)
    _applied.append((owner, name, current, wrapper))


def share(owner: Any, name: str, source_owner: Any, source_name: str) -> None:
    """Makes owner.name the same wrapper as source_owner.source_name (a re-export)."""
    current = getattr(owner, name)
    wrapper = getattr(source_owner, source_name)
    if current is getattr(wrapper, "__rpc_observe_original__", None):
        setattr(owner, name, wrapper)
        _applied.append((owner, name, current, wrapper))


def restore_all() -> None:
    """Puts every original back, newest patch first."""
    while _applied:
        owner, name, current, wrapper = _applied.pop()
        now = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if now is wrapper:
            setattr(owner, name, current)
        else:
            _logger.warning(
                "rpc_observe: %s.%s was patched again by someone else; leaving it",
                getattr(owner, "__name__", owner),
                name,
            )
