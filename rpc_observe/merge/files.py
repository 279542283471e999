"""Finding the input files of ``rpc-observe merge`` and reading them.

Span files may be rotated the way logrotate does it: ``<worker>-<pid>.jsonl``
is the current file and ``<worker>-<pid>.jsonl.1``, ``.jsonl.2``, ... are
older ones (the larger the number, the older; each may be gzipped).  The
files of one worker are grouped into one stream, read oldest first.
"""

from __future__ import annotations

import gzip
import io
import os
import re
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

from .model import BadInput, Skipped

_INPUT_NAME = re.compile(r"\.(json(\.gz)?|jsonl(\.\d+)?(\.gz)?)$")
_SPAN_NAME = re.compile(r"\.jsonl(?:\.(\d+))?(?:\.gz)?$")
_GZIP_MAGIC = b"\x1f\x8b"
GZIP_ERRORS = (EOFError, OSError, zlib.error)


def collect_inputs(paths: Iterable[str | os.PathLike]) -> tuple[list[Path], list[Skipped]]:
    """Expand files and directories (recursively) into input files."""
    files: list[Path] = []
    missing: list[Skipped] = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(sorted(
                f for f in p.rglob("*")
                if f.is_file() and _INPUT_NAME.search(f.name) and not f.name.startswith(".")
            ))
        elif p.is_file():
            files.append(p)
        else:
            missing.append(Skipped(str(p), "no such file or directory"))
    return list(dict.fromkeys(files)), missing


def is_span_file(path: Path) -> bool:
    """A JSON-lines span file by its name (current or rotated)."""
    return _SPAN_NAME.search(path.name) is not None


def span_streams(files: Iterable[Path]) -> list[list[Path]]:
    """Group span files into per-worker streams, each ordered oldest first
    (``.jsonl.2``, ``.jsonl.1``, ``.jsonl``)."""
    groups: dict[Path, list[tuple[int, str, Path]]] = {}
    for f in files:
        m = _SPAN_NAME.search(f.name)
        if m is None:
            continue
        age = int(m.group(1)) if m.group(1) else 0
        base = f.with_name(f.name[: m.start()] + ".jsonl")
        groups.setdefault(base, []).append((-age, f.name, f))
    return [[f for *_, f in sorted(members)] for _, members in sorted(groups.items())]


_READ_BUFFER = 1 << 20


def _open_binary(path: Path) -> io.BufferedIOBase:
    """A gzip or a plain file, told by its first bytes.  A span file's lines are
    batches of hundreds of kB: the default 8 kB buffer would cost a read call per 8 kB."""
    f: io.BufferedIOBase = open(path, "rb", buffering=_READ_BUFFER)  # type: ignore[assignment]
    if f.read(2) == _GZIP_MAGIC:
        f.close()
        return gzip.open(path, "rb")
    f.seek(0)
    return f


def iter_lines(path: Path) -> Iterator[bytes]:
    """The lines of a (possibly gzipped) file, with their newline, read as a
    stream.  Raises :class:`BadInput` when it cannot be opened, or its gzip
    stream breaks."""
    try:
        f = _open_binary(path)
    except OSError as e:
        raise BadInput(f"cannot read ({e.strerror or e})") from None
    with f:
        try:
            yield from f
        except GZIP_ERRORS as e:
            raise BadInput(f"truncated or corrupt gzip ({e})") from None


def read_text(path: Path) -> str:
    """A whole (possibly gzipped) UTF-8 file."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
        if raw[:2] == _GZIP_MAGIC:
            try:
                raw = gzip.decompress(raw)
            except GZIP_ERRORS as e:
                raise BadInput(f"truncated or corrupt gzip ({e})") from None
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadInput("not UTF-8 text") from None
    except OSError as e:
        raise BadInput(f"cannot read ({e.strerror or e})") from None


def natural(s: str) -> list:
    """Sort key that puts ``worker2`` before ``worker10``."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def trace_stem(path: Path) -> str:
    """``host_123.1700000000000.pt.trace.json.gz`` -> ``host_123`` (the
    tensorboard_trace_handler name without its per-export timestamp)."""
    name = path.name
    for suf in (".gz", ".json", ".pt.trace"):
        if name.endswith(suf):
            name = name[: -len(suf)]
    return re.sub(r"\.\d+$", "", name) or path.name
