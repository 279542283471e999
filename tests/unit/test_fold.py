"""The metric fold in C (hooks/_core.c `fold`) against its Python reference (telemetry/metrics.py
`fold_records`): the same records into two identical sets of cells leave the same cells, exemplars
and errors, for every record the hot paths queue and for values and shapes they never do."""

from __future__ import annotations

import collections
import math
import random
from collections.abc import Callable
from typing import Any

import pytest

from rpc_observe.hooks import pickler, trailer  # noqa: F401  # pickler configures the fold
from rpc_observe.telemetry import declarations
from rpc_observe.telemetry.metrics import (
    Metrics,
    fold_finished,
    fold_message,
    fold_records,
    fold_served,
    fold_split,
    fold_started,
)

core = trailer.core
pytestmark = pytest.mark.skipif(core is None, reason="the C core is not built here")


class Span:
    """What the fold reads of a span record: `sampled`."""

    def __init__(self, sampled: Any) -> None:
        self.sampled = sampled

    def __repr__(self) -> str:
        return f"Span#{id(self)}"


class Unsampleable:
    @property
    def sampled(self) -> bool:
        raise RuntimeError("no sampled here")


SPANS = [None, Span(True), Span(False), Span(1), Span(0), Span(None)]
BOUNDS = [b for kind in (declarations.SIZE_BUCKETS, declarations.COUNT_BUCKETS, declarations.LATENCY_BUCKETS,
                         declarations.SERIALIZATION_BUCKETS) for b in kind]


def value(rng: random.Random, seconds: bool) -> Any:
    """A number as the hot paths give them, or as they never do (an exact bound, nan, a huge int, a bool)."""
    roll = rng.random()
    if roll < 0.15:
        bound = rng.choice(BOUNDS)
        return bound if seconds or rng.random() < 0.5 else int(bound)
    if roll < 0.2:
        return rng.choice([math.nan, math.inf, -math.inf, -0.0, 0.0, 0, -1, True, False, 2**53 + 1, 2**70, -(2**64),
                           9007199254740993, 1e300])
    if seconds:
        return rng.choice([rng.expovariate(100.0), -rng.random() * 1e-3, rng.random() * 100])
    return rng.choice([rng.randrange(0, 300), rng.randrange(0, 1 << 40), rng.randrange(0, 1 << 62)])


def records_for(metrics: Metrics, seed: int, count: int) -> list[tuple]:
    """`count` records of every kind the hot paths queue, into `metrics`' cells; the same for the same seed."""
    rng = random.Random(seed)
    methods, peers = ["f", "g", "h"], ["w1", "w2"]
    out: list[tuple] = []
    for _ in range(count):
        kind = rng.randrange(5)
        method, peer = rng.choice(methods), rng.choice(peers)
        if kind == 0:
            cells = metrics.message_cells(rng.choice(["serialize", "deserialize"]), "request", method)
            peer_cell = rng.choice([None, metrics.client_cells(method, "sync", peer).sent_bytes])
            out.append((fold_message, cells, value(rng, False), value(rng, False), value(rng, False),
                        value(rng, False), value(rng, True), peer_cell, value(rng, False)))
        elif kind == 1:
            out.append((fold_started, metrics.client_cells(method, rng.choice(["sync", "async"]), peer)))
        elif kind == 2:
            out.append((fold_finished, metrics.client_cells(method, "sync", peer), value(rng, True), rng.choice(SPANS)))
        elif kind == 3:
            out.append((fold_split, metrics.client_cells(method, "sync", peer), value(rng, True), value(rng, True),
                        rng.choice(SPANS)))
        else:
            out.append((fold_served, metrics.server_cells(method, peer), value(rng, True), rng.choice(SPANS)))
    return out


def state(metrics: Metrics) -> str:
    """Every cell and exemplar slot, types and nan included (repr tells 1 from 1.0 and shows nan)."""
    return repr([(f.declaration.name, sorted(f.children.items()), sorted((f.exemplars or {}).items()))
                 for f in metrics._families])


def run(fold: Callable[[collections.deque, int], None], records: list[tuple], n: int | None = None) -> tuple[Any, int]:
    queue = collections.deque(records)
    try:
        fold(queue, len(queue) if n is None else n)
    except Exception as e:
        return (type(e), str(e)), len(queue)
    return None, len(queue)


@pytest.mark.parametrize("seed", range(20))
def test_c_fold_leaves_what_the_reference_leaves(seed: int) -> None:
    python, c = Metrics("w0", 10), Metrics("w0", 10)
    assert run(fold_records, records_for(python, seed, 500)) == (None, 0)
    assert run(core.fold, records_for(c, seed, 500)) == (None, 0)
    assert state(c) == state(python)


def test_it_folds_part_of_the_queue_and_runs_other_functions() -> None:
    seen: list[tuple] = []

    def other(record: tuple) -> None:
        seen.append(record)

    python, c = Metrics("w0", 10), Metrics("w0", 10)
    rp = records_for(python, 1, 20) + [(other, 1, 2)] + records_for(python, 2, 20)
    rc = records_for(c, 1, 20) + [(other, 1, 2)] + records_for(c, 2, 20)
    assert run(fold_records, rp, 30) == (None, 11)
    assert run(core.fold, rc, 30) == (None, 11)
    assert state(c) == state(python) and seen == [(other, 1, 2)] * 2


