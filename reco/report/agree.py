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

**Between runs.** Each run's interval holds the drift *within* it (its paired blocks, its windows), not
what moves a whole run on a shared VM: the machine's state (its neighbours' load on the shared caches,
its memory) changes over tens of minutes and moves every process of a run alike, the fast variants'
Python-heavy requests more than the baseline's GEMMs. Two runs of one commit 20 minutes apart read the
students' p50 speed-ups 2-20 % apart against +-2-4 % intervals. That component is measured the only way it
can be, from earlier pairs of runs of one commit on the machine kind (a type-B uncertainty in the GUM's
terms: from other series, not this one's): for d = the log of the run ratio, E[d^2] = se_a^2 + se_b^2 +
2 tau^2, and `estimate_between_runs` gives each figure's sd tau of log(run) by Paule and Mandel's
estimator (each d^2 weighed by 1 / (its variance + 2 tau^2): the method of moments, which averages
d^2 - se_a^2 - se_b^2, let a few wide, conservative intervals cancel the spread of the narrow ones and read
0 % at the case study's common load, where its same-commit pairs then "differed" in 18 % of figures:
experiments/ecommerce_case_study/README.md#do-two-runs-agree). `Pair.ratio` widens the run-ratio interval
by it. CONSISTENT then means "within what runs of one commit on this machine kind have differed by"; a
figure that moved more still DIFFERs. `leave_one_out` checks that: each pair judged with the others' tau.

    python -m reco.cli.agree RUN_A/comparison.csv RUN_B/comparison.csv --names "run A" "run B"

The two files must be comparison.csv files of one load-tested study (check_same_study); otherwise
AgreeInputError names the file and the column.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import numpy as np

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
Z95 = 1.959963984540054  # the intervals in comparison.csv are 95 %
RANGES = {"qps_gain"}  # figures whose interval is a range, not a CI: no between-run sd is estimated for them
MIN_DIFFERENCES = 6  # run-ratio differences (over >= 2 pairs of runs) a figure's between-run sd needs


class AgreeInputError(ValueError):
    """The files cannot be compared; the message names the file and the column."""


class Verdict(StrEnum):
    CONSISTENT = "consistent"
    DIFFER = "differ"
    UNDECIDED = "undecided"
    MISSING = "missing"


@dataclass(frozen=True)
class BetweenRuns:
    """Each figure's sd of log(figure) between runs of one commit beyond the runs' own intervals (module
    docstring), with what it rests on; an absent figure has none known (0)."""

    sd: dict[str, float]
    lo: dict[str, float]  # a rough 95 % range: bootstrap over the run pairs (few pairs: rough)
    hi: dict[str, float]
    n: dict[str, int]  # run-ratio differences the figure's estimate rests on
    runs: list[list[str]]  # the pairs of runs, by name

    def tau(self, figure: str) -> float:
        return self.sd.get(figure, 0.0)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> BetweenRuns:
        try:
            d = json.loads(path.read_text())
            out = cls(**d)
        except (OSError, ValueError, TypeError) as e:
            raise AgreeInputError(
                f"{path}: expected the JSON `python -m reco.cli.between_runs` writes "
                f"(keys {', '.join(f.name for f in dataclasses.fields(cls))}): {e}"
            ) from None
        bad = {k: v for k, v in out.sd.items() if k not in FIGURES or not 0 <= v < 1}
        if bad:
            raise AgreeInputError(
                f"{path}: field 'sd' has {bad}: expected figures of {', '.join(FIGURES)} with an sd of "
                "log(figure) in [0, 1)"
            )
        return out


NO_BETWEEN = BetweenRuns({}, {}, {}, {}, [])


@dataclass(frozen=True)
class Pair:
    variant: str
    figure: str
    a: Estimate | None
    b: Estimate | None
    tau: float = 0.0  # the figure's between-run sd of log (BetweenRuns)

    @functools.cached_property
    def ratio(self) -> Estimate | None:
        """Run A's figure / run B's with its interval, widened by the between-run component; None when
        either run lacks the figure. Cached: every verdict, width and table cell reads it."""
        if self.a is None or self.b is None:
            return None
        r = ratio_ci(self.a, self.b)
        if not r.supported:
            return None
        if self.tau == 0 or not (0 < r.lo and math.isfinite(r.hi)):
            return r
        extra = Z95 * math.sqrt(2.0) * self.tau  # both runs carry the component
        c = math.log(r.value)
        down = math.hypot(c - math.log(r.lo), extra)
        up = math.hypot(math.log(r.hi) - c, extra)
        return Estimate(r.value, math.exp(c - down), math.exp(c + up), r.n)

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
    between: BetweenRuns = NO_BETWEEN

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


def compare(a: Path, b: Path, max_width: float = MAX_WIDTH, between: BetweenRuns = NO_BETWEEN) -> Comparison:
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
            out.append(Pair(name, key, x, y, between.tau(key)))
    return Comparison(out, max_width, between)


def estimate_between_runs(
    pairs: list[tuple[Path, Path]], names: list[tuple[str, str]], seed: int = 0
) -> BetweenRuns:
    """Each figure's between-run sd of log(figure) from pairs of runs of one commit (module docstring).

    Per figure, over every variant and pair where both runs' intervals are closed: d = log(a / b) and
    v = the variance of d the two intervals imply ((log hi - log lo) / (2 z) each side, squared, summed);
    tau by paule_mandel. Its range: the same over run pairs resampled with replacement (the variants of one
    pair share that pair's machine states, so the pair is the unit).
    """
    per = _differences([compare(a, b, math.inf) for a, b in pairs])
    rng = np.random.default_rng(seed)

    def tau(groups: list[list[tuple[float, float]]]) -> float:
        return paule_mandel([x for g in groups for x in g])

    sd, lo, hi, n = {}, {}, {}, {}
    for key, groups in per.items():
        if not _estimable(groups):
            continue
        sd[key], n[key] = tau(groups), sum(map(len, groups))
        boot = [tau([groups[j] for j in rng.integers(0, len(pairs), len(pairs))]) for _ in range(1000)]
        lo[key], hi[key] = (float(x) for x in np.quantile(boot, [0.025, 0.975]))
    return BetweenRuns(sd, lo, hi, n, [list(x) for x in names])


def _differences(comparisons: list[Comparison]) -> dict[str, list[list[tuple[float, float]]]]:
    """figure -> per pair of runs, (d, v) of each variant's run ratio where both intervals are closed (the
    comparisons made without a between-run component)."""
    per: dict[str, list[list[tuple[float, float]]]] = {
        k: [[] for _ in comparisons] for k in FIGURES if k not in RANGES
    }
    for i, c in enumerate(comparisons):
        for p in c.pairs:
            r = p.ratio
            if p.figure in RANGES or r is None or not (0 < r.lo and math.isfinite(r.hi)):
                continue
            if p.a.value == 1 == p.b.value:
                continue  # the reference's own row
            half = math.log(r.hi / r.lo) / (2 * Z95)
            per[p.figure][i].append((math.log(r.value), half * half))
    return per


def _estimable(groups: list[list[tuple[float, float]]]) -> bool:
    """Whether a figure's differences (per pair of runs) estimate a between-run sd: one pair or a few
    figures estimate nothing."""
    return sum(1 for g in groups if g) >= 2 and sum(map(len, groups)) >= MIN_DIFFERENCES


def paule_mandel(dv: list[tuple[float, float]]) -> float:
    """tau from differences d with within-run variances v, d ~ N(0, v + 2 tau^2) (the runs are of one commit,
    so no mean is estimated): the tau^2 >= 0 at which sum(d^2 / (v + 2 tau^2)) equals the count, its
    expectation (Paule & Mandel 1982; a meta-analysis's between-study variance). A difference whose interval
    is wide weighs little, so it cannot hide the spread of the narrow ones. 0 without differences."""
    if not dv:
        return 0.0
    d2 = np.array([d * d for d, _ in dv])
    v = np.array([v for _, v in dv])

    def excess(t2: float) -> float:  # decreasing in t2
        return float(np.sum(d2 / (v + 2 * t2))) - len(d2)

    if excess(0.0) <= 0:
        return 0.0
    lo, hi = 0.0, max(float(d2.max()), 1e-12)  # at t2 = max d^2 every term is below 1/2
    for _ in range(64):  # bisection: 2^-64 of the bracket
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if excess(mid) > 0 else (lo, mid)
    return math.sqrt(lo)


def leave_one_out(
    pairs: list[tuple[Path, Path]], max_width: float = MAX_WIDTH
) -> dict[str, dict[Verdict, int]]:
    """figure -> verdict counts over the pairs, each pair judged with the between-run sd of all the others:
    how often runs of one commit would read DIFFER (at 95 %, about 5 % of decided figures if the sd holds)."""
    out: dict[str, dict[Verdict, int]] = {k: dict.fromkeys(Verdict, 0) for k in FIGURES}
    comparisons = [compare(a, b, math.inf) for a, b in pairs]
    per = _differences(comparisons)
    for i, c in enumerate(comparisons):
        rest = {k: [g for j, g in enumerate(gs) if j != i] for k, gs in per.items()}
        sd = {k: paule_mandel([x for g in gs for x in g]) for k, gs in rest.items() if _estimable(gs)}
        for p in c.pairs:  # the pair as compare() would make it with that sd (its ratio is cached per tau)
            out[p.figure][dataclasses.replace(p, tau=sd.get(p.figure, 0.0)).verdict(max_width)] += 1
    return {k: v for k, v in out.items() if any(v.values())}


def common_load(path: Path) -> float | None:
    """The common load a run's comparison.csv records (req/s, `common_rate_qps`), None when it has none."""
    for row in read_rows(path)[1].values():
        try:
            rate = float(row.get("common_rate_qps") or "nan")
        except ValueError:
            continue
        if math.isfinite(rate) and rate > 0:
            return rate
    return None


def load_note(a: Path, b: Path, names: tuple[str, str], tolerance: float = 0.05) -> str:
    """'' or a note that the two runs' common loads differ by more than `tolerance`: each run sets its rate
    from its own reference's capacity, so their common-load ratios then compare the variants at different
    loads (the reference queues more at the higher one), and between-run sd or not, they need not agree."""
    ra, rb = common_load(a), common_load(b)
    if ra is None or rb is None or abs(math.log(ra / rb)) <= math.log1p(tolerance):
        return ""
    return (
        f"note: the common load was {ra:.3g} req/s in {names[0]} and {rb:.3g} in {names[1]} "
        f"({max(ra, rb) / min(ra, rb):.2f}x apart): their common-load ratios compare different loads "
        "(a fixed loadtest.study.common_rate holds it still)"
    )


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
    between = ", widened by the between-run sd," if c.between.sd else ""
    return (
        f"{c.overall}: {decided} of {compared} figures decidable; "
        f"{n[Verdict.CONSISTENT]} consistent (run-ratio 95 % interval{between} holds 1, closed, at most {w} wide), "
        f"{n[Verdict.DIFFER]} differ (it excludes 1), "
        f"{n[Verdict.UNDECIDED]} undecided (it holds 1 but is open or wider than {w}); "
        f"{n[Verdict.MISSING]} missing in a run"
    )


def between_text(b: BetweenRuns) -> str:
    """'p50 speed-up unloaded 4.6 % [1.2, 7.0] (n=24), ...: 4 run pairs'."""
    parts = [
        f"{FIGURES[k]} {100 * v:.1f} % [{100 * b.lo[k]:.1f}, {100 * b.hi[k]:.1f}] (n={b.n[k]})"
        for k, v in b.sd.items()
    ]
    return "; ".join(parts) + f" from {len(b.runs)} pairs of runs of one commit"


def leave_one_out_text(counts: dict[str, dict[Verdict, int]]) -> str:
    """'p99 speed-up unloaded 5 of 90 differ (5.6 %); ...' from leave_one_out."""
    parts = []
    for k, c in counts.items():
        judged = c[Verdict.CONSISTENT] + c[Verdict.DIFFER] + c[Verdict.UNDECIDED]
        if judged:
            parts.append(
                f"{FIGURES[k]} {c[Verdict.DIFFER]} of {judged} differ ({100 * c[Verdict.DIFFER] / judged:.1f} %)"
            )
    return "; ".join(parts)
