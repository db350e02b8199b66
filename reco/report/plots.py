"""The report's plots, PNG via matplotlib's Agg canvas (no display, no pyplot global state).

Failed variants are skipped; a plot with nothing to draw is not written (report.md says so). Each plot
is meant to be read without the table (issue 47): figures in titles and labels are rounded
(fmt.rounded), log axes carry plain-number labels at 1-2-5 steps only (readable_log_axis), legends sit
outside the data, and the capacity search has one panel per variant instead of seven brackets blended
on one SLO line.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter

from reco.loadtest.outcome import Capacity, CapacityStep
from reco.report.context import StudyContext
from reco.report.figures import VariantFigures
from reco.report.fmt import bracket, rounded, short
from reco.report.metrics import outside_handler
from reco.stats import Estimate, Verdict

MARKER = {Verdict.PASS: "o", Verdict.FAIL: "X", Verdict.INCONCLUSIVE: "^", Verdict.INVALID: "s"}
OUTSIDE = "outside the handler"
UNSTAGED = "handler, no stage"


def figure(w: float = 7.5, h: float = 4.5, cols: int = 1, sharey: bool = False):
    """A figure of `cols` axes side by side on its own Agg canvas (no pyplot state): (figure, axes)."""
    fig = Figure(figsize=(w, h), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(1, cols, sharey=sharey)


def save(fig: Figure, path: Path) -> Path:
    fig.savefig(path)
    return path


def _colors(figs: list[VariantFigures]) -> dict[str, tuple]:
    """One colour per variant, the same in every plot."""
    cmap = colormaps["tab10" if len(figs) <= 10 else "tab20"]
    return {f.name: cmap(i % cmap.N) for i, f in enumerate(figs)}


def _slo_line(ax, ctx: StudyContext, vertical: bool) -> None:
    if ctx.slo_p99_ms is not None:
        (ax.axvline if vertical else ax.axhline)(
            ctx.slo_p99_ms, color="red", ls="--", lw=1, label=f"SLO p99 {rounded(ctx.slo_p99_ms)} ms"
        )


def auc_limit(ax, drop_pct: float, label: str) -> None:
    """The largest relative ΔAUC drop allowed (%), as a horizontal line at −drop_pct."""
    ax.axhline(-drop_pct, color="orange", ls=":", lw=1, label=label)


def labelled_points(ax, points: list[tuple[str, float, float]], fontsize: float = 6) -> None:
    """(label, x, y) points, each annotated with its label."""
    ax.scatter([x for _, x, _ in points], [y for _, _, y in points], s=18)
    for label, x, y in points:
        ax.annotate(label, (x, y), fontsize=fontsize)


def _err(e: Estimate) -> list[list[float]]:
    """[[below], [above]] error-bar lengths; an infinite bound (failures) draws no whisker."""
    lo = e.value - e.lo if math.isfinite(e.lo) else 0.0
    hi = e.hi - e.value if math.isfinite(e.hi) else 0.0
    return [[lo], [hi]]


def _plottable(e: Estimate | None) -> bool:
    return e is not None and e.supported and math.isfinite(e.value) and e.value > 0


def readable_log_axis(axis) -> None:
    """Plain-number labels ('20', '50', '100') on a log axis at 1-2-5 steps, or 1-1.5-2-3-5-7 when the
    view spans too little for three of those; minor ticks unlabelled. (Matplotlib's default labels the
    minor ticks of a range under a decade as '3×10¹4×10¹', colliding.) Call once the data is drawn."""
    lo, hi = sorted(axis.get_view_interval())
    for subs in ((1.0, 2.0, 5.0), (1.0, 1.5, 2.0, 3.0, 5.0, 7.0)):
        locator = LogLocator(10, subs=subs)
        if sum(lo <= t <= hi for t in locator.tick_values(lo, hi)) >= 3:
            break
    axis.set_major_locator(locator)
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


# The percentile axis: x = 1 / (1 - q), so each "nine" of the tail gets the same width (HdrHistogram's
# percentile distribution plot); the labels name the percentile.
PERCENTILES = {2: "50%", 10: "90%", 100: "99%", 1_000: "99.9%", 10_000: "99.99%", 100_000: "99.999%"}


def percentile_axis(axis, top: float) -> None:
    """Label the 1 / (1 - q) axis with the percentiles up to `top` (the last one the data reaches)."""
    ticks = [x for x in PERCENTILES if x <= top]
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_major_formatter(FuncFormatter(lambda v, _: PERCENTILES.get(round(v), "")))
    axis.set_minor_formatter(NullFormatter())


def outside_legend(ax, **kw) -> None:
    """The legend right of the axes, never over the data (the constrained layout makes room)."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0, frameon=False, **kw)


