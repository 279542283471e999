"""The compiled hot path (hatch_build.py) and its pure-Python fallback: which one a process
imports, the switch that picks the .py files, and what the process reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

import rpc_observe
from rpc_observe.telemetry.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from hatch_build import COMPILED  # noqa: E402

MODULES = [rel[: -len(".py")].replace("/", ".") for rel in COMPILED]
BUILT = all((ROOT / (rel[: -len(".py")] + sysconfig.get_config_var("EXT_SUFFIX"))).exists() for rel in COMPILED)


def _imported(env: dict[str, str]) -> dict:
    """Where each compiled module comes from in a fresh interpreter, and what it reports."""
    code = ("import importlib, json, logging, rpc_observe\n"
            f"files = {{m: importlib.import_module(m).__file__ for m in {MODULES!r}}}\n"
            "print(json.dumps({'files': files, 'hot_path': rpc_observe.hot_path()}))")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RPC_OBSERVE")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, cwd=ROOT, capture_output=True,
                         text=True, check=True, timeout=120)
    return {**json.loads(out.stdout), "stderr": out.stderr}


def test_no_extensions_imports_every_module_from_its_py_file():
    got = _imported({"RPC_OBSERVE_NO_EXTENSIONS": "1"})
    assert all(f.endswith(".py") for f in got["files"].values()), got["files"]
    assert got["hot_path"] == "python"


@pytest.mark.skipif(not BUILT, reason="not built in place: python hatch_build.py")
def test_built_modules_are_imported_compiled():
    got = _imported({})
    assert not [f for f in got["files"].values() if f.endswith(".py")], got["files"]
    assert got["hot_path"] == "compiled"


@pytest.mark.skipif(not BUILT, reason="not built in place: python hatch_build.py")
def test_a_malformed_switch_is_named_and_the_compiled_modules_are_kept():
    got = _imported({"RPC_OBSERVE_NO_EXTENSIONS": "maybe"})
    assert got["hot_path"] == "compiled"
    assert "RPC_OBSERVE_NO_EXTENSIONS='maybe' is not a flag" in got["stderr"]


def test_build_info_reports_the_hot_path():
    registry = CollectorRegistry()
    registry.register(Metrics("worker0", max_names=10))
    text = generate_latest(registry).decode()
    assert (f'rpc_observe_build_info{{hot_path="{rpc_observe.hot_path()}",version="{rpc_observe.__version__}",'
            'worker="worker0"} 1.0') in text
