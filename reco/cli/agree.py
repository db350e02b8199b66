"""Do two runs of one study agree? Issue 9's reproducibility check, from two comparison.csv files.

For every variant in both files and every ratio the report gives an interval for (speed-ups and QPS
gains), the runs DIFFER on a figure when the 95 % interval of run A / run B excludes 1 (reco.report.agree
says how it is formed); a figure missing from either run is listed as such, never counted as consistent.

    python -m reco.cli.agree RUN_A/comparison.csv RUN_B/comparison.csv --names "run A" "run B"

Prints a Markdown table and a one-line summary; exits 1 when the runs differ on some figure.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from reco.report.agree import markdown, pairs, summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m reco.cli.agree", description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path, help="run A's comparison.csv")
    ap.add_argument("b", type=Path, help="run B's comparison.csv")
    ap.add_argument("--names", nargs=2, default=("run A", "run B"), metavar=("A", "B"))
    args = ap.parse_args(argv)
    ps = pairs(args.a, args.b)
    print(markdown(ps, tuple(args.names)))
    print("\n" + summary(ps))
    return 0 if all(p.consistent is not False for p in ps) else 1


if __name__ == "__main__":
    sys.exit(main())