def _p99_label(f: VariantFigures, lat) -> str:
    """'pruned: p99 23.4 [21.0, 25.1] ms, n=1,300' (+ failures, INVALID): each variant's p99 in the legend
    so the plot reads without the table."""
    failed = f", {lat.n_failed:,} failed" if lat.n_failed else ""
    invalid = "" if lat.valid else ", INVALID"
    p99 = lat.quantiles["p99"]
    stated = f"{short(p99)} ms" if p99.supported else "n/a (n too small)"
    return f"{f.name}: p99 {stated}, n={lat.n:,}{failed}{invalid}"


def draw_latency_percentiles(figs: list[VariantFigures], ctx: StudyContext, colors: dict) -> Figure | None:
    """The pooled e2e latencies at the common load by percentile (HdrHistogram style): x = 1 / (1 - q) on
    a log axis labelled 50 %, 90 %, 99 %, 99.9 %, so the tail (the p99) gets as much room as the median;
    y = latency, log. Each variant's p99 is marked with its CI and stated in the legend. A failed request
    counts as +inf: it is not drawn, but it keeps its rank (the curve ends before q = 1)."""
    fig, ax = figure(10, 4.8)
    top = 1.0
    for f in figs:
        lat = f.latency.get("common")
        if not f.ok or lat is None or lat.n == 0:
            continue
        n = lat.n
        x = np.sort(lat.latencies_ms[np.isfinite(lat.latencies_ms) & (lat.latencies_ms > 0)])  # log-y: no 0
        if x.size == 0:
            continue
        # ~3000 points, even in rank and dense toward the tail the log axis spreads; position (i + 1/2) / n
        m = x.size
        idx = np.unique(np.r_[np.linspace(0, m - 1, 1000), m - np.geomspace(1, m, 2000)].astype(int))
        inv = 1.0 / (1.0 - (idx + 0.5) / n)
        top = max(top, inv[-1])
        style = "-" if lat.valid else ":"
        ax.plot(inv, x[idx], color=colors[f.name], lw=1.5, ls=style, label=_p99_label(f, lat))
        p99 = lat.quantiles["p99"]
        if _plottable(p99):
            ax.errorbar(100, p99.value, yerr=_err(p99), fmt="o", color=colors[f.name], ms=4, capsize=3)
    if top == 1.0:
        return None  # nothing drawn
    _slo_line(ax, ctx, vertical=False)
    ax.axvline(100, color="gray", ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(1, top * 1.2)
    readable_log_axis(ax.yaxis)
    percentile_axis(ax.xaxis, top)
    ax.set_xlabel("percentile (log scale of 1 / (1 − q): each nine of the tail as wide as the last)")
    ax.set_ylabel("end-to-end latency (ms, log scale)")
    load = f" at {rounded(ctx.common_rate_qps)} req/s offered" if ctx.common_rate_qps else ""
    # a figure title, not the axes': centred over the axes it ran past the left edge
    fig.suptitle(f"End-to-end latency by percentile{load}, pooled repeats (dots: p99 with its 95 % CI)")
    ax.grid(True, which="major", alpha=0.3)
    outside_legend(ax, fontsize=7)
    return fig


def latency_cdf(figs: list[VariantFigures], ctx: StudyContext, colors: dict, path: Path) -> Path | None:
    """latency_cdf.png: the percentile plot (the name kept: reports and experiment READMEs link to it)."""
    fig = draw_latency_percentiles(figs, ctx, colors)
    return None if fig is None else save(fig, path)


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(latency, quality) points not beaten by another with lower-or-equal latency and higher quality;
    sorted by latency."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(points, key=lambda p: (p[0], -p[1])):
        if not front or y > front[-1][1]:
            front.append((x, y))
    return front


def auc_vs_p99(figs: list[VariantFigures], ctx: StudyContext, colors: dict, path: Path) -> Path | None:
    """Relative ΔAUC vs e2e p99 at the common load, both with their 95 % CIs, and the Pareto front."""
    pts = []
    for f in figs:
        p99 = f.p99()
        if not f.ok or not _plottable(p99):
            continue
        if f.is_baseline:
            pts.append((f, p99, Estimate(0.0, 0.0, 0.0, 0)))
        elif f.result.auc_delta is not None:
            rel = f.result.auc_delta[1]
            pts.append((f, p99, Estimate(rel.value * 100, rel.lo * 100, rel.hi * 100, rel.n)))
    if not pts:
        return None
    fig, ax = figure(9, 4.5)
    for f, p99, d in pts:
        # named in the legend with its figures: labels beside the points overlapped where variants are close
        label = f"{f.name}: p99 {rounded(p99.value)} ms, ΔAUC {d.value:+.2f} %"
        ax.errorbar(
            p99.value, d.value, xerr=_err(p99), yerr=_err(d), fmt="o", color=colors[f.name], ms=5, capsize=3,
            label=label,
        )  # fmt: skip
    front = pareto_front([(p.value, d.value) for _, p, d in pts])
    ax.plot(*zip(*front, strict=True), color="black", ls="--", lw=1, label="Pareto front", zorder=2)
    _slo_line(ax, ctx, vertical=True)
    auc_limit(ax, ctx.max_auc_drop * 100, f"AUC limit −{ctx.max_auc_drop:.2%}")
    xs = [p.value for _, p, _ in pts]
    if max(xs) / min(xs) > 10:
        ax.set_xscale("log")
        readable_log_axis(ax.xaxis)
    ax.set_xlabel("e2e p99 at the common load (ms, 95 % CI)")
    ax.set_ylabel("ΔAUC vs baseline (%, 95 % DeLong CI)")
    ax.set_title("Quality vs tail latency (up-left is better)")
    ax.grid(True, alpha=0.3)
    outside_legend(ax, fontsize=8)
    return save(fig, path)


def capacity_curve(cap: Capacity) -> list[CapacityStep]:
    """The steps of one capacity search that have a finite p99 to draw, sorted by offered rate (the search
    visits rates out of order; joined in that order the line doubles back on itself)."""
    return sorted((s for s in cap.steps if _plottable(s.run.quantiles.get("p99"))), key=lambda s: s.rate)


def _mark_bracket(ax, f: VariantFigures, slo: float, colour: tuple, rates: list[float]) -> None:
    """The variant's capacity bracket [highest pass, lowest fail) as a shaded band across its panel and a
    bar on the SLO line; an open end (nothing passed, or nothing failed) is drawn to the last rate
    measured, with an arrow head."""
    b = f.bracket
    if b is None or not rates:
        return
    lo = b.highest_pass if b.highest_pass > 0 else min(rates)
    hi = b.lowest_fail if b.lowest_fail is not None else max(rates)
    ax.axvspan(lo, hi, color=colour, alpha=0.12, lw=0)
    ax.plot(
        [lo, hi], [slo, slo], color=colour, lw=7, alpha=0.45, solid_capstyle="butt", gid=f"bracket:{f.name}"
    )
    ends = [(lo, "|" if b.highest_pass > 0 else "<"), (hi, "|" if b.lowest_fail is not None else ">")]
    for x, marker in ends:
        ax.plot([x], [slo], marker=marker, ms=11, mew=2, color=colour, ls="")


def _grid(n: int) -> tuple[int, int]:
    """(rows, cols) for n panels: at most 4 a row, rows as even as they can be (7 -> 2 x 4, 5 -> 2 x 3)."""
    rows = math.ceil(n / 4)
    return rows, math.ceil(n / rows)


def _capacity_title(f: VariantFigures) -> str:
    """'pruned\ncapacity [45, 61) req/s' (the bracket of the median search, as the table's)."""
    b = f.bracket
    if b is None:
        return f"{f.name}\nno capacity bracket"
    return f"{f.name}\ncapacity {bracket(b.highest_pass, b.lowest_fail, '.3g')} req/s"


def draw_qps_vs_p99(figs: list[VariantFigures], ctx: StudyContext, colors: dict) -> Figure | None:
    """One panel per variant, all on the same log axes: every step of its capacity searches, p99 with its
    CI against the offered rate (one line per search, sorted by rate; marker = the step's verdict), the
    SLO, and its capacity bracket shaded and written in the panel's title. (Issue 47: seven brackets on
    one SLO line overlapped in blended colours.)"""
    drawn = [f for f in figs if f.ok and f.capacity]
    if not drawn:
        return None
    rows, cols = _grid(len(drawn))
    # wide enough for the one-row legend below however few panels
    fig = Figure(figsize=(max(2.9 * cols + 0.6, 9.0), 2.5 * rows + 1.2), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, sharex=True, sharey=True, squeeze=False).ravel()
    for ax in axes[len(drawn) :]:
        ax.set_visible(False)
    for ax, f in zip(axes, drawn, strict=False):
        c = colors[f.name]
        rates = [s.rate for cap in f.capacity for s in capacity_curve(cap)]
        for cap in f.capacity:
            steps = capacity_curve(cap)
            x, p99 = [s.rate for s in steps], [s.run.quantiles["p99"] for s in steps]
            ax.plot(x, [e.value for e in p99], "-", color=c, alpha=0.5, gid=f"steps:{f.name}")
            for s, e in zip(steps, p99, strict=True):
                ax.errorbar(
                    s.rate, e.value, yerr=_err(e), fmt=MARKER[s.verdict], color=c, ms=4, capsize=2, lw=0.8
                )
        _slo_line(ax, ctx, vertical=False)
        _mark_bracket(ax, f, ctx.slo_p99_ms or f.capacity[0].slo_p99_ms, c, rates)
        ax.set_title(_capacity_title(f), fontsize=9, color=c)
        ax.grid(True, which="major", alpha=0.3)
    ax0 = axes[0]
    ax0.set_xscale("log")
    ax0.set_yscale("log")
    # A log axis needs a positive view to tick: where no step has a finite p99 (a busy machine in a smoke
    # run), nothing is drawn on it, so the view is set from the SLO and the rates the steps were offered
    if not any(len(ln.get_xdata()) for ax in axes for ln in ax.get_lines() if ln.get_gid()):
        slo = ctx.slo_p99_ms or drawn[0].capacity[0].slo_p99_ms or 100.0
        offered = [s.rate for f in drawn for cap in f.capacity for s in cap.steps if s.rate > 0] or [1.0]
        ax0.set_ylim(slo / 10, slo * 10)
        ax0.set_xlim(min(offered) / 1.5, max(offered) * 1.5)
    readable_log_axis(ax0.xaxis)
    readable_log_axis(ax0.yaxis)
    for i, ax in enumerate(axes[: len(drawn)]):
        ax.tick_params(labelsize=8, labelbottom=True)
        if i + cols >= len(drawn):  # the lowest panel of its column (a figure-wide label met the legend)
            ax.set_xlabel("offered rate (req/s, log scale)", fontsize=8)
    fig.supylabel("e2e p99 latency (ms, log scale, 95 % CI)", fontsize=9)
    fig.suptitle("Capacity search per variant: p99 by offered rate (n/a or infinite p99: not drawn)")
    handles = [Line2D([], [], ls="", marker=m, color="gray", label=f"step {v}") for v, m in MARKER.items()]
    handles.append(Line2D([], [], color="gray", lw=7, alpha=0.45, label="capacity bracket [pass, fail)"))
    handles += ax0.get_legend_handles_labels()[0][:1]  # the SLO line, once
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8, frameon=False)
    return fig


