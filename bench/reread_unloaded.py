"""A study's unloaded blocks re-read with both paired estimators: what the report gives now (the median
block) beside the pooled blocks it replaced, per variant against the baseline, from the run's own files.

    python -m bench.reread_unloaded outputs/<experiment>/<timestamp> [--baseline baseline]

Reads every `load/<variant>/unloaded/r<block>/latencies.csv` as the runner does (failed requests +inf), pairs each
variant's blocks with the baseline's by block number, and prints the p50 and p99 speed-ups with their 95 %
intervals (reco.stats.paired.median_block_ratio and paired_ratio): an older run's figures under the
current estimator, and how far one host stretch moves each (experiments/unloaded_interleave/README.md).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np

from reco.loadtest.histogram import read_latencies
from reco.stats.paired import median_block_ratio, paired_ratio


def blocks(run_dir: Path, variant: str) -> dict[int, np.ndarray]:
    """Block number -> that block's unloaded window of one variant, as the runner read it (send order,
    failed and unanswered requests +inf: reco.loadtest.histogram.Latencies.window_ms)."""
    out = {}
    for f in run_dir.glob(f"load/{variant}/unloaded/r*/latencies.csv"):
        summary = f.with_name(f.name + ".summary.json")
        unanswered = json.loads(summary.read_text()).get("unanswered", 0) if summary.exists() else 0
        out[int(re.fullmatch(r"r(\d+)", f.parent.name).group(1))] = read_latencies(f).window_ms(unanswered)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path, help="a study's output directory (holding load/)")
    ap.add_argument("--baseline", default="baseline")
    a = ap.parse_args(argv)
    base = blocks(a.run_dir, a.baseline)
    if not base:
        raise SystemExit(
            f"{a.run_dir}: no load/{a.baseline}/unloaded/r*/latencies.csv (expected a study's outputs)"
        )
    print("| variant | blocks | p50: median block | p50: pooled | p99: median block | p99: pooled |")
    print("|---|---|---|---|---|---|")
    for d in sorted(p for p in (a.run_dir / "load").iterdir() if p.is_dir() and p.name != a.baseline):
        other = blocks(a.run_dir, d.name)
        ks = sorted(base.keys() & other.keys())
        if len(ks) < 2:
            continue
        num, den = [base[k] for k in ks], [other[k] for k in ks]
        cells = [
            e.fmt(".2f").split(" (n=")[0]
            for q in (0.5, 0.99)
            for e in (median_block_ratio(num, den, q), paired_ratio(num, den, q))
        ]
        print(f"| `{d.name}` | {len(ks)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
