"""The comparison report of a study: one table (CSV + Markdown), plots, and report.md.

The pipeline fills one VariantResult per variant and a StudyContext, calls write_report(), and logs
the returned paths as MLflow artifacts. Nothing here measures anything: it only reads what was measured,
and a missing figure renders as "–" and fails the gate with a stated reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from reco.variant import Variant


@dataclass
class VariantResult:
    variant: Variant  # lineage (name/parent/step), params, size_mb, flops_per_candidate, metrics
    status: str = "ok"  # "ok" | "failed"
    error: str = ""
    latencies_ms: np.ndarray | None = None  # [N] exact per-request e2e latencies at the common offered load
    capacity_steps: list[dict] = field(default_factory=list)  # {"rate", "qps", "p99_ms", "error_rate"}


@dataclass
class StudyContext:
    experiment: str
    baseline: str  # name of the baseline variant
    slo_p99_ms: float | None
    common_rate_qps: float | None
    auc_keep: float = 0.995  # quality gate: AUC >= auc_keep * baseline AUC
    machine: str = ""  # one line: CPU model, cores, library versions, date
    targets: dict = field(default_factory=dict)  # e.g. {"e2e_speedup": 3.4, "max_auc_drop_pct": 0.5}
    # Failed requests come back fast, so a p99 with many errors flatters the variant: cap them.
    max_error_rate: float = 0.01


def write_report(results: list[VariantResult], ctx: StudyContext, out_dir: Path) -> list[Path]:
    """Write comparison.csv, comparison.md, the PNG plots and report.md into out_dir; return their paths."""
    from reco.report import markdown, plots, table  # submodules type-hint against this module

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = table.build_rows(results, ctx)
    written = [table.write_csv(rows, out_dir / "comparison.csv")]
    comparison_md = out_dir / "comparison.md"
    comparison_md.write_text(table.markdown_table(rows) + "\n")
    written.append(comparison_md)
    images = plots.write_plots(results, rows, ctx, out_dir)
    report_md = out_dir / "report.md"
    report_md.write_text(markdown.report(rows, results, ctx, images, out_dir))
    return written + list(images.values()) + [report_md]
