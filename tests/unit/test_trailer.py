"""The trailer codec: the C one (hooks/_core.c) against its Python reference, and the pickler's fast
paths, with either, against the general parser on the same bytes, hostile ones included."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from torch.distributed.rpc.internal import PythonUDF

from rpc_observe.hooks import calls, pickler, trailer
from rpc_observe.hooks.client import ClientSite
from rpc_observe.hooks.pickler import wrap_deserialize
from rpc_observe.telemetry import health, runtime
from rpc_observe.telemetry.metrics import fold_finished, fold_message, fold_split


def noop() -> None:
    pass


C = trailer.core
needs_c = pytest.mark.skipif(C is None, reason="the C core is not built here (or RPC_OBSERVE_NO_EXTENSIONS=1)")


def test_the_core_is_built_where_a_compiler_is() -> None:
    import shutil

    from rpc_observe.hooks import native

    if not (shutil.which("cc") or shutil.which("gcc")) or native.extensions_off():
        pytest.skip("no C compiler here, or RPC_OBSERVE_NO_EXTENSIONS=1: the codec runs in Python")
    assert C is not None, "rpc_observe/hooks/_core.c is not built: reinstall (pip install -e .)"
    assert type(pickler.wrap_serialize(print)) is C.Hook and type(pickler.wrap_deserialize(print)) is C.Hook


def test_layout_constants_describe_the_bytes() -> None:
    tail = trailer.request_trailer(trailer.request_head("w0", "sync"), 7, "traceparent=x")
    assert tail.endswith(trailer.MAGIC) and len(trailer.MAGIC) == trailer.MAGIC_SIZE
    size = int.from_bytes(tail[-trailer.OVERHEAD:-trailer.MAGIC_SIZE], "little")
    payload = tail[-trailer.OVERHEAD - size:-trailer.OVERHEAD]
    assert size + trailer.OVERHEAD == len(tail) and payload.startswith(trailer.REQUEST_PREFIX)
    fields = payload.decode().split(trailer.SEP)
    assert (fields[trailer.SRC], fields[trailer.MODE], fields[trailer.CALL_ID], fields[trailer.CONTEXT]) \
        == ("w0", "sync", "7", "traceparent=x")
    assert trailer.response_trailer("7")[:len(trailer.RESPONSE_PREFIX)] == trailer.RESPONSE_PREFIX


def test_oversized_payload_is_cut_to_the_limit() -> None:
    tail = trailer.request_trailer(trailer.request_head("w" * 5000, "sync"))
    assert len(tail) == trailer.MAX_PAYLOAD + trailer.OVERHEAD


HEAD = trailer.request_head("worker0", "sync")
REQUESTS = [
    trailer.request_trailer(HEAD),
    trailer.request_trailer(HEAD, 12),
    trailer.request_trailer(HEAD, 12, "traceparent=00-" + "a" * 32 + "-" + "b" * 16 + "-01"),
    trailer.request_trailer(HEAD, 99, "traceparent=t\x1fbaggage=k=v"),
    trailer.request_trailer(trailer.request_head("wörker", "async"), 3),  # not ASCII: the general path
    trailer.request_trailer(trailer.request_head("w" * 300, "sync"), 3),  # 256+ bytes: the general path
    trailer.request_trailer(HEAD, 0, "x") .replace(b"q\x1fworker0\x1fsync\x1f", b"q\x1fworker0\x1fsync\x1fabc"),
    trailer.request_trailer(HEAD, 10**25),  # too many digits
    b"q\x1fonly" + (6).to_bytes(2, "little") + trailer.MAGIC,  # too few fields
    b"\xff\xfe" + (2).to_bytes(2, "little") + trailer.MAGIC,  # not UTF-8
    (5000).to_bytes(2, "little") + trailer.MAGIC,  # length out of range
    b"",  # no trailer
]


@pytest.mark.parametrize("tail", REQUESTS, ids=range(len(REQUESTS)))
def test_request_fast_path_agrees_with_split(metrics_runtime: runtime.Runtime, codec: str, tail: bytes,
                                             kept_request: Callable[[Any], Any]) -> None:
    data = b"PICKLE." + tail
    udf = PythonUDF(noop, (), {})
    deserialize = wrap_deserialize(lambda self, d, t: udf)
    before = health.invalid_contexts[0]
    size, expected = trailer.split(data)
    split_invalid = health.invalid_contexts[0] - before
    obj = deserialize(None, data, [])
    kept = kept_request(obj)
    assert (kept[0] if kept is not None else None) == expected
    assert tuple(obj) == tuple(udf)  # the UDF torch runs is the same
    assert health.invalid_contexts[0] - before == 2 * split_invalid  # counted by the wrapper as by split
    records = list(metrics_runtime.metrics._records)
    assert [r[0] for r in records] == [fold_message] and records[0][2] == size  # payload bytes without trailer


@pytest.mark.parametrize("echo", ["5", "0005", "7", "1" * 25, "", "x5", "5\x1f1234", "5\x1f", "5\x1fx",
                                  "5\x1f" + "9" * 25, "5\x1f1\x1f2", "7\x1f12"])
def test_response_fast_path_ends_exactly_the_call_split_names(metrics_runtime: runtime.Runtime, codec: str,
                                                               echo: str) -> None:
    site = ClientSite(metrics_runtime, noop, "sync", "worker0")
    call = calls.Call(metrics_runtime, site)
    call.id = 5
    calls.in_flight[5] = call
    data = b"RESULT." + trailer._pack(trailer.RESPONSE + trailer.SEP + echo)
    size, fields = trailer.split(data)
    named = fields is not None and fields[trailer.RESPONSE_CALL_ID].isdigit() \
        and int(fields[trailer.RESPONSE_CALL_ID]) == 5
    result = object()
    assert wrap_deserialize(lambda self, d, t: result)(None, data, []) is result
    assert (5 not in calls.in_flight) == named
    folds = [r[0] for r in metrics_runtime.metrics._records]
    assert folds.count(fold_finished) + folds.count(fold_split) == (1 if named else 0)
    callee = fields[trailer.RESPONSE_CALLEE_US] if named and len(fields) > trailer.RESPONSE_CALLEE_US else ""
    assert folds.count(fold_split) == (1 if callee else 0)
    if callee:  # the call's time split: the callee's as its response says, the rest outside
        split = next(r for r in metrics_runtime.metrics._records if r[0] is fold_split)
        assert split[3] == int(callee) / 1e6 and call.span is None
    message = next(r for r in metrics_runtime.metrics._records if r[0] is fold_message)
    assert message[2] == size


@pytest.mark.parametrize("tail", REQUESTS[:4], ids=range(4))
def test_request_fast_path_counts_and_hands_on_as_the_general_path(metrics_runtime: runtime.Runtime, codec: str,
                                                                   monkeypatch: pytest.MonkeyPatch, tail: bytes,
                                                                   kept_request: Callable[[Any], Any]) -> None:
    """The requests the fast path takes: the same UDF for `_run_function` and the same record as
    `_on_other_message`, the general path, makes of the same bytes, tensors and clock readings."""
    import torch

    data, tensors = b"PICKLE." + tail, [torch.ones(3), torch.zeros(2, 2)[0]]
    udf = PythonUDF(noop, (), {})
    clock = iter([10.0, 10.5])
    monkeypatch.setattr(pickler, "_perf_counter", lambda: next(clock))
    fast = wrap_deserialize(lambda self, d, t: udf)(None, data, tensors)
    kept = kept_request(fast)
    fast_records = list(metrics_runtime.metrics._records)
    metrics_runtime.metrics._records.clear()
    general = pickler._on_other_message(metrics_runtime, udf, data, tensors, 10.0, 0.5)
    assert type(general) is pickler._IncomingUDF and tuple(fast) == tuple(general)
    assert kept is not None and kept == (general.rpc_observe_fields, general.rpc_observe_start)
    assert fast_records == list(metrics_runtime.metrics._records) and fast_records[0][3] == 2


@pytest.mark.parametrize(("head", "call_id", "context"), [
    (HEAD, 0, ""), (HEAD, 12, ""), (HEAD, 12, "traceparent=x\x1fbaggage=k=v"), (HEAD, 0, "only context"),
    (trailer.request_head("wörker", "async"), 3, "ctx"), (trailer.request_head("w" * 3000, "sync"), 3, "ctx"),
])
def test_request_trailer_packs_as_pack_does(head: str, call_id: int, context: str) -> None:
    """`request_trailer` inlines `_pack`: the same bytes for the same text (cut to MAX_PAYLOAD alike)."""
    text = head + (str(call_id) if call_id else "") + (trailer.SEP + context if context else "")
    assert trailer.request_trailer(head, call_id, context) == trailer._pack(text)


VALID_CONTEXT = b"traceparent=00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _hostile_tails(seed: int, count: int) -> list[bytes]:
    """Trailers as a broken or hostile peer could send them: valid ones with bytes flipped, cut, grown,
    a lying length field, random payloads behind the magic, and random bytes with no magic at all."""
    import random

    rng = random.Random(seed)
    valid = REQUESTS[:4] + [trailer.response_trailer("5"), trailer.response_trailer("5", 1234),
                            trailer.response_trailer("1" * 20, 0)]
    tails = []
    for i in range(count):
        base = bytearray(rng.choice(valid))
        kind = i % 5
        if kind == 0:  # flip up to 4 bytes anywhere
            for _ in range(rng.randint(1, 4)):
                base[rng.randrange(len(base))] = rng.randrange(256)
        elif kind == 1:  # cut or grow the payload, keep the magic
            base = bytearray(bytes(base[:rng.randrange(len(base))]) + trailer.MAGIC) if rng.random() < 0.5 else \
                bytearray(rng.randbytes(rng.randint(1, 40))) + base
        elif kind == 2:  # a lying length field
            base[-trailer.OVERHEAD:-trailer.MAGIC_SIZE] = rng.randrange(65536).to_bytes(2, "little")
        elif kind == 3:  # random payload of a random claimed size behind the magic
            payload = rng.randbytes(rng.randint(0, 300))
            base = bytearray(payload + rng.randint(0, 400).to_bytes(2, "little") + trailer.MAGIC)
        else:  # random bytes, the magic's last bytes or not
            base = bytearray(rng.randbytes(rng.randint(0, 64)) + trailer.MAGIC[rng.randint(0, trailer.MAGIC_SIZE):])
        tails.append(bytes(base))
    return tails


def test_hostile_trailers_are_ignored_by_both_parsers_alike(metrics_runtime: runtime.Runtime, codec: str,
                                                            kept_request: Callable[[Any], Any]) -> None:
    """4,000 broken trailers: `split` never raises and the fast path agrees with it; the message torch unpickled is
    returned unchanged, no call is ended that the trailer does not name, and nothing is an internal error."""
    udf, result = PythonUDF(noop, (), {}), object()
    request = wrap_deserialize(lambda self, d, t: udf)
    response = wrap_deserialize(lambda self, d, t: result)
    site = ClientSite(metrics_runtime, noop, "sync", "worker0")
    for tail in _hostile_tails(seed=22, count=4000):
        data = b"PICKLE." + tail
        size, fields = trailer.split(data)
        assert 0 <= size <= len(data)
        obj = request(None, data, [])
        assert tuple(obj) == tuple(udf)
        kept = kept_request(obj)
        assert (kept[0] if kept is not None else None) == (fields if fields and fields[0] == trailer.REQUEST else None)
        call = calls.Call(metrics_runtime, site)
        call.id = 5
        calls.in_flight[5] = call
        assert response(None, data, []) is result
        named = fields is not None and fields[0] == trailer.RESPONSE and fields[trailer.RESPONSE_CALL_ID].isdigit() \
            and int(fields[trailer.RESPONSE_CALL_ID]) == 5
        assert (5 not in calls.in_flight) == named, tail
        calls.in_flight.clear()
        metrics_runtime.metrics._records.clear()
    assert health.internal_errors == {}


def _random_messages(seed: int, count: int) -> list[bytes]:
    """Valid, hostile and random trailers behind pickles of random sizes (0 too)."""
    import random

    rng = random.Random(seed)
    tails = _hostile_tails(seed, count)
    return [rng.randbytes(rng.choice((0, 1, 7, 300))) + tail for tail in tails]


def test_parse_agrees_with_split() -> None:
    """The fast paths' parser reads what the general one reads, or leaves the message to it (None)."""
    for data in [b"P." + t for t in REQUESTS] + _random_messages(seed=7, count=4000):
        parsed, (size, fields) = trailer.parse(data), trailer.split(data)
        if fields is None or (fields[0] == trailer.RESPONSE and not fields[trailer.RESPONSE_CALL_ID]):
            assert parsed is None, data
        elif fields[0] == trailer.REQUEST:
            assert parsed == (size, fields), data
        else:
            callee = fields[trailer.RESPONSE_CALLEE_US] if len(fields) > trailer.RESPONSE_CALLEE_US else ""
            known = callee and len(callee) <= trailer.MAX_CALLEE_US_DIGITS
            assert parsed == (size, int(fields[trailer.RESPONSE_CALL_ID]), int(callee) if known else -1), data


