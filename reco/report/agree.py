"""Do two runs of one study agree? Issue 9's reproducibility check, from two comparison.csv files.

For every variant in both files and every ratio the report gives an interval for (speed-ups and QPS
gains), the two runs' figures are compared by an interval on their ratio, run A / run B (MOVER on the log
scale from the two intervals, reco.stats.dependent.ratio_ci): the runs DIFFER on the figure when that
interval excludes 1, and are CONSISTENT when it holds 1 -- which is only as strong as the interval is
narrow, so its width is printed beside the verdict. (Overlapping 95 % intervals, the old test, are a weak
test: two intervals can overlap while the difference is significant.) The QPS gain's interval is a range
over the capacity brackets, not a confidence interval; it is compared the same way and labelled so. A
figure missing from either run (an empty cell: not measured, or n too small) is listed as such, never
counted as consistent.

    python -m reco.cli.agree RUN_A/comparison.csv RUN_B/comparison.csv --names "run 7" "run 8"

Prints a Markdown table and a one-line summary; exits 1 when the runs differ on some figure.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from reco.report.fmt import DASH, short, table
from reco.stats import Estimate
from reco.stats.dependent import ratio_ci

FIGURES: dict[str, str] = {
    "speedup_p99_unloaded": "p99 speed-up unloaded",
    "speedup_p50_unloaded": "p50 speed-up unloaded",
    "speedup_p99_equal_util": "p99 speed-up at equal utilisation",
    "speedup_p99_common": "p99 speed-up at the common load",
    "qps_gain": "max-QPS gain (bracket range)",
}


@dataclass(frozen=True)
class Pair:
    variant: str
    figure: str
    a: Estimate | None
    b: Estimate | None

    @property
    def ratio(self) -> Estimate | None:
        """Run A's figure / run B's with its interval; None when either run lacks the figure."""
        if self.a is None or self.b is None:
            return None
        r = ratio_ci(self.a, self.b)
        return r if r.supported else None

    @property
    def consistent(self) -> bool | None:
        """True when the ratio's interval holds 1, False when it excludes it, None when it cannot be
        formed (a figure missing in a run)."""
        r = self.ratio
        return None if r is None else r.lo <= 1.0 <= r.hi


def read_rows(path: Path) -> dict[str, dict[str, str]]:
    """comparison.csv as {variant: row}; a clear error when it is not one."""
    try:
        with open(path, newline="") as fh:
            rows = list(csv.DictReader(fh))
    except OSError as e:
        raise SystemExit(f"{path}: cannot read ({e.strerror})") from None
    if not rows or "variant" not in rows[0]:
        raise SystemExit(f"{path}: expected a study's comparison.csv with a 'variant' column")
    return {r["variant"]: r for r in rows}


def ci(row: dict[str, str], key: str, path: Path) -> Estimate | None:
    """The figure `key` with its CI from one row; None when a cell is empty (not measured or not supported)."""
    cells = [row.get(k, "") for k in (key, f"{key}_lo", f"{key}_hi")]
    if any(c in ("", None) for c in cells):
        return None
    try:
        return Estimate(*map(float, cells), n=0)  # comparison.csv carries no n for ratios
    except ValueError:
        raise SystemExit(
            f"{path}: variant {row['variant']!r}, column {key!r}: expected numbers, got {cells}"
        ) from None


def pairs(a: Path, b: Path) -> list[Pair]:
    """Every (variant, figure) that either run has, run a's variants first; a variant one run lacks is
    listed with its figures missing there, not dropped."""
    ra, rb = read_rows(a), read_rows(b)
    out = []
    for name in dict.fromkeys([*ra, *rb]):
        for key in FIGURES:
            x, y = ci(ra.get(name, {}), key, a), ci(rb.get(name, {}), key, b)
            if x is None and y is None:
                continue  # the reference, or a figure neither run has
            out.append(Pair(name, key, x, y))
    return out


def markdown(ps: list[Pair], names: tuple[str, str]) -> str:
    word = {True: "consistent", False: "**differ**", None: f"{DASH} (missing in a run)"}
    rows = [
        [
            f"`{p.variant}`",
            FIGURES[p.figure],
            short(p.a, ".2f", "×"),
            short(p.b, ".2f", "×"),
            short(p.ratio, ".2f", "×"),
            word[p.consistent],
        ]
        for p in ps
    ]
    head = ["variant", "figure", *names, f"{names[0]} / {names[1]} [95 % CI]", "verdict"]
    return "\n".join(table(head, rows))


def summary(ps: list[Pair]) -> str:
    judged = [p for p in ps if p.consistent is not None]
    ok = sum(p.consistent for p in judged)
    return (
        f"{ok} of {len(judged)} figures consistent (their ratio's 95 % interval holds 1), "
        f"{len(judged) - ok} differ; {len(ps) - len(judged)} missing in a run"
    )
