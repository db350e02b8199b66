"""The sweep's Pareto front (the objective's cost vs val ΔAUC over every trial's screened variants), the
variants of it worth a full load test, and what that load test measured (FrontLoad)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from reco.search.trial import Candidate, Trial

Pair = tuple[Trial, Candidate]


@dataclass
class FrontLoad:
    """What the front's load test measured, per load_key() and for the reference under its own name
    (None: not measured, e.g. its server failed)."""

    note: str  # how the front was load-tested (SLO, repeats, raw files), or why not
    reference: str = ""
    max_qps: dict[str, float | None] = field(default_factory=dict)  # median max QPS at the SLO, repeats
    p99_ms: dict[str, float | None] = field(default_factory=dict)  # median e2e p99 at the common load


def load_key(t: Trial, name: str) -> str:
    """The name trial `t`'s variant `name` is served and load-tested under (unique across trials)."""
    return f"t{t.trial}_{name}"


def kind(trials: list[Trial]) -> str:
    """The sweep's search.objective (records written before it existed optimised throughput)."""
    return trials[0].objective_kind if trials else "throughput"


def screened(trials: list[Trial]) -> list[Pair]:
    """Every trial's variants that the in-process screen can tell apart (batched copies are not)."""
    return [(t, c) for t in trials for c in t.candidates if not c.batched_from]


def point(c: Candidate, kind: str) -> tuple[float, float]:
    """Candidate `c` in the front's plane: (cost, val ΔAUC)."""
    return c.cost(kind), c.val_delta_rel


def pareto(trials: list[Trial]) -> list[tuple[float, float]]:
    """The Pareto front of the screened variants' points (non-finite ones left out), by cost."""
    from reco.report.plots import pareto_front  # matplotlib: not at import (servers compose the config)

    k = kind(trials)
    pts = [point(c, k) for _, c in screened(trials)]
    return pareto_front([p for p in pts if math.isfinite(p[0]) and math.isfinite(p[1])])


def front(trials: list[Trial]) -> list[Pair]:
    """(trial, candidate) pairs worth a full load test: those within the budget and on the Pareto front of
    the objective's cost (rank p50 or size_mb) vs val ΔAUC over every trial's screened variants, then the
    batched copies of those (same trial)."""
    k, pts = kind(trials), set(pareto(trials))
    chosen = [(t, c) for t, c in screened(trials) if point(c, k) in pts and t.within(c)]
    keys = {load_key(t, c.name) for t, c in chosen}
    return chosen + [
        (t, c) for t in trials for c in t.candidates if c.batched_from and load_key(t, c.batched_from) in keys
    ]
