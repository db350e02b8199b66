"""Text for the report's Markdown: numbers, figures with CIs, table rows. Raw numbers stay raw elsewhere."""

from __future__ import annotations

import math
from collections.abc import Sequence

from reco.stats import Estimate

DASH = "–"


def scaled(e: Estimate | None, k: float) -> Estimate | None:
    """The same figure times k (e.g. a fraction as %)."""
    if e is None or not e.supported:
        return e
    return Estimate(e.value * k, e.lo * k, e.hi * k, e.n)


def _spec(x: float | None) -> str:
    return ".2f" if x is not None and math.isfinite(x) and abs(x) < 10 else ".1f"


def num(x: float | None, spec: str | None = None) -> str:
    """A number, '–' when not measured, 'inf' for a failure; ms-style precision when spec is None."""
    if x is None:
        return DASH
    if math.isinf(x):
        return "inf"
    return format(x, spec or _spec(x))


def rounded(x: float) -> str:
    """A figure for a title or label: three significant digits, never in exponent form, no trailing
    zeros: 12.3464 -> '12.3', 4.20684 -> '4.21', 107.6613 -> '108', 1234.5 -> '1230', 0.5 -> '0.5'
    (issue 47: a plot's title printed `12.3464 req/s`)."""
    if not math.isfinite(x):
        return num(x)
    r = float(f"{x:.3g}")
    return f"{r:.0f}" if r == int(r) else f"{r:f}".rstrip("0")


def est(e: Estimate | None, spec: str | None = None, unit: str = "") -> str:
    """'12.3 [11.9, 13.0] (n=4,000)', 'n/a (n=120)', or '–' when not measured."""
    if e is None:
        return DASH
    return e.fmt(spec or _spec(e.value), unit)


def short(e: Estimate | None, spec: str | None = None, unit: str = "") -> str:
    """'12.3 [11.9, 13.0]': est() without n, for tables whose n is stated once."""
    if e is None:
        return DASH
    if not e.supported:
        return f"n/a (n={e.n:,})"
    s = spec or _spec(e.value)
    return f"{num(e.value, s)}{unit} {e.interval(s)}"


def spread(e: Estimate | None, spec: str | None = None, unit: str = "") -> str:
    """Median and range over repeats: '12.3 (11.9–13.0, 3 runs)'."""
    if e is None or not e.supported:
        return DASH
    s = spec or _spec(e.value)
    return f"{num(e.value, s)}{unit} ({num(e.lo, s)}–{num(e.hi, s)}, {e.n} run{'s' * (e.n != 1)})"


def bracket(
    lo: float | None, hi: float | None, spec: str = ".0f", unit: str = "", undecided: Sequence[float] = ()
) -> str:
    """A capacity bracket '[18, 22)': the highest rate that passed, the lowest that failed (excluded);
    '[18, open)' when no rate failed, '–' when no search ran; rates tried inside it that neither passed
    nor failed follow: '[18, 27) (22 undecided)'."""
    if lo is None:
        return DASH
    inside = f" ({', '.join(num(r, spec) for r in undecided)} undecided)" if undecided else ""
    return f"[{num(lo, spec)}, {'open' if hi is None else num(hi, spec)}){unit}{inside}"


def vs_base(
    is_baseline: bool, e: Estimate | None, spec: str = ".2f", unit: str = "×", reference: str = "1"
) -> str:
    """A figure relative to the baseline; the baseline's own reads '1 (reference)' (or `reference`)."""
    return f"{reference} (reference)" if is_baseline else short(e, spec, unit)


def count(x: float | None) -> str:
    if x is None:
        return DASH
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.0f}"


def one_line(s: str) -> str:
    """Text safe inside a Markdown table cell (a newline or a pipe would break the row)."""
    return " ".join(s.split()).replace("|", "\\|")


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Markdown table lines; cells are escaped with one_line()."""
    return [
        "| " + " | ".join(one_line(h) for h in header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(one_line(c) for c in row) + " |" for row in rows),
    ]
