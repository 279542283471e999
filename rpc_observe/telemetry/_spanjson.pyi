# The file exporter's batch encoding of _spanjson.c (built by hatch_build.py where a C compiler works).
from collections.abc import Callable, Iterable
from typing import Any

def configure(span_type: type, root_pieces: tuple[bytes, ...], child_pieces: tuple[bytes, ...], /) -> None: ...
def lines(records: Iterable[Any], span_json: Callable[[Any], str], site_text: Callable[[Any], str], head: bytes,
          tail: bytes, budget: int, /) -> list[tuple[bytes, int]]: ...
