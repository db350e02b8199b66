"""Do two runs of one study agree? Issue 9's reproducibility check, from two comparison.csv files.

For every variant in both files and every ratio the report gives a CI for (speed-ups and QPS gains),
the two runs agree on that figure when their 95 % CIs overlap. A figure missing from either run (an
empty cell: not measured, or n too small) is listed as such, never counted as agreeing.

    python -m reco.cli.agree RUN_A/comparison.csv RUN_B/comparison.csv --names "run 7" "run 8"

Prints a Markdown table and a one-line summary; exits 1 when some pair of CIs does not overlap.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from reco.report.fmt import DASH, short, table
from reco.stats import Estimate

FIGURES: dict[str, str] = {
    "speedup_p99_unloaded": "p99 speed-up unloaded",
    "speedup_p50_unloaded": "p50 speed-up unloaded",
    "speedup_p99_equal_util": "p99 speed-up at equal utilisation",
    "speedup_p99_common": "p99 speed-up at the common load",
    "qps_gain": "max-QPS gain",
}


@dataclass(frozen=True)
class Pair:
    variant: str
    figure: str
    a: Estimate | None
    b: Estimate | None

    @property
    def overlap(self) -> bool | None:
        """True/False when both runs have the figure, None when either lacks it."""
        if self.a is None or self.b is None:
            return None
        return self.a.lo <= self.b.hi and self.b.lo <= self.a.hi


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
    word = {True: "yes", False: "**no**", None: f"{DASH} (missing in a run)"}
    rows = [
        [f"`{p.variant}`", FIGURES[p.figure], short(p.a, ".2f", "×"), short(p.b, ".2f", "×"), word[p.overlap]]
        for p in ps
    ]
    return "\n".join(table(["variant", "figure", *names, "CIs overlap"], rows))


def summary(ps: list[Pair]) -> str:
    judged = [p for p in ps if p.overlap is not None]
    agree = sum(p.overlap for p in judged)
    return f"{agree} of {len(judged)} figures' CIs overlap; {len(ps) - len(judged)} missing in a run"