def malformed(metrics: Metrics) -> list[tuple]:
    """Records of the known folds in shapes the hot paths never build: each goes to the Python fold."""
    client, server = metrics.client_cells("f", "sync", "w1"), metrics.server_cells("f", "w1")
    message = metrics.message_cells("serialize", "request", "f")
    return [
        (fold_message, message, 1, 2, 3),  # too short
        (fold_message, tuple(message), 1, 2, 3, 4, 0.1, None, 5),  # a plain tuple: no field names
        (fold_message, message, 1, 2, 3, 4, 0.1, (7,), 5),  # the peer cell a tuple
        (fold_message, message, "1", 2, 3, 4, 0.1, None, 5),  # a size that is not a number
        (fold_started, server),  # the cells of another kind
        (fold_finished, client, 0.1),
        (fold_finished, client, 0.1, Unsampleable()),
        (fold_split, client, 0.1, "x", None),
        (fold_split, client, None, 0.1, None),
        (fold_served, server, 0.1, Unsampleable()),
        (fold_served, client, 0.1, None),  # ClientCells has .duration and .exemplars too
        (fold_served,),
        (),
        "not a record",
        (42, 1),
    ]


@pytest.mark.parametrize("index", range(15))
def test_a_malformed_record_ends_as_in_the_reference(index: int) -> None:
    python, c = Metrics("w0", 10), Metrics("w0", 10)
    rp = records_for(python, 3, 5) + [malformed(python)[index]] + records_for(python, 4, 5)
    rc = records_for(c, 3, 5) + [malformed(c)[index]] + records_for(c, 4, 5)
    expected = run(fold_records, rp)
    assert (expected[0] is None) == (index == 10)  # a ServerCells-like fold of ClientCells goes through
    assert run(core.fold, rc) == expected
    assert state(c) == state(python)


def test_a_cell_changed_to_another_shape_goes_to_the_reference() -> None:
    python, c = Metrics("w0", 10), Metrics("w0", 10)
    for metrics in (python, c):
        metrics.client_cells("f", "sync", "w1").duration.append(0)  # a bucket too many
        metrics.server_cells("f", "w1").exemplars.pop()
    rp = [(fold_finished, python.client_cells("f", "sync", "w1"), 1e9, None),
          (fold_served, python.server_cells("f", "w1"), 1e9, Span(True))]
    rc = [(fold_finished, c.client_cells("f", "sync", "w1"), 1e9, None),
          (fold_served, c.server_cells("f", "w1"), 1e9, Span(True))]
    expected = run(fold_records, rp)
    assert expected[0] is not None and expected[0][0] is IndexError  # the +Inf exemplar slot is gone
    assert run(core.fold, rc) == expected
    assert state(c) == state(python)


def test_drain_uses_the_fold_it_is_given() -> None:
    metrics = Metrics("w0", 10)
    metrics.fold_records = core.fold
    for record in records_for(metrics, 5, 300):
        metrics.record(record)
    assert metrics.drain(256) is True and metrics.drain() is False
    reference = Metrics("w0", 10)
    fold_records(collections.deque(records_for(reference, 5, 300)), 300)
    assert state(metrics) == state(reference)


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(TypeError):
        core.fold(collections.deque(), "3")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="increasing floats"):
        core.configure_fold(fold_message, fold_started, fold_finished, fold_split, fold_served,
                            (2.0, 1.0), (), (), (), tuple, tuple, tuple)
    with pytest.raises(TypeError, match="12 arguments"):
        core.configure_fold(fold_message)  # type: ignore[call-arg]
    # The refused calls left the configuration whole: the fold still matches the reference.
    test_c_fold_leaves_what_the_reference_leaves(0)


def test_folding_keeps_no_object() -> None:
    """A fold of thousands of records, exemplars and errors included, leaves no object behind."""
    import sys

    metrics = Metrics("w0", 10)
    batches = [records_for(metrics, seed, 2000) + malformed(metrics)[:4] for seed in range(4)]

    def fold_all(batch: list[tuple]) -> None:
        queue = collections.deque(batch)
        while queue:
            try:
                core.fold(queue, len(queue))
            except Exception:
                pass

    fold_all(batches[0])
    fold_all(batches[1])
    before = sys.getallocatedblocks()  # the records stay alive throughout: their freeing hides nothing
    fold_all(batches[2])
    fold_all(batches[3])
    assert sys.getallocatedblocks() - before < 100


@pytest.mark.parametrize("seed", range(5))
def test_records_is_a_deque_to_python(seed: int) -> None:
    """The C core's record queue against a deque: the same appends, poplefts and clears (its ring wrapping and
    growing on the way) leave the same records in the same order; folded, the same cells."""
    assert core is not None
    rng = random.Random(seed)
    records, reference = core.Records(), collections.deque()
    for step in range(3000):
        roll = rng.random()
        if roll < 0.6:
            record = (step, rng.random())
            records.append(record)
            reference.append(record)
        elif roll < 0.995:
            if reference:
                assert records.popleft() == reference.popleft()
            else:
                with pytest.raises(IndexError):
                    records.popleft()
        else:
            records.clear()
            reference.clear()
        assert len(records) == len(reference) and bool(records) is bool(reference)
    assert list(records) == list(reference)
    python, c = Metrics("w0", 10), Metrics("w0", 10)
    c.use_queue(core.Records())
    c.fold_records = core.fold
    for record in records_for(c, seed, 400):
        c.record(record)
    assert c.drain(100) is True and c.drain() is False
    fold_records(collections.deque(records_for(python, seed, 400)), 400)
    assert state(c) == state(python)


def test_records_is_not_made_with_arguments() -> None:
    assert core is not None
    with pytest.raises(TypeError):
        core.Records(1)  # type: ignore[call-arg]
