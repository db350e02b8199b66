"""How much a study's figures move between runs of one commit, beyond each run's own interval.

    python -m reco.cli.between_runs --pair A1.csv B1.csv --pair A2.csv B2.csv ... \
        [--names "run 26" "run 27" --names ...] --out experiments/<study>/between_runs.json

Each --pair is two comparison.csv files of one commit on one machine kind (earlier runs: `git show
<commit>:experiments/<study>/comparison.csv`, e.g. through `<(git show ...)`). Prints each figure's sd of
log(figure) between runs with a rough range and how many differences it rests on, and writes the JSON
`python -m reco.cli.agree --between-runs` reads (reco.report.agree says what it is and why). From three
pairs on it also judges each pair with the others' sd and prints how often they read DIFFER: about 5 % of
the figures judged where the sd holds.
Exit codes: 0 written, 2 bad input (the message names the file and the column).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from reco.cli.errors import exits_cleanly
from reco.report.agree import (
    AgreeInputError,
    between_text,
    estimate_between_runs,
    leave_one_out,
    leave_one_out_text,
)


@exits_cleanly("reco.cli.between_runs")
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m reco.cli.between_runs", description=__doc__.splitlines()[0])
    ap.add_argument("--pair", nargs=2, type=Path, action="append", required=True, metavar=("A", "B"))
    ap.add_argument("--names", nargs=2, action="append", metavar=("A", "B"), help="one per --pair, in order")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    names = args.names or [(f"pair {i + 1} a", f"pair {i + 1} b") for i in range(len(args.pair))]
    if len(names) != len(args.pair):
        raise AgreeInputError(
            f"--names: given {len(names)} times for {len(args.pair)} --pair: expected one each"
        )
    b = estimate_between_runs([tuple(p) for p in args.pair], [tuple(n) for n in names])
    if not b.sd:
        raise AgreeInputError(
            "--pair: no figure had a closed interval in both runs of any pair: nothing to estimate"
        )
    b.save(args.out)
    print(f"between-run sd of log(figure): {between_text(b)} -> {args.out}")
    if len(args.pair) >= 3:
        loo = leave_one_out_text(leave_one_out([tuple(p) for p in args.pair]))
        print(f"each pair judged with the others' sd (about 5 % differ where it holds): {loo}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
