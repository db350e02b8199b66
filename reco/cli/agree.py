"""Do two runs of one study agree? Issue 9's reproducibility check, from two comparison.csv files.

For every variant in both files and every ratio the report gives an interval for (speed-ups and QPS
gains), the runs DIFFER on a figure when the 95 % interval of run A / run B excludes 1, are CONSISTENT
when it holds 1 and is closed and at most --max-width wide (hi / lo), and are UNDECIDED when it holds 1
but is open or wider (reco.report.agree says why); a figure missing from either run is listed as such.

    python -m reco.cli.agree RUN_A/comparison.csv RUN_B/comparison.csv --names "run A" "run B" \
        [--between-runs experiments/<study>/between_runs.json]

--between-runs widens each run-ratio interval by what runs of one commit have differed by on this
machine kind beyond their own intervals (written by `python -m reco.cli.between_runs` from earlier pairs;
reco.report.agree says why).

Prints a Markdown table and a one-line summary starting with the overall verdict, and a note when the
two runs' common loads differ by more than 5 % (their common-load ratios then compare different loads).
Exit codes:
0 consistent, 1 differ on some figure, 2 bad input (the message names the file and the column),
3 undecided (no figure differs, but some could not be told, or none could be compared).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from reco.cli.errors import exits_cleanly
from reco.report.agree import (
    MAX_WIDTH,
    NO_BETWEEN,
    BetweenRuns,
    Verdict,
    between_text,
    compare,
    load_note,
    markdown,
    summary,
)

EXIT = {Verdict.CONSISTENT: 0, Verdict.DIFFER: 1, Verdict.UNDECIDED: 3}


def width(s: str) -> float:
    """--max-width: a factor above 1 (an interval no wider than 1x would need identical runs)."""
    try:
        x = float(s)
    except ValueError:
        x = 0.0
    if not x > 1.0:
        raise argparse.ArgumentTypeError(f"expected a factor above 1 (hi / lo), got {s!r}")
    return x


@exits_cleanly("reco.cli.agree")
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m reco.cli.agree", description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path, help="run A's comparison.csv")
    ap.add_argument("b", type=Path, help="run B's comparison.csv")
    ap.add_argument("--names", nargs=2, default=("run A", "run B"), metavar=("A", "B"))
    ap.add_argument(
        "--max-width",
        type=width,
        default=MAX_WIDTH,
        metavar="FACTOR",
        help=f"widest run-ratio interval (hi / lo) that decides 'consistent' (default {MAX_WIDTH:g}); "
        "wider or open intervals that hold 1 are 'undecided'",
    )
    ap.add_argument(
        "--between-runs",
        type=Path,
        metavar="JSON",
        help="the between-run component (python -m reco.cli.between_runs); default: none",
    )
    args = ap.parse_args(argv)
    between = BetweenRuns.load(args.between_runs) if args.between_runs else NO_BETWEEN
    c = compare(args.a, args.b, args.max_width, between)
    print(markdown(c, tuple(args.names)))
    print("\n" + summary(c))
    if note := load_note(args.a, args.b, tuple(args.names)):
        print(note)
    if between.sd:
        print(f"between-run sd of log(figure) ({args.between_runs}): {between_text(between)}")
    return EXIT[c.overall]


if __name__ == "__main__":
    sys.exit(main())
