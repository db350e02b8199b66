"""ONNX Runtime session-parameter tuning, in the manner of Olive's session-params tuning pass.

For each point of a small grid a real session is built with `reco.runtime.ort_scorer` (the
function serving uses, so the chosen settings mean the same thing there) and timed on ranking one
block of `n_candidates` rows with `reco.measure.rank_latency`; the fastest p50 wins. The points are
timed round-robin over `rounds` rounds (p50 = median of the per-round p50s), so a burst of load from
another process on the machine hits every point alike instead of one.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import MISSING

from reco.data.schema import Split
from reco.measure import RankLatencyConfig, rank_latency
from reco.runtime import ort_scorer
from reco.steps.registry import StepError

GRID_KEYS = ("graph_optimization_level", "intra_op_num_threads", "inter_op_num_threads", "execution_mode")


@dataclass
class TuneConfig:
    n_candidates: int = MISSING  # rows scored per timed call (one ranking request)
    repeats: int = MISSING  # timed calls per point, split over the rounds
    warmup: int = MISSING  # untimed calls per point and round
    rounds: int = MISSING
    grid: dict[str, list[Any]] = MISSING  # GRID_KEYS -> values to try

    def points(self) -> list[dict]:
        bad = sorted(set(self.grid) - set(GRID_KEYS))
        if bad or not self.grid:
            raise StepError(
                f"accelerate: accelerate.tune.grid keys {bad} unknown; expected a subset of {GRID_KEYS}"
            )
        keys = list(self.grid)
        return [
            dict(zip(keys, vals, strict=True)) for vals in itertools.product(*(self.grid[k] for k in keys))
        ]


def tune(path: Path, split: Split, tc: TuneConfig) -> tuple[dict, list[dict]]:
    """Returns (fastest settings, table of {settings..., rank_p50_ms, rank_p99_ms} for every point)."""
    points = tc.points()
    scorers = []
    for settings in points:
        try:
            scorers.append(ort_scorer(path, settings))
        except AttributeError as e:  # a misspelled enum value in the grid
            raise StepError(f"accelerate: accelerate.tune.grid: {settings} is not valid: {e}") from e
    reps = max(1, -(-tc.repeats // tc.rounds))
    runs: list[list[dict]] = [[] for _ in points]
    for _ in range(tc.rounds):
        for i, scorer in enumerate(scorers):
            runs[i].append(rank_latency(scorer, split, tc.n_candidates, RankLatencyConfig(reps, tc.warmup)))
    table = [
        {
            **settings,
            "rank_p50_ms": float(np.median([r["rank_p50_ms"] for r in rs])),
            "rank_p99_ms": float(np.max([r["rank_p99_ms"] for r in rs])),
        }
        for settings, rs in zip(points, runs, strict=True)
    ]
    best = min(table, key=lambda r: r["rank_p50_ms"])
    return {k: best[k] for k in points[0]}, table


def tune_into(v, path: Path, split: Split, tc: TuneConfig | None) -> dict | None:
    """Tune the session of `v`'s graph at `path` and record the choice: v.runtime["ort"] (the settings
    serving uses) and v.metrics["tuned_rank_p50_ms"]. tc None keeps the runtime's defaults.

    Returns:
        The tuning report ({"n_candidates", "chosen", "table"}), or None without tuning.
    """
    v.runtime["ort"] = {}
    if tc is None:
        return None
    best, table = tune(path, split, tc)
    v.runtime["ort"] = best
    key = json.dumps(best, sort_keys=True)
    v.metrics["tuned_rank_p50_ms"] = next(
        r["rank_p50_ms"] for r in table if json.dumps({k: r[k] for k in best}, sort_keys=True) == key
    )
    return {"n_candidates": tc.n_candidates, "chosen": best, "table": table}
