"""The comparison table: one row per variant, figures relative to the baseline, and the pass/fail gate.

A row is a plain dict of raw numbers (None = not measured); formatting happens only when writing.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from reco.report import StudyContext, VariantResult

DASH = "–"


def metric(r: VariantResult, key: str) -> float | None:
    """A finite float from the variant's metrics, else None (missing, None, NaN or not a number)."""
    try:
        x = float(r.variant.metrics.get(key))
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def find_baseline(results: list[VariantResult], ctx: StudyContext) -> VariantResult:
    for r in results:
        if r.variant.name == ctx.baseline:
            return r
    names = [r.variant.name for r in results]
    raise ValueError(f"StudyContext.baseline={ctx.baseline!r} is not among the variant results {names}")


def gate(r: VariantResult, base: VariantResult, ctx: StudyContext) -> tuple[bool, str]:
    """MLPerf-style gate: AUC >= auc_keep x baseline AUC and e2e p99 <= SLO at the common load.

    Every unmet condition is listed; a missing measurement never passes. Without an SLO only AUC
    (and the error rate) is checked.
    """
    if r.status != "ok":
        return False, "variant failed (error in the status column)"
    why = []
    auc, base_auc = metric(r, "auc"), metric(base, "auc") if base.status == "ok" else None
    if auc is None:
        why.append("no AUC measured")
    elif base_auc is None:
        why.append(f"baseline {ctx.baseline!r} has no AUC to compare with")
    elif auc < ctx.auc_keep * base_auc:
        why.append(
            f"AUC {auc:.4f} < {ctx.auc_keep:g} × baseline {base_auc:.4f} = {ctx.auc_keep * base_auc:.4f}"
        )
    if ctx.slo_p99_ms is not None:
        p99 = metric(r, "e2e_p99_ms")
        if p99 is None:
            why.append("no e2e p99 at the common load (load test disabled or failed)")
        elif p99 > ctx.slo_p99_ms:
            why.append(f"e2e p99 {p99:.1f} ms > SLO {ctx.slo_p99_ms:g} ms")
    err = metric(r, "error_rate")
    if err is not None and err > ctx.max_error_rate:
        why.append(f"error rate {err:.1%} > {ctx.max_error_rate:.1%}")
    return not why, "; ".join(why)


def build_rows(results: list[VariantResult], ctx: StudyContext) -> list[dict]:
    base = find_baseline(results, ctx)

    def b(key: str) -> float | None:  # a failed baseline's figures are not a reference
        return metric(base, key) if base.status == "ok" else None

    rows = []
    for r in results:
        v = r.variant
        m = {k: metric(r, k) for k in ("auc", "e2e_p50_ms", "e2e_p95_ms", "e2e_p99_ms", "max_qps_at_slo")}
        rank, rank_source = metric(r, "server_rank_mean_ms"), "server"
        if rank is None:
            rank, rank_source = metric(r, "rank_p50_ms"), "in-process"
        passed, reason = gate(r, base, ctx)
        d_auc = ratio(m["auc"], b("auc"))
        rows.append(
            {
                "variant": v.name,
                "parent": v.parent or "",
                "step": v.step,
                "backend": v.backend,
                "params": v.params or None,  # 0 is the Variant default: not counted
                "size_mb": v.size_mb or None,
                "flops_per_candidate": v.flops_per_candidate or None,
                **m,
                "d_auc_pct": None if d_auc is None else (d_auc - 1) * 100,
                "rank_ms": rank,
                "rank_source": rank_source if rank is not None else "",
                "speedup": ratio(b("e2e_p99_ms"), m["e2e_p99_ms"]),
                "qps_gain": ratio(m["max_qps_at_slo"], b("max_qps_at_slo")),
                "error_rate": metric(r, "error_rate"),
                "gate": "pass" if passed else "fail",
                "gate_reason": reason,
                "status": "ok" if r.status == "ok" else "FAILED",
                "error": r.error,
            }
        )
    return rows


def write_csv(rows: list[dict], path: Path) -> Path:
    """Raw numbers, empty cell = not measured."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["variant"])
        w.writeheader()
        w.writerows([{k: "" if x is None else x for k, x in row.items()} for row in rows])
    return path


# Formatting ---------------------------------------------------------------------------------------
def count(x: float) -> str:
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.0f}"


def ms(x: float) -> str:
    return f"{x:.2f}" if x < 10 else f"{x:.1f}"


def times(x: float) -> str:
    return f"{x:.2f}×"


def one_line(s: str) -> str:
    return " ".join(s.split()).replace("|", "\\|")  # a newline or a pipe would break the Markdown row


def _rank(row: dict) -> str:
    return ms(row["rank_ms"]) + ("†" if row["rank_source"] == "in-process" else "")


def _gate(row: dict) -> str:
    return "PASS" if row["gate"] == "pass" else f"FAIL: {row['gate_reason']}"


def _status(row: dict) -> str:
    return "ok" if row["status"] == "ok" else f"FAILED: {row['error'][:160]}"


# (row key, header, formatter)
COLUMNS = [
    ("variant", "variant", lambda s: f"`{s}`"),
    ("parent", "parent", str),
    ("step", "step", str),
    ("backend", "backend", str),
    ("params", "params", count),
    ("size_mb", "size MB", lambda x: f"{x:.2f}"),
    ("flops_per_candidate", "FLOPs/cand", count),
    ("auc", "AUC", lambda x: f"{x:.4f}"),
    ("d_auc_pct", "ΔAUC %", lambda x: f"{x:+.2f}"),
    ("e2e_p50_ms", "e2e p50 ms", ms),
    ("e2e_p95_ms", "e2e p95 ms", ms),
    ("e2e_p99_ms", "e2e p99 ms", ms),
    ("rank_ms", "server rank ms", None),
    ("max_qps_at_slo", "max QPS @SLO", lambda x: f"{x:.0f}"),
    ("speedup", "speed-up (p99)", times),
    ("qps_gain", "QPS gain", times),
    ("error_rate", "errors %", lambda x: f"{x * 100:.2f}"),
    ("gate", "gate", None),
    ("status", "status", None),
]
ROW_FORMATTERS = {"rank_ms": _rank, "gate": _gate, "status": _status}


def markdown_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(h for _, h, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = []
        for key, _, fmt in COLUMNS:
            if row[key] is None or row[key] == "":
                cells.append(DASH)
            else:
                cells.append(one_line(ROW_FORMATTERS[key](row) if key in ROW_FORMATTERS else fmt(row[key])))
        lines.append("| " + " | ".join(cells) + " |")
    notes = [
        "ΔAUC and speed-up are vs the baseline; speed-up = baseline e2e p99 / variant e2e p99; "
        "QPS gain = variant / baseline max QPS at the SLO."
    ]
    if any(r["rank_source"] == "in-process" for r in rows):
        notes.append("† in-process rank p50 (no server stage timing for this variant).")
    return "\n".join(lines) + "\n\n" + "\n".join(notes)
