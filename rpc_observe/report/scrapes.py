"""Bytes and tensors per message, which span files do not carry: read from the workers'
saved /metrics (Prometheus text files, ``metrics/*.prom`` in the run directory; the demo
saves them at the end of its run, and ``curl http://WORKER/metrics > metrics/WORKER.prom``
does the same for any job).  Only the few sums the report shows are read."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)\{(.*)\}\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_WANTED = {"torch_rpc_serialized_bytes_sum", "torch_rpc_serialized_bytes_count", "torch_rpc_serialized_tensors_sum",
           "torch_rpc_client_sent_bytes_total"}


def find_scrapes(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "metrics").glob("*.prom")) if run_dir.is_dir() else []


def read_scrapes(files: list[Path]) -> dict[str, Any]:
    """Per method, bytes and tensors per request message; per (caller, callee), bytes sent.
    Unreadable files and lines are left out (``problems``)."""
    sums: dict[tuple[str, str], float] = defaultdict(float)  # (sample name, method) -> value
    sent: dict[str, float] = defaultdict(float)  # "caller\tcallee" -> bytes
    problems: list[str] = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            problems.append(f"{path.name}: cannot read ({e})")
            continue
        for line in text.splitlines():
            m = _SAMPLE.match(line)
            if m is None or m.group(1) not in _WANTED:
                continue
            try:
                value = float(m.group(3))
            except ValueError:
                continue
            labels = dict(_LABEL.findall(m.group(2)))
            if m.group(1) == "torch_rpc_client_sent_bytes_total":
                sent[f"{labels.get('worker', '?')}\t{labels.get('dst', '?')}"] += value
            elif labels.get("direction") == "serialize" and labels.get("message") == "request":
                sums[m.group(1), labels.get("method", "?")] += value
    per_method: dict[str, dict[str, float]] = {}
    for (name, method), value in sums.items():
        per_method.setdefault(method, {})[name] = value
    messages = {m: {"messages": v.get("torch_rpc_serialized_bytes_count", 0.0),
                    "bytes_per_message": _ratio(v, "torch_rpc_serialized_bytes_sum"),
                    "tensors_per_message": _ratio(v, "torch_rpc_serialized_tensors_sum")}
                for m, v in per_method.items()}
    return {"files": [p.name for p in files], "methods": messages, "sent_bytes": dict(sent), "problems": problems}


def _ratio(values: dict[str, float], name: str) -> float | None:
    count = values.get("torch_rpc_serialized_bytes_count", 0.0)
    return round(values.get(name, 0.0) / count, 2) if count else None
