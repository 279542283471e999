"""The add-on's own health: errors it caught in its own code, and spans it dropped.

The wrappers catch every exception raised by rpc_observe's code and count it here,
so that telemetry can never break a user's RPC. The first error of each kind is also
logged, with its traceback, so that it can be reported.
"""

from __future__ import annotations

import logging
import threading

_logger = logging.getLogger("rpc_observe")
_lock = threading.Lock()
internal_errors: dict[str, int] = {}
spans_dropped = [0]
invalid_contexts = [0]


def internal_error(where: str) -> None:
    """Counts an exception caught in rpc_observe's own code; call from an except block."""
    with _lock:
        first = where not in internal_errors
        internal_errors[where] = internal_errors.get(where, 0) + 1
    if first:
        _logger.warning(
            "rpc_observe: internal error in %s (counted in rpc_observe_internal_errors_total; the RPC is unaffected)",
            where,
            exc_info=True,
        )


def spans_lost(count: int) -> None:
    with _lock:
        spans_dropped[0] += count


def invalid_context() -> None:
    with _lock:
        invalid_contexts[0] += 1
