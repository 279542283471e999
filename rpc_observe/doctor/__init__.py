"""``rpc-observe doctor``: says why an RPC job is stuck, from the workers' own account of their
calls (schema "rpc_observe.debug/1", served at ``/debug/rpc`` and dumped to ``debug/``).

Usage::

    rpc-observe doctor [RPC_OBSERVE_DIR | URL | DUMP.json ...] [--json] [--timeout S] [--threshold S]

    rpc-observe doctor                           # $RPC_OBSERVE_DIR, else ./rpc_observe_out
    rpc-observe doctor run/ --threshold 10       # a run dir: targets/*.json fetched live, debug/*.json
    rpc-observe doctor http://10.0.0.7:9464      # worker endpoints (GET <url>/debug/rpc)
    rpc-observe doctor run/debug/worker1-4242.json --json

It fetches every worker at once (``--timeout`` each, default 2 s); a worker that does not answer
is read from its newest dump.  It joins each in-flight call with the UDF that runs it on its
peer (running), or finds the peer's pool exhausted (queued), builds the wait-for graph of the
served calls and reports, first line first: a cycle (a deadlock, with the user line each
worker waits at), a worker out of reach that others wait on, a UDF stuck in user code, calls
older than ``--threshold`` (default: the workers' RPC_OBSERVE_HANG_SECONDS, else 30 s), or that
no call is stuck.  Exit status: 0 nothing stuck, 1 something stuck, 2 bad input (one line on
stderr).  The package needs only the Python standard library: it runs where torch is not installed.

From Python: ``main(argv) -> int`` runs the command; :func:`collect` reads the inputs and
:func:`diagnose` joins parsed snapshots (:class:`Worker` objects) into a :class:`Diagnosis`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

from .graph import CallView, Diagnosis, Hop, StuckUdf, diagnose
from .sources import ACCEPTED, SCHEMA, BadInput, Inputs, Worker, collect, one_line, parse_snapshot, read_dump
from .text import as_json, render_text

__all__ = ["main", "collect", "diagnose", "render_text", "as_json", "parse_snapshot", "read_dump", "BadInput",
           "Inputs", "Worker", "Diagnosis", "CallView", "Hop", "StuckUdf", "SCHEMA"]
PROG = "rpc-observe doctor"


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line (no usage block) and main() returns 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise BadInput(message)


def _seconds(what: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{text!r}: {what} in seconds, more than 0 (e.g. 2 or 0.5)")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(prog=PROG, description="Say why an RPC job is stuck: join the workers' snapshots of their "
                                        "calls into a wait-for graph.")
    ap.add_argument("inputs", nargs="*", metavar="RPC_OBSERVE_DIR | URL | DUMP",
                    help=f"{ACCEPTED}; default $RPC_OBSERVE_DIR or ./rpc_observe_out")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout instead of the text")
    ap.add_argument("--timeout", type=_seconds("a wait per worker"), default=2.0, metavar="SECONDS",
                    help="how long to wait for each worker's /debug/rpc, all fetched at once (default 2)")
    ap.add_argument("--threshold", type=_seconds("an age"), default=None, metavar="SECONDS",
                    help="a call or UDF this old is stuck (default: the workers' hang_seconds, else 30)")
    return ap


def main(argv: list[str] | None = None) -> int:
    """The ``rpc-observe doctor`` command; returns its exit status (0 fine, 1 stuck, 2 bad input)."""
    try:
        args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
        inputs = collect(args.inputs or [os.environ.get("RPC_OBSERVE_DIR") or "rpc_observe_out"], args.timeout)
    except BadInput as e:
        print(f"{PROG}: {one_line(str(e), 2000)}", file=sys.stderr)
        return 2
    diagnosis = diagnose(inputs.workers, args.threshold)
    if args.json:
        print(json.dumps(as_json(diagnosis, inputs.notes), indent=1))
    else:
        sys.stdout.write(render_text(diagnosis, inputs.notes))
    return diagnosis.status
