"""Span files read as streams, line by line, into a :class:`SpanSink`.

rpc_observe's file exporter writes every batch the same way (one resource,
one scope, spans with a fixed field order, a call site's name, kind and
attributes as one identical piece of text), so such a line is read by text:
the spans are split apart at ``},{"traceId":"``, their ids and times taken
by an anchored regex, and each call site decoded once.  Any other layout,
and any span that does not fit (failed calls carry more fields), is decoded
as JSON (:mod:`.otlp`), with the same result.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import speedups
from .files import iter_lines
from .model import BadInput, Span, SpanInput, json_error
from .otlp import Resource, Site, batch_spans, parse_span, resource_of, site_of, span_worker

_HEAD = re.compile(r'\{"resourceSpans":\[\{"resource":(\{.*?\}),"scopeSpans":\[\{"scope":\{[^{}]*\},'
                   r'"spans":\[\{"traceId":"')
_TAIL = "}]}]}]}"
_SEP = '},{"traceId":"'
_IDS = re.compile(r'([0-9a-f]{32})","spanId":"([0-9a-f]{16})"(?:,"parentSpanId":"([0-9a-f]{16})")?,'
                  r'"startTimeUnixNano":"(\d+)","endTimeUnixNano":"(\d+)",')
_OK = ',"status":{"code":0}'
_START = re.compile(rb'"startTimeUnixNano":"?(\d+)')
_NO_SITE = Site("", 0, {}, None)


class SpanReader:
    """Reads span streams for one run into ``add_many``; spans of another run are
    counted, not kept.  Call sites and resources are decoded once per merge."""

    def __init__(self, add_many: Callable[[list[Span]], None], run_id: str | None) -> None:
        self.add_many = add_many
        self.run_id = run_id
        self._sites: dict[str, Site] = {}  # _NO_SITE: a piece of text that is no call site
        self._resources: dict[str, Resource | None] = {}

    def read(self, si: SpanInput) -> None:
        """Read a whole stream; problems go to ``si.problems``."""
        if si.doc is not None:
            self._batch(si, si.doc, si.path)
            return
        for path in si.paths:
            where = f"{path.name} line" if len(si.paths) > 1 else "line"
            n = 0
            try:
                for n, raw in enumerate(iter_lines(path), 1):
                    self.read_line(si, raw, path, f"{where} {n}")
            except BadInput as e:
                si.problems.append(f"{where} {n + 1}: {e}")

    def read_line(self, si: SpanInput, raw: bytes, path: Path, where: str) -> None:
        """Read one line of ``si``'s file ``path`` (``where`` names it in a problem); for a
        reader that interleaves streams (``rpc-observe report``)."""
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            si.problems.append(f"{where}: not UTF-8 text")
            return
        if not text or text.isspace() or self._fast_line(si, text, path):
            return
        text = text.rstrip()
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            # Only a line cut short (a worker killed mid-write) lacks its newline.
            cut = not raw.endswith(b"\n")
            si.problems.append(f"{where}: " + (json_error(e, text) if cut else f"invalid JSON ({e.msg})"))
            return
        if not isinstance(obj, dict) or "resourceSpans" not in obj:
            si.problems.append(f"{where}: not an OTLP export batch (no resourceSpans)")
            return
        self._batch(si, obj, path)

    def _batch(self, si: SpanInput, batch: dict[str, Any], path: Path) -> None:
        bad = 0
        for res, raws in batch_spans(batch):
            mine = self._is_run(res)
            kept = []
            for raw in raws:
                sp = parse_span(raw, res, path)
                if sp is None:
                    bad += 1
                    continue
                si.run_ids[res.run_id] += 1
                if mine:
                    self._note_pid(si, res, sp.worker)
                    kept.append(sp)
            self.add_many(kept)
        if bad:
            si.problems.append(f"{bad} malformed span(s) ignored")

    def _is_run(self, res: Resource) -> bool:
        """Whether spans of this resource belong to the run merged."""
        return res.run_id is None or self.run_id is None or res.run_id == self.run_id

    @staticmethod
    def _note_pid(si: SpanInput, res: Resource, worker: str) -> None:
        if res.pid is not None:
            si.pids.setdefault(res.pid, set()).add(worker)

    def _fast_line(self, si: SpanInput, text: str, path: Path) -> bool:
        """Read a line in the exporter's own layout; False if it is not one."""
        m = _HEAD.match(text)
        end = len(text)
        while end and text[end - 1] in "\r\n":
            end -= 1
        if m is None or not text.endswith(_TAIL, 0, end):
            return False
        res_text = m.group(1)
        if res_text not in self._resources:  # once a line: a lookup more is nothing
            self._resources[res_text] = _decode(res_text, lambda d: resource_of({"resource": d}))
        res = self._resources[res_text]
        if res is None:
            return False
        lo, hi = m.end(), end - len(_TAIL)  # the spans, between the head and the tail
        if not self._is_run(res):  # counted, not read
            si.run_ids[res.run_id] += text.count(_SEP, lo, hi) + 1
            return True
        spans = self._fast_spans(text, lo, hi, res, path)
        if spans is None:  # a piece that is not one span: read the line as JSON instead
            return False
        si.run_ids[res.run_id] += len(spans)
        self.add_many(spans)
        if res.worker is not None:
            self._note_pid(si, res, res.worker)
        else:
            for worker in {sp.worker for sp in spans}:
                self._note_pid(si, res, worker)
        return True

    def _fast_spans(self, text: str, lo: int, hi: int, res: Resource, path: Path) -> list[Span] | None:
        """The spans of ``text[lo:hi]``, pieces split at ``},{"traceId":"`` (each
        a span's JSON without its leading ``{"traceId":"`` and closing ``}``);
        None if one is no span.  The C loop reads the common pieces and leaves
        the others in place, for :meth:`_piece_span`."""
        fallback = span_worker(res, _NO_SITE, path)  # a span's own route comes first
        if speedups.C is not None:
            read = speedups.C.line_spans(text, lo, hi, self._sites, _NO_SITE, res.worker, fallback)
            if read is not None:
                spans, left = read
                for i in left:
                    sp = self._piece_span(spans[i], res, path, fallback)
                    if sp is None:
                        return None
                    spans[i] = sp
                return spans
        out: list[Span] = []
        for piece in text[lo:hi].split(_SEP):
            if (sp := self._piece_span(piece, res, path, fallback)) is None:
                return None
            out.append(sp)
        return out

    def _piece_span(self, p: str, res: Resource, path: Path, fallback: str) -> Span | None:
        """The span of one piece; None if it is no span."""
        m = _IDS.match(p)
        if m is not None:
            tail = p[m.end():]  # a call site and an OK status: the key, so a hit needs no test of the status
            site = self._sites.get(tail)
            if site is None and tail.endswith(_OK):
                site = self._sites[tail] = _decode(tail[:-len(_OK)], _site_of) or _NO_SITE
            if site is not None and site is not _NO_SITE:
                trace_id, span_id, parent, start, end = m.groups()
                start_ns, end_ns = int(start), int(end)
                if start_ns > 0:
                    return Span(trace_id, span_id, parent or "", site.name, site.kind, start_ns,
                                end_ns if end_ns > start_ns else start_ns,
                                res.worker or site.route_worker or fallback, site.attrs)
        try:  # another layout (a failed call's span): decode this one span
            raw = json.loads('{"traceId":"' + p + "}")
        except json.JSONDecodeError:
            return None
        return parse_span(raw, res, path)