def qps_vs_p99(figs: list[VariantFigures], ctx: StudyContext, colors: dict, path: Path) -> Path | None:
    fig = draw_qps_vs_p99(figs, ctx, colors)
    return None if fig is None else save(fig, path)


def stage_bars(figs: list[VariantFigures], path: Path) -> Path | None:
    """Mean: server stages, the handler's unstaged rest and the time outside the handler, adding up to the
    client's e2e mean (left). p99: server total and outside the handler (right)."""
    rows = []
    for f in figs:
        lat = f.latency.get("common")
        if not f.ok or lat is None:
            continue
        st = lat.stages()
        if "server_total_mean_ms" in st:
            rows.append((f.name, st, outside_handler(lat)))
    if not rows:
        return None
    stages = list(
        dict.fromkeys(
            k.removeprefix("server_").removesuffix("_mean_ms")
            for _, st, _ in rows
            for k in st
            if k.startswith("server_") and k.endswith("_mean_ms") and k != "server_total_mean_ms"
        )
    )
    colour = {
        name: colormaps["tab10"](i % 10)
        for i, name in enumerate([*stages, UNSTAGED, "server total", OUTSIDE])
    }

    def rest(st: dict) -> float:  # handler time no stage accounts for
        return max(st["server_total_mean_ms"] - sum(st.get(f"server_{s}_mean_ms", 0.0) for s in stages), 0.0)

    names = [name for name, _, _ in rows]
    fig, (left_ax, right_ax) = figure(11, 2.2 + 0.45 * max(len(names), 4), cols=2)
    mean_parts = [(s, [st.get(f"server_{s}_mean_ms", 0.0) for _, st, _ in rows]) for s in stages]
    mean_parts.append((UNSTAGED, [rest(st) for _, st, _ in rows]))
    mean_parts.append((OUTSIDE, [max(out.get("outside_handler_mean_ms", 0.0), 0.0) for _, _, out in rows]))
    _stack(left_ax, names, mean_parts, colour)
    left_ax.set_xlabel("mean time per request (ms); bar = client e2e mean")
    left_ax.set_title("Mean: server stages + outside the handler")
    p99_parts = [
        ("server total", [st.get("server_total_p99_ms", 0.0) for _, st, _ in rows]),
        (OUTSIDE, [max(out.get("outside_handler_p99_ms", 0.0), 0.0) for _, _, out in rows]),
    ]
    _stack(right_ax, names, p99_parts, colour)
    right_ax.set_xlabel("p99 (ms); e2e p99 − server total p99 is indicative")
    right_ax.set_title("p99: server total + outside the handler")
    for ax in (left_ax, right_ax):
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=4, frameon=False)
    return save(fig, path)