@needs_c
@pytest.mark.parametrize("seed", range(3))
def test_c_parse_of_many_callers_and_modes_is_the_references(seed: int) -> None:
    """The C parser keeps the text a request's head repeats (kind, caller, mode) by its bytes in a small table:
    requests from many callers, whose names share prefixes, lengths and table entries, some not UTF-8 or longer
    than what the table keeps, are read exactly as the reference reads them; the same head gives the same objects."""
    import random

    assert C is not None
    rng = random.Random(seed)
    names = ["", "w", "worker", "trainer", "\u00e9", "w\u00f6rker", "ps" * 40, "x" * 64, "x" * 65]
    names += [f"worker{i}" for i in range(120)] + ["\U0001f600" * rng.randint(1, 20) for _ in range(10)]
    raw = [b"\xff", b"w\xc3", b"\xc3(", b"ok\xed\xa0\x80"]  # not UTF-8
    for _ in range(6000):
        parts = [rng.choice(names).encode() if rng.random() < 0.95 else rng.choice(raw) for _ in range(2)]
        call_id = rng.choice([b"", b"7", str(rng.randrange(10**20)).encode(), b"1" * 21, b"x"])
        context = rng.choice([[], [VALID_CONTEXT], [VALID_CONTEXT, b"baggage=k=v"], [b"\xff"]])
        payload = b"\x1f".join([b"q", *parts, call_id, *context])[:trailer.MAX_PAYLOAD]
        data = b"P." + payload + len(payload).to_bytes(trailer.LENGTH_SIZE, "little") + trailer.MAGIC
        assert C.parse(data) == trailer.parse(data), data
    head = b"P." + trailer.request_trailer(trailer.request_head("worker3", "sync"), 12345)
    first, again = C.parse(head), C.parse(head)
    assert first is not None and again is not None
    assert all(a is b for a, b in zip(first[1][:3], again[1][:3])) and first[1][3] is not again[1][3]


