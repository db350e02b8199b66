"""Measure a Scorer the same way for every variant: accuracy on a split, in-process ranking latency."""

from __future__ import annotations

import functools
import io
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from omegaconf import MISSING

from reco.data.schema import Split
from reco.models.protocol import as_requests
from reco.runtime import Scorer
from reco.train.metrics import auc, classification_metrics
from reco.variant import atomic_write


def predict(scorer: Scorer, split: Split, batch_size: int = 4096) -> np.ndarray:
    """[N] probabilities for every row of `split`, scored through `scorer` in batches."""
    out = []
    for lo in range(0, len(split), batch_size):
        part = split.take(slice(lo, lo + batch_size))
        out.append(scorer(part.dense.numpy(), part.ids.numpy(), part.mask().numpy()))
    return np.concatenate(out)


def save_scores(path: Path, scores: np.ndarray) -> Path:
    """Write [N] scores as a float32 .npy file, atomically (a reader never sees half a file): the one format
    a variant's test scores (ΔAUC in the report) and a search's cached validation scores share."""
    buf = io.BytesIO()
    np.save(buf, np.asarray(scores, dtype=np.float32))
    return atomic_write(path, buf.getvalue())


def load_scores(path: Path) -> np.ndarray:
    """[N] scores written by save_scores (no pickled objects accepted)."""
    return np.load(path, allow_pickle=False)


@dataclass
class RankLatencyConfig:
    """`rank_latency` in conf/config.yaml: the in-process ranking benchmark run on every variant."""

    repeats: int = MISSING  # timed calls
    warmup: int = MISSING  # untimed calls first


def evaluate(scorer: Scorer, split: Split, batch_size: int = 4096) -> dict[str, float]:
    """auc, logloss, calibration; plus oracle_auc when the split carries true probabilities."""
    return score_metrics(split, predict(scorer, split, batch_size))


def score_metrics(split: Split, probs: np.ndarray) -> dict[str, float]:
    """Metrics of [N] probabilities against the split's labels (see evaluate)."""
    if not np.isfinite(probs).all():
        raise FloatingPointError(f"scorer produced {int((~np.isfinite(probs)).sum())} non-finite scores")
    labels = split.labels.numpy()
    m = classification_metrics(labels, probs)
    if split.oracle is not None:
        m["oracle_auc"] = auc(labels, split.oracle.numpy())
    return m


@functools.cache
def gemm_peak_gflops(size: int = 512, calls: int = 30) -> float:
    """This machine's one-thread fp32 matmul throughput (best of `calls` size^3 products): the ceiling a
    model's dense layers can reach, so flops_per_candidate x candidates / it is the call's FLOP floor."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        for _ in range(3):
            torch.mm(a, b)
        best = float("inf")
        for _ in range(calls):
            t = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t)
    finally:
        torch.set_num_threads(threads)
    return 2 * size**3 / best / 1e9


def rank_latency(
    scorer: Scorer,
    split: Split,
    n_candidates: int,
    cfg: RankLatencyConfig,
    seed: int = 0,
    shared: list[int] | None = None,
) -> dict[str, float]:
    """Score blocks of `n_candidates` rows drawn from `split`; p50/p99 ms after warm-up. With the schema's
    `shared` columns each block is one request (its rows share the first row's user and context) scored
    as the service scores it (reco.runtime: sizes), else independent rows.

    Returns:
        {"rank_p50_ms", "rank_p99_ms", "rank_n_candidates"}.
    """
    repeats, warmup = cfg.repeats, cfg.warmup
    rng = np.random.default_rng(seed)
    blocks = []
    for _ in range(min(repeats, 8)):
        idx = rng.integers(0, len(split), size=n_candidates)
        part = split.take(idx)
        block = (part.dense.numpy(), part.ids.numpy(), part.mask().numpy())
        blocks.append(as_requests(block, shared, [n_candidates]) if shared else block)
    sizes = [n_candidates] if shared else None
    for i in range(warmup):
        scorer(*blocks[i % len(blocks)], sizes)
    times = []
    for i in range(repeats):
        t = time.perf_counter()
        scorer(*blocks[i % len(blocks)], sizes)
        times.append((time.perf_counter() - t) * 1000)
    return {
        "rank_p50_ms": float(np.percentile(times, 50)),
        "rank_p99_ms": float(np.percentile(times, 99)),
        "rank_n_candidates": float(n_candidates),
    }
