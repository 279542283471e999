"""Finding and reading the workers' snapshots (schema "rpc_observe.debug/1"): a run dir's
file_sd targets, fetched live all at once, and its debug dumps; worker URLs; dump files.

Anything that cannot be used says why in one line (:class:`BadInput`), never a traceback.
"""

from __future__ import annotations

import http.client
import json
import math
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = "rpc_observe.debug/1"
MAX_FETCHES = 64  # workers read at once: a job of thousands costs 64 threads, not thousands
ACCEPTED = ("a run dir (RPC_OBSERVE_DIR, with targets/*.json or debug/*.json), a worker URL "
            "http://host:port, or a dump file <worker>-<pid>.json")
_MAX_BYTES = 64 << 20  # a snapshot is kilobytes; more is not one
_AGENT_KEYS = ("pool_size", "idle_threads", "client_active_calls", "server_active_calls",
               "server_active_async_calls")


class BadInput(Exception):
    """An argument the doctor cannot use; ``str(exc)`` is the one line that says so."""


@dataclass
class Worker:
    """What the doctor knows of one worker: its snapshot (live or from a dump) or none."""

    name: str
    snapshot: dict[str, Any] | None
    reachable: bool
    source: str  # "live", "dump" or "none"
    origin: str = ""  # the URL or dump file it came from
    fetch_error: str | None = None  # why its endpoint did not answer (None: it did, or was not asked)

    @property
    def agent(self) -> dict[str, Any]:
        return (self.snapshot or {}).get("agent") or {}


@dataclass
class Inputs:
    """The workers found, and notes on what was left out (a bad dump, another run's files)."""

    workers: dict[str, Worker]
    notes: list[str] = field(default_factory=list)


def one_line(text: str, limit: int = 300) -> str:
    """``text`` on one line (a reason may quote what a server sent), cut at ``limit`` characters."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def endpoint_url(url: str) -> str:
    """``http://host:port`` -> ``http://host:port/debug/rpc``; a URL ending in /debug/rpc is kept."""
    url = url.rstrip("/")
    return url if url.endswith("/debug/rpc") else url + "/debug/rpc"


def read_dump(path: Path) -> dict[str, Any]:
    """One dump file, parsed and checked; :class:`BadInput` names the file and what is wrong."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise BadInput(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        return parse_snapshot(json.loads(data))
    except UnicodeDecodeError:
        raise BadInput(f"{path}: not JSON (not UTF-8 text); expected a {SCHEMA} dump") from None
    except json.JSONDecodeError as e:
        raise BadInput(f"{path}: not JSON ({e}); expected a {SCHEMA} dump") from None
    except ValueError as e:
        raise BadInput(f"{path}: {e}") from None


def fetch_snapshot(url: str, timeout_s: float) -> dict[str, Any]:
    """GET one worker's /debug/rpc; raises :class:`BadInput` with the reason it failed."""
    # No proxy: metrics endpoints are inside the cluster, and an http_proxy set for downloads
    # would send the request elsewhere.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout_s) as response:
            data = response.read(_MAX_BYTES + 1)
    except urllib.error.HTTPError as e:
        raise BadInput(f"HTTP {e.code} {e.reason}") from None
    except urllib.error.URLError as e:
        reason = e.reason
        raise BadInput(f"no answer within {timeout_s:g} s" if isinstance(reason, TimeoutError)
                       else getattr(reason, "strerror", None) or str(reason)) from None
    except TimeoutError:
        raise BadInput(f"no answer within {timeout_s:g} s") from None
    except (OSError, ValueError, http.client.InvalidURL) as e:  # a reset connection, a bad URL
        raise BadInput(one_line(getattr(e, "strerror", None) or str(e) or type(e).__name__)) from None
    except http.client.HTTPException as e:  # something else listens there
        raise BadInput(f"not an HTTP answer ({type(e).__name__}: {str(e)[:80]!r})") from None
    if len(data) > _MAX_BYTES:
        raise BadInput(f"answer larger than {_MAX_BYTES >> 20} MiB, not a snapshot")
    try:
        return parse_snapshot(json.loads(data))
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BadInput(f"not a {SCHEMA} snapshot ({e})") from None