@needs_c
@pytest.mark.parametrize("seed", range(5))
def test_c_parse_agrees_with_the_reference_on_hostile_bytes(seed: int) -> None:
    """20,000 messages a broken or hostile peer could send, as bytes, bytearray and memoryview: the C
    parser gives exactly what the Python reference gives (and reads nothing outside the buffer: .ci/asan)."""
    assert C is not None
    for data in _random_messages(seed=1000 + seed, count=4000):
        expected = trailer.parse(data)
        assert C.parse(data) == expected, data
        assert C.parse(bytearray(data)) == expected and C.parse(memoryview(data)) == expected


@needs_c
def test_c_parse_takes_every_length_and_number_the_layout_allows() -> None:
    assert C is not None
    for size in range(0, trailer.MAX_PAYLOAD + 2, 7):  # every claimed length up to past the limit
        payload = (b"r\x1f" + b"1" * size)[:size]
        for data in (payload + size.to_bytes(2, "little") + trailer.MAGIC,
                     payload[1:] + size.to_bytes(2, "little") + trailer.MAGIC):  # one byte short of its claim
            assert C.parse(data) == trailer.parse(data)
    for digits in ("0", "9" * 18, "9" * 19, "9" * 20, "1" + "0" * 19, "9" * 21):  # past a C long long, and too long
        data = trailer.response_trailer(digits, int("9" * 20))
        assert C.parse(data) == trailer.parse(data)
    for short in (b"", trailer.MAGIC, trailer.MAGIC[1:], b"\x00" + trailer.MAGIC):
        assert C.parse(short) is None and trailer.parse(short) is None
    with pytest.raises(TypeError):
        C.parse("not bytes")  # type: ignore[arg-type]


