"""Compiles the per-RPC modules with Cython into C extensions, beside their .py files.

The hot path's cost is the interpreter's, not its logic's: the same source compiled
runs the wrappers without bytecode dispatch (BENCHMARKS.md, "Compiled hot path"). The
modules are compiled unchanged, so the .py files are the fallback, byte for byte the
same logic: without a C compiler (or Cython) the wheel is pure Python, and
`RPC_OBSERVE_NO_EXTENSIONS=1` makes an installed one import the .py files.

Used two ways:
- by hatchling, as the wheel's build hook (pyproject.toml `[tool.hatch.build.hooks.custom]`);
- by hand, to build in place for the tests of a source checkout: `python hatch_build.py`.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

# What runs per RPC, on the agent's threads (hooks) and on the housekeeping and export threads
# (the fold and the span encoding). Not here: code that runs once (patching, config, naming)
# and code that must stay introspectable (the post-import hook, compat's signature checks).
COMPILED = (
    "rpc_observe/hooks/calls.py",
    "rpc_observe/hooks/client.py",
    "rpc_observe/hooks/pickler.py",
    "rpc_observe/hooks/server.py",
    "rpc_observe/telemetry/exporters.py",
    "rpc_observe/telemetry/metrics.py",
    "rpc_observe/telemetry/tracing.py",
)
# Python semantics kept: no typing from annotations, functions that behave as Python's.
DIRECTIVES = {"language_level": 3, "binding": True, "annotation_typing": False, "embedsignature": False,
              "always_allow_keywords": True}
ROOT = Path(__file__).resolve().parent


def build(out_root: Path, work: Path) -> list[Path]:
    """Compiles every COMPILED module into `out_root` (same relative paths); returns the .so files."""
    from Cython.Compiler import Options
    from Cython.Compiler.Main import CompilationOptions, compile_single

    Options.docstrings = True
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    cflags = shlex.split(sysconfig.get_config_var("CFLAGS") or "") + shlex.split(
        sysconfig.get_config_var("CCSHARED") or "-fPIC")
    ldshared = [*cc, "-shared"] if os.environ.get("CC") else shlex.split(
        sysconfig.get_config_var("LDSHARED") or "cc -shared")
    include = sysconfig.get_paths()["include"]
    built = []
    for rel in COMPILED:
        source = ROOT / rel
        module = rel[: -len(".py")].replace("/", ".")
        c_file = work / (module + ".c")
        options = CompilationOptions(language_level=3, compiler_directives=DIRECTIVES, output_file=str(c_file))
        result = compile_single(str(source), options, full_module_name=module)
        if result.num_errors:
            raise RuntimeError(f"Cython could not compile {rel}")
        obj = work / (module + ".o")
        so = out_root / (rel[: -len(".py")] + suffix)
        so.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([*cc, *cflags, "-O2", "-g0", f"-I{include}", "-c", str(c_file), "-o", str(obj)], check=True)
        subprocess.run([*ldshared, str(obj), "-o", str(so)], check=True)
        built.append(so)
    return built


def clean(root: Path = ROOT) -> None:
    """Removes in-place builds (the .py files are then imported)."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    for rel in COMPILED:
        (root / (rel[: -len(".py")] + suffix)).unlink(missing_ok=True)


try:
    from hatchling.builders.hooks.plugin.interface import BuildHookInterface
except ImportError:  # run by hand, without hatchling
    BuildHookInterface = object  # type: ignore[assignment,misc]


class CustomBuildHook(BuildHookInterface):  # type: ignore[misc,valid-type]
    """Adds the compiled modules to the wheel; a failed build leaves a pure-Python wheel, with a warning."""

    def initialize(self, version: str, build_data: dict) -> None:
        if self.target_name != "wheel" or version == "editable" or os.environ.get("RPC_OBSERVE_NO_EXTENSIONS"):
            return
        work = self._work = Path(tempfile.mkdtemp(prefix="rpc_observe_build_"))
        try:
            built = build(work / "out", work)
        except Exception as e:  # no compiler, no Cython: the pure-Python wheel works everywhere
            print(f"rpc_observe: building the compiled hot path failed ({e}); the wheel is pure Python",
                  file=sys.stderr)
            return
        for so in built:
            build_data["force_include"][str(so)] = str(so.relative_to(work / "out"))
        build_data["pure_python"] = False
        build_data["infer_tag"] = True

    def finalize(self, version: str, build_data: dict, artifact_path: str) -> None:
        work = getattr(self, "_work", None)
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--clean"]:
        clean()
    else:
        with tempfile.TemporaryDirectory() as tmp:
            for so in build(ROOT, Path(tmp)):
                print(so.relative_to(ROOT))
