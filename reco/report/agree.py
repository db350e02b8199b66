"""Do two runs of one study agree? Issue 9's reproducibility check, from two comparison.csv files.

For every variant in both files and every ratio the report gives an interval for (speed-ups and QPS
gains), the two runs' figures are compared by an interval on their ratio, run A / run B (MOVER on the log
scale from the two intervals, reco.stats.dependent.ratio_ci). (Overlapping 95 % intervals, the old test,
are a weak test: two intervals can overlap while the difference is significant.) The QPS gain's interval
is a range over the capacity brackets, not a confidence interval; it is compared the same way and
labelled so. Each figure gets one verdict:

- DIFFER when the ratio's interval excludes 1, however wide it is: the runs disagree either way.
- CONSISTENT when it holds 1 and is closed and at most `max_width` wide (hi / lo <= MAX_WIDTH = 2 by
  default: the runs agree to within a factor of 2 at worst, about ±40 % either side of 1).
- UNDECIDED when it holds 1 but is open (a bound of 0 or inf: some run's interval had no bound there) or
  wider than that: holding 1 is then no evidence of agreement, and issue 47 saw "12 of 12 consistent"
  from twelve intervals that were all [0, inf).
- MISSING when a run lacks the figure (an empty cell: not measured, or n too small).

    python -m reco.cli.agree RUN_A/comparison.csv RUN_B/comparison.csv --names "run A" "run B"

The two files must be comparison.csv files of one load-tested study (check_same_study); otherwise
AgreeInputError names the file and the column.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from enum import StrEnum
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
# Every column a figure is read from: both files must carry the same ones.
FIGURE_COLUMNS: tuple[str, ...] = tuple(k + s for k in FIGURES for s in ("", "_lo", "_hi"))

# The widest run-ratio interval (hi / lo) that still decides "consistent": 2 means the runs agree to
# within a factor of 2 at worst. Wider, the interval holds 1 for runs that differ by more than the
# effects the report states (the case study's speed-ups are 1.5-4x), so it could not tell.
MAX_WIDTH = 2.0


class AgreeInputError(ValueError):
    """The files cannot be compared; the message names the file and the column."""


class Verdict(StrEnum):
    CONSISTENT = "consistent"
    DIFFER = "differ"
    UNDECIDED = "undecided"
    MISSING = "missing"


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
    def width(self) -> float | None:
        """hi / lo of the ratio's interval: inf when it is open (a bound of 0 or inf); None when missing."""
        r = self.ratio
        if r is None:
            return None
        return r.hi / r.lo if 0 < r.lo and math.isfinite(r.hi) else math.inf

    def verdict(self, max_width: float = MAX_WIDTH) -> Verdict:
        """The figure's verdict (module docstring) with intervals up to `max_width` (hi / lo) deciding."""
        r = self.ratio
        if r is None:
            return Verdict.MISSING
        if not r.lo <= 1.0 <= r.hi:
            return Verdict.DIFFER
        return Verdict.CONSISTENT if self.width <= max_width else Verdict.UNDECIDED


@dataclass(frozen=True)
class Comparison:
    """Both files read: their figures, paired."""

    pairs: list[Pair]
    max_width: float = MAX_WIDTH

    def count(self, v: Verdict) -> int:
        return sum(p.verdict(self.max_width) is v for p in self.pairs)

    @property
    def overall(self) -> Verdict:
        """DIFFER when some figure differs (a decided difference outweighs the undecided ones); UNDECIDED
        when some figure could not be told, or none was compared at all; else CONSISTENT."""
        if self.count(Verdict.DIFFER):
            return Verdict.DIFFER
        decided = self.count(Verdict.CONSISTENT)
        return Verdict.UNDECIDED if self.count(Verdict.UNDECIDED) or not decided else Verdict.CONSISTENT


def read_rows(path: Path) -> tuple[list[str], dict[str, dict[str, str]]]:
    """comparison.csv as (its columns, {variant: row}); AgreeInputError when it is not one."""
    try:
        with open(path, newline="") as fh:
            reader = csv.DictReader(fh)
            rows = list(reader)
            columns = list(reader.fieldnames or [])
    except OSError as e:
        raise AgreeInputError(f"{path}: cannot read ({e.strerror})") from None
    if not rows or "variant" not in columns:
        raise AgreeInputError(f"{path}: expected a study's comparison.csv with a 'variant' column")
    return columns, {r["variant"]: r for r in rows}


def study_of(path: Path, rows: dict[str, dict[str, str]]) -> str | None:
    """The file's `experiment` column (one value for every row); None for files written before it."""
    names = {r.get("experiment") for r in rows.values()} - {None, ""}
    if len(names) > 1:
        raise AgreeInputError(
            f"{path}: column 'experiment' holds {sorted(names)}: expected one study's comparison.csv"
        )
    return names.pop() if names else None


