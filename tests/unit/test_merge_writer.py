"""merge's background writer: every chunk written in order, a failed write raised in the caller."""

from __future__ import annotations

import io

import pytest

from rpc_observe.merge import _BackgroundWriter


def test_writes_every_chunk_in_order():
    raw = io.BytesIO()
    with _BackgroundWriter(raw) as w:
        for i in range(1000):
            w.write(f"{i},")
    assert raw.getvalue() == "".join(f"{i}," for i in range(1000)).encode()


class _Full(io.RawIOBase):
    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        raise OSError(28, "No space left on device")


def test_a_failed_write_is_raised_in_the_writing_thread():
    with pytest.raises(OSError, match="No space left"):
        with _BackgroundWriter(_Full()) as w:
            for _ in range(100):
                w.write("x" * 1000)
