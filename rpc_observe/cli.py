"""The `rpc-observe` command: `demo` runs the main job, `merge` joins the workers' traces,
`doctor` says why a job is stuck, `report` writes one HTML page of a run."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="rpc-observe", description=__doc__)
    parser.add_argument("command", choices=("demo", "merge", "doctor", "report"),
                        help="demo: run the demo job; merge: merge traces; doctor: say why a job is stuck; "
                             "report: one HTML page of a run")
    args, rest = parser.parse_known_args(argv[:1])
    if args.command == "demo":
        from . import demo

        return demo.main(argv[1:])
    if args.command == "doctor":
        from . import doctor

        return doctor.main(argv[1:])
    if args.command == "report":
        from . import report

        return report.main(argv[1:])
    from . import merge

    return merge.main(argv[1:])
