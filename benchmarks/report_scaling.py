"""How ``rpc-observe report`` scales with its input: wall time, peak memory and the page's size.

Writes the synthetic span files of ``merge_scaling.py`` (a 16-worker run in the file exporter's
exact format, every worker calling every other: 11,520 call sites) and runs ``rpc-observe report``
on each size in a fresh subprocess.  Run by hand (the 1M-span input is about 0.6 GB, deleted after)::

    .venv/bin/python benchmarks/report_scaling.py                    # 10k, 100k, 1M spans
    .venv/bin/python benchmarks/report_scaling.py --sizes 1000000 --servers 2
"""

from __future__ import annotations

import argparse
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from merge_scaling import WORKERS, generate  # noqa: E402


def run_report(inputs: Path, output: Path) -> tuple[float, float]:
    """Wall seconds and peak RSS (MB) of one ``rpc-observe report`` in a fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "rpc_observe", "report", str(inputs), "-o", str(output), "-q"], check=True)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return wall, max(peak, before) / 1024


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10000,100000,1000000", help="span counts, comma-separated")
    ap.add_argument("--servers", type=int, default=0, metavar="K",
                    help="workers 0..K-1 serve and the others call them (default: every worker calls every other)")
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one, deleted)")
    args = ap.parse_args(argv)
    if not 0 <= args.servers < WORKERS:
        ap.error(f"--servers: 0 (all pairs) to {WORKERS - 1}")
    work = Path(args.dir or tempfile.mkdtemp(prefix="report_scaling_"))
    print(f"{'spans':>10} {'input MB':>9} {'wall s':>7} {'peak RSS MB':>12} {'page kB':>8}")
    try:
        for n in (int(s) for s in args.sizes.split(",")):
            inputs, output = work / f"spans-{n}", work / f"report-{n}.html"
            size_in = generate(inputs, n, servers=args.servers)
            wall, rss = run_report(inputs, output)
            print(f"{n:>10,} {size_in / 1e6:>9.0f} {wall:>7.2f} {rss:>12.0f} {output.stat().st_size / 1e3:>8.0f}",
                  flush=True)
            shutil.rmtree(inputs)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
