"""Builds the C modules into the wheel: the per-call core (rpc_observe/hooks/_core.c), the merge's
C loops (rpc_observe/merge/_speedups.c), the flight recorder's stack reader
(rpc_observe/hooks/_stacks.c) and the span file exporter's encoding (rpc_observe/telemetry/_spanjson.c).

Where no C compiler works, the wheel is built without them, with one message each: the
pickler and UDF hooks run their Python references (more CPU per RPC), ``rpc-observe merge``
runs in pure Python (the same output, in 1.4-1.7 times the time) and the recorder reads
stacks in Python (see hooks/snapshot.py). ``RPC_OBSERVE_MERGE_SPEEDUPS=0`` at install builds
without the merge's loops; ``RPC_OBSERVE_NO_EXTENSIONS=1`` at run time uses none of them.
``python hatch_build.py`` builds them in place, next to the source (for tests run
from a checkout, as an editable install does)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

try:
    from hatchling.builders.hooks.plugin.interface import BuildHookInterface
except ImportError:  # run as a script, outside the build
    BuildHookInterface = object  # type: ignore[assignment,misc]

# (source, what is lost without it, the variable whose value 0 skips it)
EXTENSIONS = (
    (Path("rpc_observe", "merge", "_speedups.c"), "rpc-observe merge runs in pure Python",
     "RPC_OBSERVE_MERGE_SPEEDUPS"),
    (Path("rpc_observe", "hooks", "_core.c"), "the pickler and UDF hooks run in Python (more CPU per RPC)", None),
    (Path("rpc_observe", "hooks", "_stacks.c"),
     "the flight recorder reads other threads' stacks in Python, only of threads waiting 1 s or more", None),
    (Path("rpc_observe", "telemetry", "_spanjson.c"), "the span file exporter encodes in Python (more CPU per span)",
     None),
)


def build_extension(root: Path, source: Path, lost: str, switch: str | None, out_dir: Path) -> Path | None:
    """Compile one module into ``out_dir``; None (and one message on stderr) where it cannot."""
    if switch is not None and os.environ.get(switch, "").strip() == "0":
        return None
    out = out_dir / (source.stem + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    link = ["-bundle", "-undefined", "dynamic_lookup"] if sys.platform == "darwin" else ["-shared"]
    cmd = [*cc, "-O2", "-fPIC", *link, "-I", sysconfig.get_paths()["include"], str(root / source), "-o", str(out)]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        print(f"rpc_observe: {source} is not built ({shlex.join(cmd)}: {detail.strip()[:500]}); {lost}",
              file=sys.stderr)
        return None
    return out


class CustomBuildHook(BuildHookInterface):
    _tmp: str | None = None

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        # An editable install runs the package from this tree: the module goes next to its source.
        self._tmp = None if version == "editable" else tempfile.mkdtemp()
        for source, lost, switch in EXTENSIONS:
            out_dir = Path(self.root, source.parent) if self._tmp is None else Path(self._tmp)
            out = build_extension(Path(self.root), source, lost, switch, out_dir)
            if out is None:
                continue
            build_data["pure_python"] = False
            build_data["infer_tag"] = True
            if self._tmp is not None:
                build_data["force_include"][str(out)] = str(source.with_name(out.name))

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)


if __name__ == "__main__":
    root = Path(__file__).resolve().parent
    built = [build_extension(root, source, lost, switch, root / source.parent) for source, lost, switch in EXTENSIONS]
    sys.exit(0 if all(built) else 1)
