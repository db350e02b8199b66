"""Print the optimization-steps table of an experiment's latest run, read back from MLflow.

    python run.py experiment=optimize_chain        # builds and measures the variants (cached)
    python -m reco.cli.benchmark optimize_chain        # this table (also: make benchmark)

Every ratio compares two variants measured in the same run on the same machine (in-process ranking
of 500 candidates, one intra-op thread, p50 over repetitions after warm-up).
"""

from __future__ import annotations

import argparse
import math

from reco.cli.compose import compose
from reco.stats import Estimate, Verdict, verdict_at_least
from reco.tracking import latest_variant_runs


def _ratio(a: float | None, b: float | None) -> float:
    return a / b if a and b else math.nan


def table(rows: dict[str, dict]) -> str:
    head = "| variant | parent | backend | params | size MB | AUC | ΔAUC vs parent | rank p50 ms | rank p99 ms | speedup vs parent |"
    lines = [head, "|" + "---|" * 10]
    for name, r in rows.items():
        p = rows.get(r["parent"], {})
        dauc = (r.get("auc", math.nan) / p["auc"] - 1) * 100 if p.get("auc") else math.nan
        lines.append(
            f"| {name} | {r['parent'] or '–'} | {r['backend']} | {r.get('params', math.nan):,.0f} | "
            f"{r.get('size_mb', math.nan):.1f} | {r.get('auc', math.nan):.4f} | {_pct(dauc)} | "
            f"{r.get('rank_p50_ms', math.nan):.2f} | {r.get('rank_p99_ms', math.nan):.2f} | "
            f"{_x(_ratio(p.get('rank_p50_ms'), r.get('rank_p50_ms')))} |"
        )
    return "\n".join(lines)


def _pct(v: float) -> str:
    return "–" if math.isnan(v) else f"{v:+.2f}%"


TARGET_WORD = {Verdict.PASS: "MET   ", Verdict.FAIL: "MISSED", Verdict.INCONCLUSIVE: "INCONCLUSIVE"}


def _x(v: float) -> str:
    return "–" if math.isnan(v) else f"{v:.2f}x"


def targets(rows: dict[str, dict]) -> list[str]:
    """The optimization-steps targets, each against the variant's parent; MET or MISSED with the figure."""
    out = []

    def check(label: str, ok: bool, figure: str) -> None:
        out.append(f"- {'MET   ' if ok else 'MISSED'} {label}: {figure}")

    for name, r in rows.items():
        p = rows.get(r["parent"])
        if not p or "auc" not in r or "auc" not in p:
            continue
        drop = (1 - r["auc"] / p["auc"]) * 100
        speed = _ratio(p.get("rank_p50_ms"), r.get("rank_p50_ms"))
        if "params_removed_pct" in r:
            removed = (1 - r["params"] / p["params"]) * 100
            check(f"{name}: ≥30% fewer parameters", removed >= 30, f"{removed:.1f}%")
            check(f"{name}: ΔAUC ≤ 0.5%", drop <= 0.5, f"{drop:.2f}% drop")
            check(f"{name}: measurable in-process speedup", speed > 1.05, f"{speed:.2f}x")
        elif "kd_gain_val_auc" in r:
            ratio = _ratio(p.get("size_mb"), r.get("size_mb"))
            check(f"{name}: ≥6x smaller than its teacher", ratio >= 6, f"{ratio:.1f}x")
            check(f"{name}: ΔAUC ≤ 0.5% vs teacher", drop <= 0.5, f"{drop:.2f}% drop")
            gain = Estimate(r["kd_gain_val_auc"], r["kd_gain_val_auc_lo"], r["kd_gain_val_auc_hi"], 0)
            verdict = verdict_at_least(gain, 0.0)  # the CI must exclude 0 for a MET
            out.append(
                f"- {TARGET_WORD[verdict]} {name}: better than its no-KD control "
                f"(validation, paired DeLong 95% CI): {gain.value:+.4f} [{gain.lo:+.4f}, {gain.hi:+.4f}] AUC"
            )
        elif r["mode"] == "onnx_int8":
            check(f"{name}: ≥2x torch eager ({r['parent']})", speed >= 2, f"{speed:.2f}x")
            check(f"{name}: ΔAUC ≤ 0.5%", drop <= 0.5, f"{drop:.2f}% drop")
        elif r["mode"]:
            out.append(f"- REPORT {name} vs torch eager ({r['parent']}): {speed:.2f}x, ΔAUC {-drop:+.2f}%")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment", nargs="?", default="optimize_chain")
    ap.add_argument("--tracking-uri", default=None, help="default: tracking.uri of the composed config")
    args = ap.parse_args()
    uri = args.tracking_uri or compose().tracking.uri
    run_id, rows = latest_variant_runs(uri, args.experiment)
    print(f"experiment {args.experiment}, MLflow parent run {run_id}\n")
    print(table(rows))
    print("\nTargets (each variant against its parent):")
    print("\n".join(targets(rows)) or "- none applicable")


if __name__ == "__main__":
    main()
