"""The report's plots, PNG via matplotlib's Agg canvas (no display, no pyplot global state).

Failed variants are skipped; a plot with nothing to draw is not written (report.md says so).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from reco.report.table import metric

if TYPE_CHECKING:
    from reco.report import StudyContext, VariantResult

STAGES = ("queue", "features", "retrieval", "rank", "serialize")


def _figure(w: float = 7.5, h: float = 4.5):
    fig = Figure(figsize=(w, h), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots()


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path)
    return path


def _colors(results: list[VariantResult]) -> dict[str, tuple]:
    """One colour per variant, the same in every plot."""
    cmap = colormaps["tab10" if len(results) <= 10 else "tab20"]
    return {r.variant.name: cmap(i % cmap.N) for i, r in enumerate(results)}


def _slo_line(ax, ctx: StudyContext, vertical: bool) -> None:
    if ctx.slo_p99_ms is not None:
        (ax.axvline if vertical else ax.axhline)(
            ctx.slo_p99_ms, color="red", ls="--", lw=1, label=f"SLO p99 {ctx.slo_p99_ms:g} ms"
        )


def latency_cdf(results: list[VariantResult], ctx: StudyContext, colors: dict, path: Path) -> Path | None:
    fig, ax = _figure()
    drawn = False
    for r in results:
        lat = None if r.latencies_ms is None else np.asarray(r.latencies_ms, dtype=np.float64).ravel()
        if r.status != "ok" or lat is None:
            continue
        x = np.sort(lat[np.isfinite(lat) & (lat > 0)])  # log-x cannot show 0
        if x.size == 0:
            continue
        n = x.size
        # ~4000 points: evenly spaced in rank, plus geometrically dense near the tail (p99, p99.9).
        idx = np.unique(np.r_[np.linspace(0, n - 1, 2000), n - np.geomspace(1, n, 2000)].astype(int))
        ax.plot(x[idx], (idx + 1) / n, color=colors[r.variant.name], lw=1.5, label=r.variant.name)
        drawn = True
    if not drawn:
        return None
    _slo_line(ax, ctx, vertical=True)
    ax.axhline(0.99, color="gray", ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_ylim(0, 1.005)
    ax.set_xlabel("end-to-end latency (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    load = f" at {ctx.common_rate_qps:g} qps offered" if ctx.common_rate_qps else ""
    ax.set_title(f"Latency CDF{load} (dotted: p99)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return _save(fig, path)


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(p99, auc) points not beaten by another with lower-or-equal p99 and higher AUC; sorted by p99."""
    front: list[tuple[float, float]] = []
    for p99, auc in sorted(points, key=lambda p: (p[0], -p[1])):
        if not front or auc > front[-1][1]:
            front.append((p99, auc))
    return front


def auc_vs_p99(rows: list[dict], ctx: StudyContext, colors: dict, path: Path) -> Path | None:
    pts = [(r["e2e_p99_ms"], r["auc"], r["variant"]) for r in rows if r["status"] == "ok"]
    pts = [p for p in pts if p[0] is not None and p[1] is not None]
    if not pts:
        return None
    fig, ax = _figure()
    for p99, auc, name in pts:
        ax.scatter(p99, auc, color=colors[name], s=40, zorder=3)
        ax.annotate(name, (p99, auc), textcoords="offset points", xytext=(5, 4), fontsize=8)
    front = pareto_front([(p, a) for p, a, _ in pts])
    ax.plot(*zip(*front, strict=True), color="black", ls="--", lw=1, label="Pareto front", zorder=2)
    _slo_line(ax, ctx, vertical=True)
    base = next((r for r in rows if r["variant"] == ctx.baseline and r["status"] == "ok"), None)
    if base and base["auc"] is not None:
        ax.axhline(
            ctx.auc_keep * base["auc"], color="orange", ls=":", lw=1, label=f"AUC gate ({ctx.auc_keep:g}×)"
        )
    xs = [p[0] for p in pts]
    if max(xs) / min(xs) > 10:
        ax.set_xscale("log")
    ax.set_xlabel("e2e p99 latency at the common load (ms)")
    ax.set_ylabel("AUC")
    ax.set_title("Quality vs tail latency (up-left is better)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def qps_vs_p99(results: list[VariantResult], ctx: StudyContext, colors: dict, path: Path) -> Path | None:
    fig, ax = _figure()
    drawn = False
    for r in results:
        if r.status != "ok":
            continue
        steps = [s for s in r.capacity_steps if s.get("qps") is not None and s.get("p99_ms") is not None]
        if not steps:
            continue
        steps.sort(key=lambda s: s.get("rate") or s["qps"])
        c = colors[r.variant.name]
        ax.plot(
            [s["qps"] for s in steps], [s["p99_ms"] for s in steps], "o-", color=c, ms=4, label=r.variant.name
        )
        bad = [s for s in steps if (s.get("error_rate") or 0) > ctx.max_error_rate]
        ax.scatter(
            [s["qps"] for s in bad], [s["p99_ms"] for s in bad], marker="x", color="black", s=40, zorder=3
        )
        drawn = True
    if not drawn:
        return None
    _slo_line(ax, ctx, vertical=False)
    ax.set_yscale("log")
    ax.set_xlabel("achieved throughput (QPS)")
    ax.set_ylabel("e2e p99 latency (ms, log scale)")
    ax.set_title(f"Capacity: p99 vs throughput (x: error rate > {ctx.max_error_rate:.0%})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def stage_bars(results: list[VariantResult], path: Path) -> Path | None:
    names, means = [], []
    for r in results:
        m = [metric(r, f"server_{s}_mean_ms") for s in STAGES]
        if r.status == "ok" and any(x is not None for x in m):
            names.append(r.variant.name)
            means.append([x or 0.0 for x in m])  # a stage the server did not report draws as 0
    if not names:
        return None
    fig, ax = _figure(8, 1.4 + 0.45 * max(len(names), 4))
    left = np.zeros(len(names))
    cmap = colormaps["Set2"]
    for i, stage in enumerate(STAGES):
        w = np.array([m[i] for m in means])
        ax.barh(names, w, left=left, color=cmap(i), label=stage)
        left += w
    for y, total in enumerate(left):
        ax.annotate(f"{total:.2f} ms", (total, y), textcoords="offset points", xytext=(4, -3), fontsize=8)
    ax.invert_yaxis()  # same order as the table
    ax.set_xlim(0, left.max() * 1.18)
    ax.set_xlabel("mean server time per request (ms)")
    ax.set_title("Where server time goes (stage means)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    return _save(fig, path)


def write_plots(
    results: list[VariantResult], rows: list[dict], ctx: StudyContext, out_dir: Path
) -> dict[str, Path]:
    """caption -> PNG path for every plot that had data."""
    colors = _colors(results)
    plots = {
        "End-to-end latency CDF per variant": latency_cdf(results, ctx, colors, out_dir / "latency_cdf.png"),
        "AUC vs e2e p99 with the Pareto front": auc_vs_p99(rows, ctx, colors, out_dir / "auc_vs_p99.png"),
        "p99 vs throughput (capacity search)": qps_vs_p99(results, ctx, colors, out_dir / "qps_vs_p99.png"),
        "Server time per stage": stage_bars(results, out_dir / "server_stages.png"),
    }
    return {caption: p for caption, p in plots.items() if p is not None}