def fetch_all(urls: Sequence[str], timeout_s: float) -> dict[str, dict[str, Any] | str]:
    """Fetch every URL, up to MAX_FETCHES at once: url -> snapshot, or the reason it failed.
    Returns within about ``timeout_s`` per MAX_FETCHES workers whatever they do (a stopped one never answers)."""
    results: dict[str, dict[str, Any] | str] = {}
    pending = queue.SimpleQueue[str]()
    unique = list(dict.fromkeys(urls))
    for url in unique:
        pending.put(url)

    def fetch() -> None:
        while True:
            try:
                url = pending.get_nowait()
            except queue.Empty:
                return
            try:
                results[url] = fetch_snapshot(url, timeout_s)
            except BadInput as e:
                results[url] = str(e)
            except Exception as e:  # whatever urllib raises, the worker is unreadable: say why
                results[url] = one_line(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=fetch, daemon=True, name=f"doctor fetch {i}")
               for i in range(min(MAX_FETCHES, len(unique)))]
    for thread in threads:
        thread.start()
    # urlopen's timeout bounds each socket operation, not a slow answer or a name lookup: one
    # deadline for all (the threads are daemons; one still running is a worker that did not answer).
    rounds = -(-len(unique) // MAX_FETCHES)
    deadline = time.monotonic() + rounds * timeout_s + 0.5
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return {url: results.get(url, f"no answer within {timeout_s:g} s") for url in unique}


def read_targets(run_dir: Path) -> dict[str, tuple[str, str | None]]:
    """``targets/<worker>.json`` (Prometheus file_sd) -> worker -> (endpoint URL, run id label)."""
    found: dict[str, tuple[str, str | None]] = {}
    for path in sorted(run_dir.glob("targets/*.json")):
        try:
            group = json.loads(path.read_bytes())[0]
            found[path.stem] = ("http://" + endpoint_url(group["targets"][0]),
                                (group.get("labels") or {}).get("rpc_observe_run_id"))
        except (OSError, ValueError, LookupError, TypeError, AttributeError):
            continue  # being written, or not a target: the worker may still have a dump
    return found


def collect(args: Sequence[str], timeout_s: float) -> Inputs:
    """The workers named by ``args`` (run dirs, worker URLs, dump files): the live snapshot of each
    worker that answers, else its newest dump.  Raises :class:`BadInput` when nothing is readable."""
    run_dirs, urls, dumps = _sort_args(args)
    inputs = Inputs({})
    targets, found_dumps = _read_run_dirs(run_dirs, inputs.notes)
    answers = fetch_all([url for url, _ in targets.values()] + urls, timeout_s)
    live = {answer["worker"]: (answer, url) for url, answer in answers.items() if isinstance(answer, dict)}
    runs = {snapshot["run_id"] for snapshot, _ in live.values()}
    if not runs and found_dumps:  # no worker answers: the run of the newest dump
        runs = {max(found_dumps, key=lambda d: _written(d[0]))[0]["run_id"]}
    for snapshot, where in found_dumps:
        if snapshot["run_id"] in runs or None in runs:
            dumps.append((snapshot, where))
        else:
            inputs.notes.append(f"left out {where}: a dump of run {snapshot['run_id']}, not of {_names(runs)}")
    for name, (snapshot, url) in sorted(live.items()):
        inputs.workers[name] = Worker(name, snapshot, True, "live", url)
    for snapshot, where in dumps:  # the newest dump of each worker that did not answer
        held = inputs.workers.get(snapshot["worker"])
        if held is None or (not held.reachable and _written(held.snapshot) < _written(snapshot)):
            inputs.workers[snapshot["worker"]] = Worker(snapshot["worker"], snapshot, False, "dump", where)
    for name, (url, run) in sorted(targets.items()):
        answer, held = answers[url], inputs.workers.get(name)
        if isinstance(answer, dict) or (held is not None and held.reachable):
            continue
        if runs and run is not None and run not in runs:
            inputs.notes.append(f"left out {name} ({url}: {answer}): a target of run {run}, not of {_names(runs)}")
            continue
        inputs.workers[name] = Worker(name, held.snapshot if held else None, False, held.source if held else "none",
                                      held.origin if held else url, f"{url}: {answer}")
    silent = [f"{url} ({answers[url]})" for url in dict.fromkeys(urls) if not isinstance(answers[url], dict)]
    if not any(w.snapshot for w in inputs.workers.values()):
        told = silent + [f"{w.name} {w.fetch_error}" for w in inputs.workers.values()] + inputs.notes
        raise BadInput("nothing readable: " + ("; ".join(told) or "no worker answered and no dump was found"))
    if silent:
        inputs.notes.extend(f"no answer from {url}" for url in silent)
        # A peer nobody told us about may be the worker behind a silent URL: waiting on it is
        # waiting on a worker that does not answer.
        peers = {c["peer"] for w in inputs.workers.values() if w.snapshot for c in w.snapshot["calls"]}
        for peer in sorted(peers - set(inputs.workers)):
            inputs.workers[peer] = Worker(peer, None, False, "none", "", "no answer from " + ", ".join(silent))
    return inputs


def _sort_args(args: Sequence[str]) -> tuple[list[Path], list[str], list[tuple[dict[str, Any], str]]]:
    """Run dirs, endpoint URLs and the (snapshot, file) of each dump file named; BadInput for anything else."""
    run_dirs: list[Path] = []
    urls: list[str] = []
    dumps: list[tuple[dict[str, Any], str]] = []
    for arg in args:
        path = Path(arg)
        if arg.startswith(("http://", "https://")):
            urls.append(endpoint_url(arg))
        elif path.is_dir():
            run_dirs.append(path)
        elif path.is_file() and path.suffix == ".json":
            dumps.append((read_dump(path), str(path)))
        else:
            what = "neither a directory nor a .json dump" if path.exists() else "no such file or directory"
            raise BadInput(f"{arg}: {what}; give {ACCEPTED}")
    return run_dirs, urls, dumps


def _read_run_dirs(run_dirs: list[Path], notes: list[str]) -> tuple[dict[str, tuple[str, str | None]],
                                                                     list[tuple[dict[str, Any], str]]]:
    """The run dirs' targets and readable dumps; a dump that is not one is a note, not the end."""
    targets: dict[str, tuple[str, str | None]] = {}
    dumps: list[tuple[dict[str, Any], str]] = []
    for run_dir in run_dirs:
        dir_targets, dump_paths = read_targets(run_dir), sorted(run_dir.glob("debug/*.json"))
        if not dir_targets and not dump_paths:
            raise BadInput(f"{run_dir}: no readable targets/*.json and no debug/*.json in it; give {ACCEPTED}")
        targets.update(dir_targets)
        for dump_path in dump_paths:
            try:
                dumps.append((read_dump(dump_path), str(dump_path)))
            except BadInput as e:
                notes.append(f"left out {e}")
    return targets, dumps


def _written(snapshot: dict[str, Any] | None) -> float:
    return (snapshot or {}).get("time_unix_s") or 0.0


def _names(runs: set[str | None]) -> str:
    return ", ".join(sorted(str(run) for run in runs))


def parse_snapshot(doc: Any) -> dict[str, Any]:
    """A snapshot checked against the schema, every field of its type (a malformed entry is left
    out, a missing field is None): what the join reads.  Raises ValueError saying what is wrong."""
    if not isinstance(doc, dict):
        raise ValueError(f"a JSON {type(doc).__name__}, not a {SCHEMA} object")
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"schema {doc.get('schema')!r}, not {SCHEMA!r}")
    if not _str(doc.get("worker")):
        raise ValueError(f"a {SCHEMA} object without a worker name")
    agent, stacks = doc.get("agent"), doc.get("stacks")
    return {
        "schema": SCHEMA, "worker": doc["worker"], "rank": _int(doc.get("rank")), "pid": _int(doc.get("pid")),
        "run_id": _str(doc.get("run_id")), "host": _str(doc.get("host")),
        "time_unix_s": _float(doc.get("time_unix_s")), "reason": _str(doc.get("reason")) or "?",
        "hang_seconds": _float(doc.get("hang_seconds")),
        "agent": {key: _int(agent.get(key)) for key in _AGENT_KEYS} if isinstance(agent, dict) else None,
        "calls": [call for call in map(_call, _dicts(doc.get("calls"))) if call["peer"]],
        "serving": [served for served in map(_served, _dicts(doc.get("serving"))) if served["caller"]],
        "finished": _dicts(doc.get("finished")),
        "stacks": {str(thread): [str(frame) for frame in frames] for thread, frames in stacks.items()
                   if isinstance(frames, list)} if isinstance(stacks, dict) else {},
    }


