"""The comparison table: comparison.csv (raw numbers with CI bounds) and its Markdown form.

One row per variant. The CSV holds the variant's identity, its verdicts as words and every flat metric
(reco.report.metrics); an empty cell means not measured or not supported by n.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from pathlib import Path

from reco.report.context import StudyContext
from reco.report.figures import VariantFigures
from reco.report.fmt import DASH, bracket, count, num, scaled, short, spread, table, vs_base
from reco.report.gate import Gate
from reco.report.metrics import variant_metrics


def metric(f: VariantFigures, key: str) -> float | None:
    """A finite float from the variant's own metrics (auc, params_removed_pct, ...), else None."""
    try:
        x = float(f.result.variant.metrics.get(key))
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def csv_row(f: VariantFigures, g: Gate, ctx: StudyContext) -> dict:
    v = f.result.variant
    return {
        "variant": v.name,
        # which study the row belongs to: `python -m reco.cli.agree` refuses two files of different ones
        "experiment": ctx.experiment,
        "parent": v.parent or "",
        "step": v.step,
        "backend": v.backend,
        "params": v.params or None,  # 0 is the Variant default: not counted
        "size_mb": v.size_mb or None,
        "flops_per_candidate": v.flops_per_candidate or None,
        "auc": metric(f, "auc"),
        "status": "ok" if f.ok else "FAILED",
        "error": f.result.error,
        **variant_metrics(f, g, ctx),
        # words, not codes, in the file people open
        "gate": str(g.overall),
        "gate_accuracy": str(g.accuracy.verdict),
        "gate_latency": str(g.latency.verdict) if g.latency else "",
        "gate_quality": str(g.quality.verdict) if g.quality else "",
        "gate_reason": g.reason,
    }


def write_csv(figs: list[VariantFigures], gates: dict[str, Gate], ctx: StudyContext, path: Path) -> Path:
    """Write comparison.csv; columns are the union over variants, in first-seen order.

    Returns:
        path.
    """
    rows = [csv_row(f, gates[f.name], ctx) for f in figs]
    fields = list(dict.fromkeys(k for row in rows for k in row)) or ["variant"]
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields, restval="")
        w.writeheader()
        w.writerows([{k: "" if x is None else x for k, x in row.items()} for row in rows])
    return path


Cell = Callable[[VariantFigures, Gate], str]
Column = tuple[str, Cell]  # (header, cell): every cell from the variant's figures and gate


def _valid(f: VariantFigures) -> str:
    lat = f.latency.get("common")
    if lat is None:
        return DASH
    if not lat.valid:
        return "**INVALID**: " + "; ".join(sorted(set(lat.invalid_reasons())))
    bad = lat.n_invalid
    return "yes" if not bad else f"{len(lat.runs) - bad}/{len(lat.runs)} runs (**{bad} invalid, excluded**)"


def _common(key: str) -> Cell:
    def cell(f: VariantFigures, g: Gate) -> str:
        lat = f.latency.get("common")
        return short(lat.quantiles[key]) if lat else DASH

    return cell


def _status(f: VariantFigures, g: Gate) -> str:
    return "ok" if f.ok else f"FAILED: {f.result.error[:160] or 'no error message'}"


def _auc_delta(f: VariantFigures, g: Gate) -> str:
    d = f.result.auc_delta
    return vs_base(f.is_baseline, scaled(d[1], 100) if d else None, "+.2f", "", reference="0")


def _speedup(kind: str | None) -> Cell:
    """baseline p99 / variant p99 in runs of `kind` (None: no such run, every variant reads '–')."""

    def cell(f: VariantFigures, g: Gate) -> str:
        r = f.speedup.get((kind, "p99"))
        return vs_base(f.is_baseline, r.pooled if r else None)

    return cell


def _bracket(f: VariantFigures, g: Gate) -> str:
    b = f.bracket
    return bracket(b.highest_pass, b.lowest_fail) if b else DASH


VARIANT: Column = ("variant", lambda f, g: f"`{f.name}`")
AUC_DELTA: Column = ("ΔAUC % [CI]", _auc_delta)
GATE: Column = ("gate", lambda f, g: f"**{g.overall}**")