def _site_of(d: dict[str, Any]) -> Site | None:
    """A call site's piece of text, decoded: exactly a name, a kind and attributes."""
    return site_of(d["name"], d["kind"], d["attributes"]) if d.keys() == {"name", "kind", "attributes"} else None


def _decode(text: str, make: Callable[[dict], Any]) -> Any:
    """``make`` of the JSON object ``{text}`` (braces added if missing); None if it does not fit."""
    try:
        d = json.loads(text if text.startswith("{") else "{" + text + "}")
        return make(d) if isinstance(d, dict) else None
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
        return None


def peek_run_id(si: SpanInput, tries: int = 20) -> str | None:
    """The run id of a stream's first batch that has one (its vote for the run);
    of a line in the exporter's layout, only the head is decoded."""
    if si.doc is not None:
        return next((res.run_id for res, _ in batch_spans(si.doc) if res.run_id), None)
    for path in si.paths:
        try:
            for n, raw in enumerate(iter_lines(path)):
                if n >= tries:
                    break
                found = _run_id_of(raw.decode("utf-8", "replace"))
                if found:
                    return found
        except BadInput:
            continue
    return None


def _run_id_of(line: str) -> str | None:
    m = _HEAD.match(line)
    res = _decode(m.group(1), lambda d: resource_of({"resource": d})) if m else None
    if res is not None:
        return res.run_id
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        return None
    return next((r.run_id for r, _ in batch_spans(obj) if r.run_id), None) if isinstance(obj, dict) else None


def earliest_start_ns(si: SpanInput) -> int | None:
    """The earliest span start in a stream, by a scan of its text (for a
    window relative to the run's first event)."""
    if si.doc is not None:
        starts = [parse_span(raw, res, si.path) for res, raws in batch_spans(si.doc) for raw in raws]
        return min((s.start_ns for s in starts if s is not None), default=None)
    best: int | None = None
    for path in si.paths:
        try:
            for raw in iter_lines(path):
                found = _START.findall(raw)
                if found:
                    low = min(map(int, found))
                    best = low if best is None or low < best else best
        except BadInput:
            continue
    return best