def _call(entry: dict[str, Any]) -> dict[str, Any]:
    outer = entry.get("nested_in")
    nested = ({"caller": _str(outer.get("caller")) or "?", "call_id": _int(outer.get("call_id")),
               "method": _str(outer.get("method")) or "?"} if isinstance(outer, dict) else None)
    return {"call_id": _int(entry.get("call_id")), "method": _str(entry.get("method")) or "?",
            "peer": _str(entry.get("peer")), "mode": _str(entry.get("mode")) or "?", "age_s": _age(entry),
            "thread": _int(entry.get("thread")), "thread_name": _str(entry.get("thread_name")),
            "trace_id": _str(entry.get("trace_id")), "span_id": _str(entry.get("span_id")), "nested_in": nested}


def _served(entry: dict[str, Any]) -> dict[str, Any]:
    return {"caller": _str(entry.get("caller")), "call_id": _int(entry.get("call_id")),
            "method": _str(entry.get("method")) or "?", "mode": _str(entry.get("mode")) or "?",
            "age_s": _age(entry), "thread": _int(entry.get("thread")), "trace_id": _str(entry.get("trace_id"))}


def _dicts(value: Any) -> list[dict[str, Any]]:
    return [entry for entry in value if isinstance(entry, dict)] if isinstance(value, list) else []


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def _age(entry: dict[str, Any]) -> float:
    return max(0.0, _float(entry.get("age_s")) or 0.0)
