"""The comparison report of a study: one table (CSV + Markdown), plots, and report.md.

The pipeline fills one VariantResult per variant and a StudyContext (reco.report.context), calls
write_report(), logs the returned paths as MLflow artifacts, and logs study_metrics() to each child run.
Nothing here measures anything: it reads the typed outcomes (reco.loadtest.outcome) and decides every
verdict on a confidence interval (reco.stats).

    context   the inputs: VariantResult, StudyContext, Machine
    figures   pooled latencies, ratios and gains derived from the outcomes
    gate      accuracy / latency / overall verdicts
    metrics   flat per-variant metrics with CI bounds (MLflow, CSV)
    table     comparison.csv, the Markdown table and the report's summary columns
    targets   the preset's targets, MET / MISSED / INCONCLUSIVE / NOT MEASURED
    sections  the comparison sections of report.md
    markdown  report.md
    plots     the PNGs
    agree     do two runs differ? an interval on each figure's ratio between them (python -m reco.cli.agree)
"""

from __future__ import annotations

from pathlib import Path

from reco.report.context import Machine, StudyContext, VariantResult
from reco.report.figures import study_figures
from reco.report.gate import study_gates
from reco.report.markdown import report
from reco.report.metrics import study_metrics, variant_metrics
from reco.report.plots import write_plots
from reco.report.table import markdown_table, write_csv

__all__ = ["Machine", "StudyContext", "VariantResult", "study_metrics", "variant_metrics", "write_report"]


def write_report(results: list[VariantResult], ctx: StudyContext, out_dir: Path) -> list[Path]:
    """Write comparison.csv, comparison.md, the PNG plots and report.md.

    Args:
        results: one per variant, the baseline (ctx.baseline) among them.
        ctx: the study's yardsticks and setup.
        out_dir: created if missing.
    Returns:
        the paths written. Raises ValueError when ctx.baseline is not among the results.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    figs = study_figures(results, ctx)
    gates = study_gates(figs, ctx)
    written = [write_csv(figs, gates, ctx, out_dir / "comparison.csv")]
    comparison_md = out_dir / "comparison.md"
    comparison_md.write_text(markdown_table(figs, gates) + "\n")
    written.append(comparison_md)
    images = write_plots(figs, ctx, out_dir)
    report_md = out_dir / "report.md"
    report_md.write_text(report(figs, gates, ctx, images, out_dir))
    return written + list(images.values()) + [report_md]