# The full comparison table (comparison.md and report.md's Results).
COLUMNS: list[Column] = [
    VARIANT,
    ("lineage", lambda f, g: f"{f.result.variant.parent or DASH} → {f.result.variant.step}"),
    ("backend", lambda f, g: f.result.variant.backend),
    ("params", lambda f, g: count(f.result.variant.params or None)),
    ("size MB", lambda f, g: num(f.result.variant.size_mb or None, ".2f")),
    ("AUC", lambda f, g: num(metric(f, "auc"), ".4f")),
    AUC_DELTA,
    ("rank p50 ms in-process", lambda f, g: num(metric(f, "rank_p50_ms"))),
    ("e2e p50 ms [CI]", _common("p50")),
    ("e2e p99 ms [CI]", _common("p99")),
    ("e2e p999 ms [CI]", _common("p999")),
    ("n", lambda f, g: f"{f.latency['common'].n:,}" if "common" in f.latency else DASH),
    (
        "errors %",
        lambda f, g: num(f.latency["common"].error_rate * 100, ".2f") if "common" in f.latency else DASH,
    ),
    ("valid", lambda f, g: _valid(f)),
    ("max QPS @SLO (range)", lambda f, g: spread(f.max_qps, ".0f")),
    ("QPS gain [CI]", lambda f, g: vs_base(f.is_baseline, f.qps_gain)),
    ("p99 speed-up @common [CI]", _speedup("common")),
    GATE,
    ("status", _status),
]

# The like-for-like runs the summary's speed-up may come from, in order of preference: unloaded (what the
# model and the server cost) before equal utilisation (each variant at the same share of its capacity).
LIKE_FOR_LIKE = {"unloaded": "unloaded", "equal_util": "at equal utilisation"}


def like_for_like_kind(figs: list[VariantFigures]) -> str | None:
    """The first LIKE_FOR_LIKE kind of run any variant has a p99 speed-up from; None when none has."""
    return next((k for k in LIKE_FOR_LIKE if any((k, "p99") in f.speedup for f in figs)), None)


def summary_columns(figs: list[VariantFigures]) -> list[Column]:
    """The seed's comparison in five columns: ΔAUC, a like-for-like p99 speed-up (its header says which),
    the capacity bracket at the SLO and the gate."""
    kind = like_for_like_kind(figs)
    which = LIKE_FOR_LIKE[kind] if kind else "like for like (not measured)"
    return [
        VARIANT,
        AUC_DELTA,
        (f"p99 speed-up {which} [CI]", _speedup(kind)),
        ("max QPS @SLO [pass, fail)", _bracket),
        GATE,
    ]


def variant_table(figs: list[VariantFigures], gates: dict[str, Gate], columns: list[Column]) -> list[str]:
    """A Markdown table: one row per variant, one cell per column."""
    return table([h for h, _ in columns], [[cell(f, gates[f.name]) for _, cell in columns] for f in figs])


def markdown_table(figs: list[VariantFigures], gates: dict[str, Gate]) -> str:
    """The comparison as a Markdown table with its notes.

    Returns:
        Markdown text.
    """
    notes = [
        "",
        "Latencies are at the common load, pooled over the valid repeats: nearest-rank quantile with a "
        "95 % CI that allows for dependent requests and drift between repeats; failed requests count as +inf; `n/a (n=…)` = too few requests for that "
        "quantile. ΔAUC is relative to the baseline (DeLong 95 % CI, same test rows). Max QPS is the median "
        "highest passing rate over the capacity repeats (range in brackets); speed-up = baseline p99 / "
        "variant p99 (95 % CI from the blocks both ran in, paired: see Statistics). The in-process rank p50 (one thread, after warm-up) is a point figure.",
    ]
    return "\n".join(variant_table(figs, gates, COLUMNS) + notes + open_p99_note(figs))


def open_p99_note(figs: list[VariantFigures]) -> list[str]:
    """What the common-load p99s left open above would need (the budget's undecided figures, priced)."""
    need = [
        (f.name, lat.n, k)
        for f in figs
        if (lat := f.latency.get("common")) is not None and (k := lat.requests_to_close("p99")) is not None
    ]
    if not need:
        return []
    each = "; ".join(f"`{name}` ~{k:,} (has {n:,})" for name, n, k in need)
    return [
        "",
        f"Open above at the common load, the p99 would need about this many requests to close: {each}, at "
        "the dependence and drift between repeats their windows show, over as many repeats "
        "(reco.stats.dependent.requests_to_close; `loadtest.study.load_requests` x `common_repeats` sets n). An "
        "order of magnitude: the drift is judged by Student t on rounds - 1 df, whose own spread is wide "
        "with few rounds, and more, shorter rounds need fewer (experiment=ecommerce_case_study_long).",
    ]
