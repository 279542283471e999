"""The import directions docs/architecture.md promises, read from the source.

hooks -> telemetry, never back; telemetry imports no torch; merge and doctor import only the
standard library (and themselves); report imports only the standard library, merge and doctor;
config imports only the standard library. Lazy imports
inside functions count too.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "rpc_observe"
STDLIB = sys.stdlib_module_names


def _module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, package: Path = PACKAGE) -> set[str]:
    """Every module `path` imports, absolute (relative imports resolved)."""
    name = _module_name(path, package)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            found.add(prefix)
            if node.level and not node.module:  # `from . import x`: x is a module of the package
                found.update(f"{prefix}.{alias.name}" for alias in node.names)
    return found


def _modules(subpackage: str) -> list[Path]:
    return sorted((PACKAGE / subpackage).rglob("*.py"))


def _top(name: str) -> str:
    return name.split(".")[0]


def _within(name: str, *roots: str) -> bool:
    return any(name == root or name.startswith(root + ".") for root in roots)


@pytest.mark.parametrize("path", _modules("telemetry"), ids=lambda p: p.name)
def test_telemetry_imports_no_torch_and_no_hooks(path: Path) -> None:
    bad = {m for m in _imports(path)
           if _top(m) == "torch" or _within(m, "rpc_observe.hooks", "rpc_observe.merge", "rpc_observe.demo",
                                            "rpc_observe.instrumentor")}
    assert not bad, f"{path.name} imports {sorted(bad)}"


@pytest.mark.parametrize("path", _modules("hooks"), ids=lambda p: p.name)
def test_hooks_import_only_telemetry_of_the_package(path: Path) -> None:
    bad = {m for m in _imports(path)
           if _within(m, "rpc_observe.merge", "rpc_observe.demo", "rpc_observe.instrumentor", "rpc_observe.cli")}
    assert not bad, f"{path.name} imports {sorted(bad)}"


@pytest.mark.parametrize("path", _modules("merge"), ids=lambda p: p.name)
def test_merge_imports_only_the_standard_library(path: Path) -> None:
    bad = {m for m in _imports(path) if _top(m) not in STDLIB and not _within(m, "rpc_observe.merge")}
    assert not bad, f"{path.name} imports {sorted(bad)}"


@pytest.mark.parametrize("path", _modules("doctor"), ids=lambda p: p.name)
def test_doctor_imports_only_the_standard_library(path: Path) -> None:
    """The doctor reads a stuck job from any machine: no torch, OpenTelemetry or prometheus_client."""
    bad = {m for m in _imports(path) if _top(m) not in STDLIB and not _within(m, "rpc_observe.doctor")}
    assert not bad, f"{path.name} imports {sorted(bad)}"


@pytest.mark.parametrize("path", _modules("report"), ids=lambda p: p.name)
def test_report_imports_only_the_standard_library_merge_and_doctor(path: Path) -> None:
    """The report reads a run on any machine, as merge does: no torch, OpenTelemetry or prometheus_client."""
    bad = {m for m in _imports(path) if _top(m) not in STDLIB
           and not _within(m, "rpc_observe.report", "rpc_observe.merge", "rpc_observe.doctor")}
    assert not bad, f"{path.name} imports {sorted(bad)}"


def test_config_imports_only_the_standard_library() -> None:
    bad = {m for m in _imports(PACKAGE / "config.py") if _top(m) not in STDLIB}
    assert not bad


def test_the_six_products_are_sub_packages() -> None:
    for name in ("hooks", "telemetry", "merge", "doctor", "report", "demo"):
        assert (PACKAGE / name / "__init__.py").is_file() and len(_modules(name)) >= 2, name
    flat = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert flat == ["__init__.py", "__main__.py", "_bootstrap.py", "_patching.py", "cli.py", "config.py",
                    "instrumentor.py"]


def test_the_checker_sees_violations(tmp_path: Path) -> None:
    """The rules above can fail: lazy and relative imports of torch and the hooks are seen."""
    bad = tmp_path / "rpc_observe" / "telemetry" / "bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("def f():\n    import torch.distributed\n    from ..hooks import calls\n    from . import health\n")
    found = _imports(bad, tmp_path / "rpc_observe")
    assert {"torch.distributed", "rpc_observe.hooks", "rpc_observe.telemetry.health"} <= found
    fake = PACKAGE / "telemetry" / "metrics.py"
    imports = _imports(fake)
    assert "prometheus_client.core" in imports and "rpc_observe.telemetry.health" in imports
    hooks_client = _imports(PACKAGE / "hooks" / "client.py")
    assert "rpc_observe.telemetry.runtime" in hooks_client and "torch" in hooks_client
