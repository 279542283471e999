"""The metric records' type aliases (telemetry/metrics.py) are checked: mypy rejects a record whose layout is
not its fold function's, and accepts each layout the hot paths build. No run-time cost to test: they are
aliases of tuple types, and the records stay plain tuple displays."""

from __future__ import annotations

from pathlib import Path
from typing import get_origin

import pytest

from rpc_observe.telemetry import metrics

api = pytest.importorskip("mypy.api")

SNIPPET = '''
from rpc_observe.telemetry.metrics import (Metrics, fold_finished, fold_message, fold_served, fold_split,
                                           fold_started)

metrics = Metrics("w", 3)
cells = metrics.client_cells("f", "sync", "d")
message = metrics.message_cells("serialize", "request", "f")
served = metrics.server_cells("f", "d")
metrics.record((fold_started, cells))
metrics.record((fold_finished, cells, 1.0, None))
metrics.record((fold_split, cells, 1.0, 0.5, None))
metrics.record((fold_served, served, 1.0, None))
metrics.record((fold_message, message, 10, 1, 4, 4, 1e-6, cells.sent_bytes, 18))
metrics.record((fold_message, message, 10, 1, 4, 4, 1e-6, None, 0))
metrics.record((fold_finished, cells, 1.0, 0.5))  # bad
metrics.record((fold_split, cells, 1.0, None))  # bad
metrics.record((fold_served, cells, 1.0, None))  # bad
metrics.record((fold_message, cells, 10, 1, 4, 4, 1e-6, None, 0))  # bad
metrics.record((fold_started, cells, 1.0))  # bad
'''


def test_mypy_rejects_a_record_whose_layout_is_not_its_folds(tmp_path: Path) -> None:
    source = tmp_path / "records.py"
    source.write_text(SNIPPET)
    out, err, status = api.run(["--cache-dir", str(tmp_path / "cache"), "--follow-imports=silent",
                                "--no-error-summary", "--no-color-output", str(source)])
    lines = SNIPPET.splitlines()
    bad = sorted(i + 1 for i, line in enumerate(lines) if "# bad" in line)
    flagged = sorted({int(line.split(":")[1]) for line in out.splitlines() if ": error:" in line})
    assert status == 1 and flagged == bad, out + err


def test_the_aliases_are_plain_tuple_types() -> None:
    for alias in (metrics.MessageRecord, metrics.StartedRecord, metrics.FinishedRecord, metrics.SplitRecord,
                  metrics.ServedRecord):
        assert get_origin(alias) is tuple
