"""The retrieval front: each index's recall@N against the exact search and its per-request latency.

recall@N of a query = |the index's N rows ∩ the exact search's N rows| / N, averaged over the queries
with a bootstrap CI over queries (reco.stats.topk.mean_ci). Latency: one query per call, as a server
asks it, on `threads` FAISS threads; p50 and p99 with their order-statistic CIs (reco.stats.quantile_ci;
the calls run back to back on an otherwise idle process, so they are treated as independent), and the
speed-up against the exact search's p50 with the MOVER interval of the two (reco.stats.dependent.ratio_ci).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict, dataclass, field

import numpy as np
from omegaconf import MISSING

from reco.config import ConfigError
from reco.retrieval.ann import IndexSpec, build, search, tune
from reco.stats import Estimate, quantile_ci
from reco.stats.dependent import ratio_ci
from reco.stats.topk import mean_ci, overlap_at_k


@dataclass
class FrontConfig:
    """`retrieval.front` (conf/config.yaml): the indexes measured beside a trained two-tower stage."""

    queries: int = MISSING  # validation users whose vectors query every index (0: no front)
    indexes: list[IndexSpec] = field(default_factory=list)  # besides the exact search and the served one

    def check(self, where: str) -> None:
        if self.queries < 0:
            raise ConfigError(f"{where}.queries: expected >= 0, got {self.queries}")
        for i, spec in enumerate(self.indexes):
            spec.check(f"{where}.indexes[{i}]")


@dataclass(frozen=True)
class FrontRow:
    spec: IndexSpec
    recall: Estimate  # recall@N vs the exact search, mean over queries
    p50_ms: Estimate
    p99_ms: Estimate
    speedup: Estimate  # the exact search's p50 / this index's p50
    build_s: float  # the index structure's build time (shared by the rows that differ in nprobe/ef_search)


def recall_at_n(got: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """Per query: |got ∩ exact| / N for [q, N] row arrays (-1 never matches): the top-k overlap."""
    return overlap_at_k(got, exact)


def _timed(index, queries: np.ndarray, n: int, warmup: int) -> tuple[np.ndarray, np.ndarray]:
    for q in queries[:warmup]:
        search(index, q[None, :], n)
    rows, ms = np.empty((len(queries), n), np.int64), np.empty(len(queries))
    for k, q in enumerate(queries):
        t0 = time.perf_counter()
        rows[k] = search(index, q[None, :], n)[0]
        ms[k] = (time.perf_counter() - t0) * 1000
    return rows, ms


def measure_front(
    specs: list[IndexSpec], items: np.ndarray, queries: np.ndarray, n: int, threads: int, warmup: int = 20
) -> list[FrontRow]:
    """Every spec's FrontRow over `items` [n_items, d] for `queries` [q, d]; the exact search first."""
    import faiss

    faiss.omp_set_num_threads(threads)
    for s in specs:  # refuse a bad setting before building anything
        s.fits(items.shape[1], items.shape[0])
    exact = build(IndexSpec("flat"), items)
    truth, exact_ms = _timed(exact, queries, n, warmup)
    exact_p50 = quantile_ci(exact_ms, 0.5)
    out, built = [], {}  # one index per structure: nprobe and efSearch are set per search, not built
    for s in specs:
        key = repr(dataclasses.replace(s, nprobe=0, ef_search=0))  # IndexSpec is mutable: not hashable
        if s.kind != "flat" and key not in built:
            t0 = time.perf_counter()
            built[key] = (build(s, items), time.perf_counter() - t0)
        index, build_s = (exact, 0.0) if s.kind == "flat" else built[key]
        tune(index, s)
        rows, ms = (truth, exact_ms) if s.kind == "flat" else _timed(index, queries, n, warmup)
        p50 = quantile_ci(ms, 0.5)
        out.append(
            FrontRow(
                s,
                mean_ci(recall_at_n(rows, truth)),
                p50,
                quantile_ci(ms, 0.99),
                ratio_ci(exact_p50, p50),
                build_s,
            )
        )
    return out


def front_lines(rows: list[FrontRow]) -> list[str]:
    """The front as a markdown table (what the benchmarks print)."""
    out = [
        "| index | recall@N vs exact [CI] | p50 ms [CI] | p99 ms [CI] | speed-up p50 vs exact [CI] | build s |",
        "|---|---|---|---|---|---|",
    ]
    return out + [
        f"| {r.spec.label} | {r.recall.fmt('.3f')} | {r.p50_ms.fmt('.3f')} | {r.p99_ms.fmt('.3f')} | "
        f"{r.speedup.fmt('.2f', '×')} | {r.build_s:.1f} |"
        for r in rows
    ]


def front_table(rows: list[FrontRow], served: IndexSpec) -> list[dict]:
    """JSON-able rows (each figure as value, lo, hi, n) for the report; `served` marks the serving index."""

    def est(e: Estimate) -> dict:
        return {"value": e.value, "lo": e.lo, "hi": e.hi, "n": e.n}

    return [
        {
            "index": r.spec.label,
            "spec": asdict(r.spec),
            "served": r.spec == served,
            "recall": est(r.recall),
            "p50_ms": est(r.p50_ms),
            "p99_ms": est(r.p99_ms),
            "speedup": est(r.speedup),
            "build_s": r.build_s,
        }
        for r in rows
    ]
