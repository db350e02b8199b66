"""The sweep's summary: the winner, search_summary.md (every trial's variants in one table) and two plots,
the Pareto front of the screen and the load-tested front (reco.report.fmt and reco.report.plots)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from reco.report import fmt, plots
from reco.search.config import OBJECTIVES
from reco.search.front import FrontLoad, Pair, front, kind, load_key, pareto, point, screened
from reco.search.trial import Candidate, Trial
from reco.stats import Estimate

SUMMARY_FILE = "search_summary.md"  # in the sweep directory
PARETO_FILE = "search_pareto.png"
FRONT_PLOT = "search_front_load.png"  # val ΔAUC vs max QPS @ SLO and vs e2e p99 of the load-tested front
COLUMNS = [
    "trial", "overrides", "variant", "params", "size MB", "val ΔAUC [95% CI]", "rank p50 ms", "calls/s",
    "within budget (CI verdict)", "Pareto", "max QPS @ SLO", "e2e p99 ms @ common load", "trial objective",
]  # fmt: skip


@dataclass
class Winner:
    """The variant a sweep chose, of trial `trial`."""

    trial: Trial
    cand: Candidate
    max_qps: float | None  # its median max QPS at the SLO in the front's load test (None: not measured)


def winner(trials: list[Trial], load: FrontLoad) -> Winner | None:
    """With the throughput objective and any front variant's max QPS at the SLO measured, the one with the
    highest; otherwise (or with the size objective) the best variant of the trial with the best objective;
    None when no trial met the budget."""
    qps = load.max_qps
    measured = [(t, c) for t, c in front(trials) if qps.get(load_key(t, c.name)) is not None]
    if kind(trials) == "throughput" and measured:
        t, c = max(measured, key=lambda tc: qps[load_key(tc[0], tc[1].name)])
    elif ok := [t for t in trials if t.within_budget]:
        t = max(ok, key=lambda t: t.objective)
        c = t.candidate(t.best)
    else:
        return None
    return Winner(t, c, qps.get(load_key(t, c.name)))


def summarize(
    trials: list[Trial], out_dir: Path, load: FrontLoad | None = None
) -> tuple[str, Winner | None, list[Path]]:
    """The sweep's summary: a markdown table of every trial's variants and the winner.

    Args:
        trials: the trials' records.
        out_dir: where search_summary.md (and the plots) go.
        load: the front's load test, if it ran (see winner()).
    Returns:
        (markdown, the winner or None, the files written).
    """
    trials = sorted(trials, key=lambda t: t.trial)
    load = load or FrontLoad("not run")
    best = winner(trials, load)
    budget = trials[0].max_auc_drop_pct if trials else float("nan")
    lines = [*_intro(trials, budget, load), _verdict(trials, best, budget), ""]
    lines += fmt.table(COLUMNS, _rows(trials, load))
    out_dir.mkdir(parents=True, exist_ok=True)
    md = "\n".join(lines) + "\n"
    files = [out_dir / SUMMARY_FILE]
    files[0].write_text(md)
    for plot in (
        _plot_screen(trials, budget, out_dir / PARETO_FILE),
        _plot_load(front(trials), load, budget, out_dir / FRONT_PLOT),
    ):
        if plot is not None:
            files.append(plot)
    return md, best, files


def _intro(trials: list[Trial], budget: float, load: FrontLoad) -> list[str]:
    """What the budget, the objective, the front and the winner mean in this sweep."""
    test = trials[0].budget_test if trials else "point"
    k = kind(trials)
    return [
        "# Accuracy-budget search",
        "",
        f"Budget: relative validation AUC drop ≤ {budget}% against the baseline, held against "
        + (
            "the 95% CI's worst end (`search.budget_test=ci`)"
            if test == "ci"
            else "the point estimate (`search.budget_test=point`; the CI verdict is shown beside it)"
        )
        + ". Objective "
        f"(`search.objective={k}`, what each trial returned to Optuna): {OBJECTIVES[k][0]} of the "
        "trial's best variant within the budget; a trial with none returns minus its nearest variant's excess "
        "over the budget (% points). The Pareto front: "
        f"{OBJECTIVES[k][1]} vs val ΔAUC. The winner is "
        + (
            "the budget-meeting Pareto-front variant with the highest max QPS at the SLO when the front was "
            "load-tested, else the trial with the best objective."
            if k == "throughput"
            else "the trial with the best objective (the smallest model file within the budget); the front's "
            "load test shows what serving it costs."
        )
        + " A batched variant (its model behind the dynamic batcher, serve.batching's window) is not "
        "screened: it is load-tested when its parent is on the front.",
        "",
        f"Full load test of the front: {load.note}.",
        "",
    ]


def _verdict(trials: list[Trial], best: Winner | None, budget: float) -> str:
    """The winner and why, or the nearest miss."""
    if best is None:
        seen = [c for t in trials for c in t.candidates]
        nearest = max(seen, key=lambda c: c.val_delta_rel) if seen else None
        return f"**No trial met the budget** of {budget}%: no winner. " + (
            f"Best val ΔAUC seen: {delta(nearest)} (`{nearest.name}`)."
            if nearest
            else "No variant was built."
        )
    t, c = best.trial, best.cand
    by = f"max QPS at the SLO {best.max_qps:g} req/s, " if best.max_qps is not None else ""
    base_mb = t.baseline_size_mb
    small = (
        f"model file {c.size_mb:.2f} MB ({base_mb / c.size_mb:.2f}x smaller than the baseline's), "
        if c.size_mb and base_mb
        else ""
    )
    return (
        f"**Winner: trial {t.trial}** ({shown(t.overrides)}), variant `{c.name}`: "
        f"{by}{small}{c.throughput:.1f} ranking calls/s in process "
        f"(rank p50 {c.rank_p50_ms:.2f} ms), val ΔAUC {delta(c)}: within the {budget}% budget by "
        f"{'its whole CI' if t.budget_test == 'ci' else 'its point estimate'}, "
        f"CI verdict {c.verdict(budget)}."
    )


def _rows(trials: list[Trial], load: FrontLoad) -> list[list[str]]:
    """One row per trial's variant (COLUMNS), the reference's load-test figures, and the trials that built
    nothing."""
    qps, p99 = load.max_qps, load.p99_ms
    k, pts = kind(trials), set(pareto(trials))
    tested = {load_key(t, c.name) for t, c in front(trials)}
    rows = []
    for t in trials:
        for c in t.candidates:
            key = load_key(t, c.name)
            on_front = "yes" if point(c, k) in pts else ""
            if c.batched_from:
                on_front = f"with {c.batched_from}" if key in tested else "not screened"
            rows.append([
                str(t.trial), shown(t.overrides), c.name, f"{c.params:,}",
                fmt.num(c.size_mb, ".2f") if c.size_mb else "", delta(c),
                fmt.num(c.rank_p50_ms, ".2f"), fmt.num(c.throughput, ".1f"),
                f"{'yes' if t.within(c) else 'no'} ({c.verdict(t.max_auc_drop_pct)})", on_front,
                _cell(qps, key, "g"), _cell(p99, key, ".1f"), f"{t.objective:.4g}",
            ])  # fmt: skip
    if load.reference in qps:
        ref = load.reference
        rows.append(["", "", f"{ref} (reference)", "", "", "0", "", "", "", "", _cell(qps, ref, "g"),
                     _cell(p99, ref, ".1f"), ""])  # fmt: skip
    for t in trials:
        if not t.candidates:
            rows.append([str(t.trial), shown(t.overrides), "(none built)", *[""] * 5, "no", *[""] * 3,
                         f"{t.objective:.4g}"])  # fmt: skip
    return rows


def _cell(figures: dict[str, float | None], key: str, spec: str) -> str:
    """A load-test figure for the table: blank when not tested, n/a when tested but not measured."""
    if key not in figures:
        return ""
    v = figures[key]
    return "n/a" if v is None else fmt.num(v, spec)


def shown(overrides: list[str]) -> str:
    """A trial's sampled settings for a table, floats to 4 significant digits (Optuna samples 17)."""

    def short(o: str) -> str:
        key, _, value = o.partition("=")
        try:
            return f"{key}={float(value):.4g}" if "." in value else o
        except ValueError:
            return o

    return " ".join(short(o) for o in overrides)


