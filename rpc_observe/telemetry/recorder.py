"""The flight recorder's telemetry half: its snapshot as JSON (`GET /debug/rpc`), its dump
files, and the watchdog that writes one when a call hangs. No torch here: the hooks give
the tables' contents (`hooks.snapshot`), as they give torch's state to the metrics.

A dump is `$RPC_OBSERVE_DIR/debug/<worker>-<pid>.json`, replaced atomically, written:
- by the watchdog, once per incident: when the oldest call in flight or UDF running gets
  older than RPC_OBSERVE_HANG_SECONDS (default 30 s, half torch's default RPC timeout, so
  the evidence is on disk before torch's timeout clears it), again only after that incident
  cleared;
- after a call fails with a timeout (at most one such dump every 10 s);
- when the process stops (rpc.shutdown(), exit, SIGTERM) with calls still in flight.
Dumps are written on the housekeeping thread or while closing, never on an RPC's thread.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from . import health

_logger = logging.getLogger("rpc_observe")
SCHEMA = "rpc_observe.debug/1"
REQUESTED_DUMP_INTERVAL_S = 10.0
# The hooks' part of a snapshot: agent, calls, serving, finished, stacks; torch's agent state only if the argument is
# True (see `read_torch`).
Tables = Callable[[bool], dict[str, Any]]
Oldest = Callable[[], tuple[float, str]]  # (age in s of the oldest call in flight or UDF running, what it is)


class FlightRecorder:
    """One worker's recorder: snapshots on demand, dumps on a hang, a timeout or an unclean stop."""

    def __init__(self, worker: str, rank: int | None, run_id: str, out_dir: str | None, hang_seconds: float,
                 tables: Tables, oldest: Oldest) -> None:
        self.worker, self.rank, self.run_id, self.hang_seconds = worker, rank, run_id, hang_seconds
        self.out_dir = out_dir
        self.path = os.path.join(out_dir, "debug", f"{worker}-{os.getpid()}.json") if out_dir is not None else None
        self._tables, self.oldest = tables, oldest
        self._requested: str | None = None
        self._in_incident = False
        self._next_check = 0.0
        self._last_requested_dump = -REQUESTED_DUMP_INTERVAL_S
        self._dump_lock = threading.Lock()
        # False once RPC stops: a call into torch's agent from the endpoint's thread while the interpreter
        # finalizes would end that thread inside torch's C++ frames, an abort (as for the scrape's gauges).
        self.read_torch = True

    def snapshot(self, reason: str = "live") -> dict[str, Any]:
        """The recorder's state now, in the documented schema (docs/stuck.md)."""
        head: dict[str, Any] = {
            "schema": SCHEMA, "worker": self.worker, "rank": self.rank, "pid": os.getpid(), "run_id": self.run_id,
            "host": socket.gethostname(), "time_unix_s": time.time(), "reason": reason,
            "hang_seconds": self.hang_seconds,
        }
        head.update(self._tables(self.read_torch))
        return head

    def json_bytes(self) -> bytes:
        return json.dumps(self.snapshot(), separators=(",", ":")).encode()

    def request_dump(self, reason: str) -> None:
        """Asks the housekeeping thread for a dump; safe on any thread, costs one store."""
        self._requested = reason

    def check(self) -> None:
        """The watchdog, run by every housekeeping pass; reads the tables at most once a second."""
        reason, self._requested = self._requested, None
        now = time.monotonic()
        if reason is not None and now - self._last_requested_dump >= REQUESTED_DUMP_INTERVAL_S:
            self._last_requested_dump = now
            path = self.dump(reason)
            if path is not None:
                _logger.warning("rpc_observe: an RPC of %s timed out; the flight recorder is in %s "
                                "(rpc-observe doctor %s)", self.worker, path, self.out_dir)
        if not self.hang_seconds or now < self._next_check:
            return
        self._next_check = now + min(1.0, self.hang_seconds / 4)
        age, what = self.oldest()
        if age < self.hang_seconds:
            self._in_incident = False
            return
        if self._in_incident:
            return
        self._in_incident = True
        path = self.dump("hang")
        _logger.warning("rpc_observe: %s has not completed after %.1f s (RPC_OBSERVE_HANG_SECONDS=%g); the flight "
                        "recorder is in %s: run `rpc-observe doctor %s` to see who waits on whom",
                        what, age, self.hang_seconds, path or "(no writable RPC_OBSERVE_DIR)", self.out_dir or "")

    def dump_if_calls_in_flight(self) -> None:
        """At rpc.shutdown(), exit or SIGTERM: the calls still in flight are about to be ended as failed."""
        age, what = self.oldest()
        if what:
            path = self.dump("exit")
            _logger.warning("rpc_observe: %s stopped with %s still in flight (%.1f s); the flight recorder is in %s",
                            self.worker, what, age, path or "(no writable RPC_OBSERVE_DIR)")

    def dump(self, reason: str) -> str | None:
        """Writes the snapshot to this worker's dump file; returns its path, or None if it could not."""
        if self.path is None:
            return None
        try:
            data = json.dumps(self.snapshot(reason), separators=(",", ":"))
            with self._dump_lock:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                tmp = f"{self.path}.tmp"
                with open(tmp, "w", encoding="utf-8") as f:
                    f.write(data)
                os.replace(tmp, self.path)
            return self.path
        except Exception:
            health.internal_error("recorder_dump")
            return None