class Id(int):
    """An int subclass with its own str: the C packers write what str() writes, not the number's digits."""

    def __str__(self) -> str:
        return f"id{int(self)}"


@needs_c
@pytest.mark.parametrize(("head", "call_id", "context"), [
    (HEAD, 0, ""), (HEAD, 12, ""), (HEAD, 2**64 + 1, "ctx"), (HEAD, -3, ""), (HEAD, 12, "traceparent=x\x1fbaggage=k=v"),
    (HEAD, 0, "only context"), (trailer.request_head("wörker", "async"), 3, "ctx"),
    (trailer.request_head("w" * 3000, "sync"), 3, "ctx"), (trailer.request_head("w\ud800", "sync"), 3, "c\udfff"),
    ("", 0, ""), (HEAD, 1, "é" * 2000),  # cut inside a character, as the reference cuts
    (HEAD, 2**63 - 1, ""), (HEAD, -(2**63), ""), (HEAD, 2**63, ""), (HEAD, True, ""), (HEAD, Id(7), "ctx"),
])
def test_c_request_trailer_packs_as_the_reference(head: str, call_id: int, context: str) -> None:
    assert C is not None
    assert C.request_trailer(head, call_id, context) == trailer.request_trailer(head, call_id, context)


@needs_c
@pytest.mark.parametrize(("call_id", "callee_us"), [
    ("5", -1), ("5", 0), ("5", 1234), ("1" * 20, 2**70), ("", -1), ("w\ud800", 3), ("x" * 3000, 5),
    ("5", -(2**70)), ("5", 2**63 - 1), ("5", -(2**63)), ("5", True), ("5", Id(-2)), ("5", Id(9)),
])
def test_c_response_trailer_packs_as_the_reference(call_id: str, callee_us: int) -> None:
    assert C is not None
    assert C.response_trailer(call_id, callee_us) == trailer.response_trailer(call_id, callee_us)
    with pytest.raises(TypeError):
        C.response_trailer(call_id, "5")  # type: ignore[arg-type]


def test_no_extensions_runs_the_python_references() -> None:
    """RPC_OBSERVE_NO_EXTENSIONS=1 (what CI runs the end-to-end tests with too): no C module of ours loads."""
    import os
    import subprocess
    import sys

    code = ("from rpc_observe.hooks import pickler, snapshot, trailer; from rpc_observe.merge import speedups;"
            "assert trailer.core is None and pickler._core is None;"
            "assert snapshot._native is None and speedups.C is None;"
            "assert pickler.wrap_serialize(print).__module__ == 'rpc_observe.hooks.pickler'")
    env = {**os.environ, "RPC_OBSERVE_NO_EXTENSIONS": "1"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
