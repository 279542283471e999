"""Marks each test `unit` (tests/unit: in-process, seconds) or `e2e` (real worker processes)."""

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        unit = (HERE / "unit") in Path(str(item.fspath)).parents
        item.add_marker(pytest.mark.unit if unit else pytest.mark.e2e)