def _stack(ax, names: list[str], parts: list[tuple[str, list[float]]], colour: dict[str, tuple]) -> None:
    """Horizontal stacked bars, one per variant, with the total written at the end."""
    left = np.zeros(len(names))
    for label, widths in parts:
        w = np.asarray(widths, float)
        w[~np.isfinite(w)] = 0.0  # a part that failed requests made infinite is labelled, not drawn
        ax.barh(names, w, left=left, color=colour[label], label=label)
        left += w
    totals = np.sum([np.asarray(w, float) for _, w in parts], axis=0)
    for y, (drawn, total) in enumerate(zip(left, totals, strict=True)):
        text = f"{total:.2f} ms" if np.isfinite(total) else "inf (failed requests)"
        ax.annotate(text, (drawn, y), textcoords="offset points", xytext=(4, -3), fontsize=8)
    ax.invert_yaxis()  # same order as the table
    ax.set_xlim(0, max(left.max(), 1e-9) * 1.25)


# The report's one picture up front: the first of these drawn. The capacity plot shows every variant's
# bracket against the SLO, the figure the summary's QPS column gives; quality vs latency comes next.
LEAD = ("qps_vs_p99", "auc_vs_p99", "latency_cdf")


def lead(images: dict[str, Path]) -> tuple[str, Path] | None:
    """(caption, path) of the first LEAD plot among `images` (write_plots' result); None when none was drawn."""
    by_stem = {p.stem: (caption, p) for caption, p in images.items()}
    return next((by_stem[k] for k in LEAD if k in by_stem), None)


def write_plots(figs: list[VariantFigures], ctx: StudyContext, out_dir: Path) -> dict[str, Path]:
    """Draw every plot that has data.

    Returns:
        caption -> PNG path.
    """
    colors = _colors(figs)
    plots = {
        "End-to-end latency by percentile per variant at the common load (log tail)": latency_cdf(
            figs, ctx, colors, out_dir / "latency_cdf.png"
        ),
        "ΔAUC vs e2e p99 with 95 % CIs and the Pareto front": auc_vs_p99(
            figs, ctx, colors, out_dir / "auc_vs_p99.png"
        ),
        "Capacity per variant: p99 vs offered rate at every step, and the capacity bracket at the SLO": qps_vs_p99(
            figs, ctx, colors, out_dir / "qps_vs_p99.png"
        ),
        "Where the time goes: server stages and outside the handler": stage_bars(
            figs, out_dir / "server_stages.png"
        ),
    }
    return {caption: p for caption, p in plots.items() if p is not None}
