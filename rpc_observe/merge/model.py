"""The records ``rpc-observe merge`` passes from reading its inputs to laying
out the merged timeline, and the two ways an input file is turned away."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KIND_SERVER, KIND_CLIENT = 2, 3  # OTLP SpanKind values


class BadInput(Exception):
    """An input file that cannot be used; ``str(exc)`` is the reason."""


class IgnoredInput(Exception):
    """A file rpc_observe itself writes that is not merge input (a previous
    merge's output, a Prometheus file_sd target); ``str(exc)`` says which."""


def json_error(e: json.JSONDecodeError, text: str) -> str:
    """The :class:`BadInput` reason for ``text`` failing to parse: a file cut
    short (a worker killed mid-write) is told apart from a malformed one."""
    if e.pos >= len(text.rstrip()) or e.msg.startswith("Unterminated string"):
        return f"truncated JSON (document ends after {len(text.encode())} bytes)"
    return f"invalid JSON ({e.msg} at line {e.lineno} column {e.colno})"


@dataclass(slots=True)
class Span:
    """One OTLP span; times are its worker's own wall clock, in ns.  ``attrs``
    is shared by the spans of one call site (same name, kind and status), and
    by nothing else: never mutate it.  Ids are lower-case hex, or JSON-escaped."""

    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: int
    start_ns: int
    end_ns: int
    worker: str
    attrs: dict[str, Any]
    status_code: int = 0
    status_message: str = ""
    events: list[dict[str, Any]] | tuple = ()
    # Set as it is laid out: its lane's thread id, and its RPC pair's number (-1: unpaired).
    tid: int = 0
    pair: int = -1


@dataclass
class TraceInput:
    """One profiler trace, scanned but not yet converted.  ``worker`` is set
    once every input is known (the hints may point at a span file's worker)."""

    path: Path
    data: dict[str, Any]
    base_ns: int
    worker_hint: str | None
    pid_hint: int | None
    main_pid: int | None
    run_id: str | None
    rank: int | None
    min_ts: float | None
    worker: str = ""


@dataclass
class SpanInput:
    """One worker's span stream: its span file and the rotated older ones, read
    oldest first as one stream (or a whole-document span file, ``doc``).
    ``run_id`` is its vote for the run (its first batch's); once read, the
    spans it holds per run id (key None: spans without one) and the workers
    seen under each OS pid (to name profiler traces that lack a worker)."""

    paths: list[Path]
    doc: dict[str, Any] | None = None
    run_id: str | None = None
    run_ids: Counter = field(default_factory=Counter)
    pids: dict[int, set[str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def path(self) -> Path:
        """The current (newest) file of the stream."""
        return self.paths[-1]


@dataclass
class Skipped:
    """An input left out of the merge, and why."""

    file: str
    reason: str


@dataclass
class RunInputs:
    """What one merged timeline is made of: the run's traces and span files,
    its spans deduplicated by (trace id, span id), and its workers."""

    traces: list[TraceInput]
    span_inputs: list[SpanInput]
    spans: dict[tuple[str, str], Span]
    pid_workers: dict[int, set[str]]  # OS pid -> workers seen in span files
    ranks: dict[str, int]
    workers: list[str]  # display order: by rank, then by name


@dataclass
class Timebase:
    """Where a worker's local wall-clock time lands on the merged timeline.

    Times are first taken relative to ``pivot_ns`` (the earliest input time)
    so that microsecond floats keep their precision; ``offsets_us`` are the
    clock corrections and ``origin_us`` (relative to the pivot) is the merged
    timeline's zero: its earliest corrected event."""

    pivot_ns: int
    offsets_us: dict[str, float] = field(default_factory=dict)
    origin_us: float = 0.0

    def rel_us(self, ns: int) -> float:
        return (ns - self.pivot_ns) / 1000.0

    def place_us(self, worker: str, ns: int) -> float:
        """The merged-timeline time (us) of ``worker``'s local time ``ns``."""
        return self.rel_us(ns) + self.offsets_us.get(worker, 0.0) - self.origin_us
