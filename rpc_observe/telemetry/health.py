"""The add-on's own health: errors it caught in its own code, and spans it dropped.

The wrappers catch every exception raised by rpc_observe's code and count it here,
so that telemetry can never break a user's RPC. The first error of each kind is also
logged, with its traceback, so that it can be reported. Dropped spans are counted by reason.
"""

from __future__ import annotations

import logging
import threading

_logger = logging.getLogger("rpc_observe")
_lock = threading.Lock()
internal_errors: dict[str, int] = {}
# Why spans were dropped: the export queue was full, an exporter failed, the shutdown flush timed out,
# a span file was deleted past RPC_OBSERVE_SPANS_MAX_BYTES, or a span file could not be written.
SPAN_DROP_REASONS = ("queue_full", "export_failed", "timeout", "disk_cap", "disk_error")
spans_dropped: dict[str, int] = dict.fromkeys(SPAN_DROP_REASONS, 0)
invalid_contexts = [0]
metric_exports_failed = [0]  # OTLP metric pushes that failed (OTEL_METRICS_EXPORTER=otlp)


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


def spans_lost(count: int, reason: str) -> None:
    """Counts `count` spans dropped for `reason`, one of SPAN_DROP_REASONS."""
    with _lock:
        spans_dropped[reason] += count


def invalid_context() -> None:
    with _lock:
        invalid_contexts[0] += 1


def metric_export_failed() -> None:
    with _lock:
        metric_exports_failed[0] += 1