def check_same_study(a: Path, b: Path, cols: tuple[list[str], list[str]], rows: tuple[dict, dict]) -> None:
    """Stop unless both files are comparison.csv files of one load-tested study.

    A figure column one run has and the other lacks is not an error: comparison.csv's columns are the
    union over its variants, so a figure no variant supported in a run is absent there (listed as missing
    in a run). Stopped instead: another study (the `experiment` column, or no variant in common for files
    written before it), a file with no figure at all (not load-tested), a figure without its interval.
    """
    sa, sb = study_of(a, rows[0]), study_of(b, rows[1])
    if sa is not None and sb is not None and sa != sb:
        raise AgreeInputError(
            f"{b}: column 'experiment' is {sb!r} where {a} has {sa!r}: expected two runs of one study"
        )
    if not set(rows[0]) & set(rows[1]):
        raise AgreeInputError(
            f"{b}: column 'variant' has none of {a}'s variants ({', '.join(rows[0])}): "
            "expected two runs of one study"
        )
    for path, columns in zip((a, b), cols, strict=True):
        for key in FIGURES:
            if key in columns and not {f"{key}_lo", f"{key}_hi"} <= set(columns):
                raise AgreeInputError(
                    f"{path}: column {key!r} without {key}_lo and {key}_hi: expected each figure "
                    "with its interval, as reco's report writes comparison.csv"
                )
        if not any(key in columns for key in FIGURES):
            raise AgreeInputError(
                f"{path}: none of the columns {', '.join(FIGURES)}: expected the comparison.csv "
                "of a load-tested study (these ratios are what agree compares)"
            )


def ci(row: dict[str, str], key: str, path: Path) -> Estimate | None:
    """The figure `key` with its CI from one row; None when a cell is empty (not measured or not supported)."""
    cells = [row.get(k, "") for k in (key, f"{key}_lo", f"{key}_hi")]
    if any(c in ("", None) for c in cells):
        return None
    try:
        return Estimate(*map(float, cells), n=0)  # comparison.csv carries no n for ratios
    except ValueError:
        raise AgreeInputError(
            f"{path}: variant {row['variant']!r}, column {key!r}: expected numbers, got {cells}"
        ) from None


def compare(a: Path, b: Path, max_width: float = MAX_WIDTH) -> Comparison:
    """Every (variant, figure) that either run has, run a's variants first; a variant one run lacks is
    listed with its figures missing there, not dropped."""
    (ca, ra), (cb, rb) = read_rows(a), read_rows(b)
    check_same_study(a, b, (ca, cb), (ra, rb))
    out = []
    for name in dict.fromkeys([*ra, *rb]):
        for key in FIGURES:
            x, y = ci(ra.get(name, {}), key, a), ci(rb.get(name, {}), key, b)
            if x is None and y is None:
                continue  # the reference, or a figure neither run has
            out.append(Pair(name, key, x, y))
    return Comparison(out, max_width)


def _word(p: Pair, max_width: float) -> str:
    v = p.verdict(max_width)
    if v is Verdict.DIFFER:
        return "**differ**"
    if v is Verdict.MISSING:
        return f"{DASH} (missing in a run)"
    if v is Verdict.UNDECIDED:
        return "undecided (open interval)" if math.isinf(p.width) else f"undecided ({p.width:.1f}× wide)"
    return str(v)


def markdown(c: Comparison, names: tuple[str, str]) -> str:
    rows = [
        [
            f"`{p.variant}`",
            FIGURES[p.figure],
            short(p.a, ".2f", "×"),
            short(p.b, ".2f", "×"),
            short(p.ratio, ".2f", "×"),
            _word(p, c.max_width),
        ]
        for p in c.pairs
    ]
    head = ["variant", "figure", *names, f"{names[0]} / {names[1]} [95 % CI]", "verdict"]
    return "\n".join(table(head, rows))


def summary(c: Comparison) -> str:
    """One line, the overall verdict first: 'undecided: 0 of 12 figures decidable; ...'."""
    n = {v: c.count(v) for v in Verdict}
    compared = len(c.pairs) - n[Verdict.MISSING]
    decided = n[Verdict.CONSISTENT] + n[Verdict.DIFFER]
    w = f"{c.max_width:g}×"
    return (
        f"{c.overall}: {decided} of {compared} figures decidable; "
        f"{n[Verdict.CONSISTENT]} consistent (run-ratio 95 % interval holds 1, closed, at most {w} wide), "
        f"{n[Verdict.DIFFER]} differ (it excludes 1), "
        f"{n[Verdict.UNDECIDED]} undecided (it holds 1 but is open or wider than {w}); "
        f"{n[Verdict.MISSING]} missing in a run"
    )
