"""Builds the merge's C loops (rpc_observe/merge/_speedups.c) into the wheel.

Where no C compiler works, the wheel is built without them, with one message,
and ``rpc-observe merge`` runs in pure Python (the same output, in 1.4-1.7
times the time).  ``RPC_OBSERVE_MERGE_SPEEDUPS=0`` at install builds without
them too.  ``python hatch_build.py`` builds them in place, next to the source
(for tests run from a checkout, as an editable install does).
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
from typing import Any

try:
    from hatchling.builders.hooks.plugin.interface import BuildHookInterface
except ImportError:  # run as a script, outside the build
    BuildHookInterface = object  # type: ignore[assignment,misc]

SOURCE = Path("rpc_observe", "merge", "_speedups.c")
MODULE = "_speedups" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")


def build_speedups(root: Path, out_dir: Path) -> Path | None:
    """Compile the module into ``out_dir``; None (and one message on stderr) where it cannot."""
    if os.environ.get("RPC_OBSERVE_MERGE_SPEEDUPS", "").strip() == "0":
        return None
    out = out_dir / MODULE
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    link = ["-bundle", "-undefined", "dynamic_lookup"] if sys.platform == "darwin" else ["-shared"]
    cmd = [*cc, "-O2", "-fPIC", *link, "-I", sysconfig.get_paths()["include"], str(root / SOURCE), "-o", str(out)]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        print(f"rpc_observe: the merge's C loops are not built ({shlex.join(cmd)}: {detail.strip()[:500]}); "
              "rpc-observe merge runs in pure Python", file=sys.stderr)
        return None
    return out


class CustomBuildHook(BuildHookInterface):
    _tmp: str | None = None

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        # An editable install runs the package from this tree: the module goes next to its source.
        self._tmp = None if version == "editable" else tempfile.mkdtemp()
        out = build_speedups(Path(self.root), Path(self.root, SOURCE.parent) if self._tmp is None else Path(self._tmp))
        if out is None:
            return
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        if self._tmp is not None:
            build_data["force_include"][str(out)] = str(SOURCE.with_name(MODULE))

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)


if __name__ == "__main__":
    root = Path(__file__).resolve().parent
    sys.exit(0 if build_speedups(root, root / SOURCE.parent) else 1)