def delta(c: Candidate) -> str:
    """The val ΔAUC in %, with its 95% CI when known: '-0.080% [-0.150, +0.030]'."""
    lo, hi = c.val_delta_lo, c.val_delta_hi
    if lo is None or hi is None:
        return fmt.num(c.val_delta_rel * 100, "+.3f") + "%"
    return fmt.short(fmt.scaled(Estimate(c.val_delta_rel, lo, hi, 0), 100), "+.3f", "%")


def _plot_screen(trials: list[Trial], budget: float, path: Path) -> Path | None:
    """Val ΔAUC vs the front's cost (in-process rank p50 or model size) of every trial's screened variants,
    the front and the budget line."""
    cands, k = screened(trials), kind(trials)
    if not cands:
        return None
    fig, ax = plots.figure(6, 4)
    plots.labelled_points(ax, [(f"{t.trial}:{c.name}", c.cost(k), c.val_delta_rel * 100) for t, c in cands])
    if edge := pareto(trials):
        ax.step(
            [x for x, _ in edge], [y * 100 for _, y in edge], where="post", color="C1", label="Pareto front"
        )
    plots.auc_limit(ax, budget, f"budget −{budget}%")
    ax.set_xlabel({"rank_p50_ms": "in-process rank p50 (ms)", "size_mb": "model file (MB)"}[OBJECTIVES[k][1]])
    ax.set_ylabel("val ΔAUC vs baseline (%)")
    ax.legend(fontsize=7)
    return plots.save(fig, path)


def _plot_load(tested: list[Pair], load: FrontLoad, budget: float, path: Path) -> Path | None:
    """Val ΔAUC of the load-tested front (and the reference at 0) against its max QPS at the SLO and its
    e2e p99 at the common load: the front as a user of the served variants sees it."""
    pts = [(load_key(t, c.name), c.val_delta_rel * 100) for t, c in tested]
    pts += [(load.reference, 0.0)] if load.reference in load.max_qps else []
    if not any(load.max_qps.get(k) is not None or load.p99_ms.get(k) is not None for k, _ in pts):
        return None
    fig, axes = plots.figure(10, 4, cols=2, sharey=True)
    for ax, figures, label in (
        (axes[0], load.max_qps, "max QPS at the SLO (req/s)"),
        (axes[1], load.p99_ms, "e2e p99 at the common load (ms)"),
    ):
        drawn = [(k, figures[k], y) for k, y in pts if figures.get(k) is not None]
        off = [k for k, x, _ in drawn if not math.isfinite(x)]  # e.g. p99 = inf: > 1% of requests failed
        plots.labelled_points(ax, [p for p in drawn if p[0] not in off])
        plots.auc_limit(ax, budget, f"budget −{budget}%")
        ax.set_xlabel(label + (f"\nnot finite, not drawn: {', '.join(off)}" if off else ""))
    axes[0].set_ylabel("val ΔAUC vs baseline (%)")
    axes[0].legend(fontsize=7)
    return plots.save(fig, path)
