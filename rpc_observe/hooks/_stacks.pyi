# The C stack reader of _stacks.c (built by hatch_build.py where a C compiler works).
from collections.abc import Sequence

def stacks(idents: Sequence[int], limit: int, /) -> dict[int, list[str]]: ...
