"""Correctness under load (MLPerf TEST01's idea): the scores a variant returned under load equal its
offline scores for the same request.

During a common-load window the generator records the items and scores returned for every Nth request
(loadtest.score_every; `<latencies.csv>.scores.jsonl`, with the index of the request body). Here the same
bodies are scored in-process, unbatched, through the variant's own runtime (reco.runtime.load_scorer) on
the same feature store and candidate generation as the server (reco.serve.features.FeatureStore), and
every returned item's score is compared: |served - offline| <= tolerance (fp32: 1e-5). A returned item
that is not among the request's candidates, or an unreadable answer, is an infinite difference.

A batched serving (serve.batching.enabled) scored each request inside a call with whatever other requests
arrived with it, which the record does not keep. For most runtimes that changes nothing beyond float
rounding, but dynamic INT8 (ONNX Runtime's DynamicQuantizeLinear) takes each activation's scale from the
whole call, so a request's scores depend on its company: up to 8e-3 on the smoke preset's student, as
much as its served scores differed. So the check scores every recorded request offline inside
BATCH_COMPOSITIONS random calls as the batcher forms them (1-7 other requests of the file, up to
batching.max_batch rows, the request at a random place), takes the widest |batched - alone| as the
runtime's `batch_spread`, and allows max(tolerance, BATCH_MARGIN x batch_spread). The margin covers
compositions the sample missed (on the smoke student the widest of 144 was 6.1e-3, of 1,500 7.9e-3),
and stays far below what a batcher bug does: a block shifted by one row moves scores by ~0.2 there.
A batch-invariant runtime (reco.runtime.batch_invariant: no per-call quantization, e.g. fp32 or static
INT8, whose activation scales are fixed at calibration) gets no such allowance: it is held to `tolerance`
batched or not; its measured spread is still printed and logged (MLflow correctness_batch_spread).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from reco.data.schema import Dataset
from reco.loadtest.outcome import CorrectnessCheck
from reco.serve.config import ServeConfig
from reco.variant import Variant

if TYPE_CHECKING:
    from reco.serve.features import FeatureStore

BATCH_COMPOSITIONS = 8  # offline batched calls per recorded request (module docstring)
MAX_COMPANY = 7  # most other requests in one offline batch (fewer when max_batch rows are reached)


def read_scores(paths: Sequence[Path]) -> list[dict]:
    """Every {"payload": index, "items": [[item_id, score], ...] | null} of the given .scores.jsonl files."""
    out: list[dict] = []
    for p in paths:
        if p.exists():
            out += [json.loads(ln) for ln in p.read_text().splitlines() if ln.strip()]
    return out


def check_scores(
    variant: Variant,
    data: Dataset,
    serve: ServeConfig,
    requests_path: Path,
    score_files: Sequence[Path],
    tolerance: float,
    seed: int = 0,
    store: FeatureStore | None = None,
) -> CorrectnessCheck:
    """Compare the recorded served scores with offline scores of the same requests.

    Args:
        variant: the served variant (scored here through its own runtime, one thread).
        data: the dataset the server was started with.
        serve: the serve settings the server ran with (n_candidates, max_k, max_candidates, retrieval).
        requests_path: the request file the generator replayed (bodies by line index).
        score_files: the generator's .scores.jsonl files.
        tolerance: max |served - offline| score (widened for a batched serving of a runtime that is not
            batch-invariant: module docstring).
        seed: draws the offline batches' company.
        store: the feature store built from `data` with serve.retrieval (None: built here; a study checking
            several variants builds it once, ~1.4 s at the case study's size).
    Returns:
        CorrectnessCheck; passed is False when nothing was recorded.
    """
    from reco.runtime import batch_invariant, load_scorer
    from reco.serve.features import FeatureStore

    samples = read_scores(score_files)
    if not samples:
        return CorrectnessCheck(0, math.inf, tolerance, False)
    bodies = [ln for ln in Path(requests_path).read_text().splitlines() if ln.strip()]
    store = store if store is not None else FeatureStore(data, serve.retrieval)
    scorer = load_scorer(variant, threads=1)
    served_scorer = None  # the runtime as the server loaded it (whole-request graph), for batch_spread
    if serve.batching.enabled:
        shared = data.schema.shared_columns if serve.user_once else None
        served_scorer = load_scorer(variant, threads=1, shared=shared)
    rng = np.random.default_rng(seed)

    @functools.cache
    def company_block(j: int) -> tuple[np.ndarray, ...]:  # the same request joins many offline batches
        return _block(bodies[j], store, serve)[1]

    worst = spread = 0.0
    for s in samples:
        if s["items"] is None:
            worst = math.inf
            continue
        items, block = _block(bodies[s["payload"]], store, serve)
        probs = scorer(*block)  # [N] float32, the request alone
        offline = dict(zip(items.tolist(), probs.tolist(), strict=True))
        served = np.array([[i, p] for i, p in s["items"]], dtype=np.float64).reshape(-1, 2)
        diffs = [abs(p - offline[int(i)]) if int(i) in offline else math.inf for i, p in served]
        worst = max([worst, *diffs])
        if served_scorer is not None:
            spread = max(
                spread,
                batch_spread(block, company_block, len(bodies), served_scorer, serve.batching.max_batch, rng),
            )
    invariant = served_scorer is None or batch_invariant(variant)
    check = CorrectnessCheck(len(samples), worst, tolerance, False, spread, invariant)
    check.passed = worst <= check.allowed
    return check


def _block(body: str, store, serve: ServeConfig) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """(candidate item ids, the scorer's input block (dense, ids, mask)) of one request body, as the
    server builds them."""
    from reco.serve.request import parse_request

    req = parse_request(body.encode(), store, serve.max_k, serve.max_candidates)
    urow = store.user_row(req.user_id)
    items = req.candidates if req.candidates is not None else store.candidates(urow, serve.n_candidates)
    return items, store.assemble(urow, req, items)


def batch_spread(
    block,
    company_block: Callable[[int], tuple[np.ndarray, ...]],
    n_requests: int,
    scorer,
    max_batch: int,
    rng,
    compositions: int = BATCH_COMPOSITIONS,
) -> float:
    """Widest |scores of `block` inside an offline batch - its scores alone| over `compositions` batches
    formed as reco.serve.batcher forms them: `block` among 1-MAX_COMPANY blocks company_block(j) (j <
    n_requests, drawn by `rng`) concatenated, the rows per request passed along, at most max_batch
    (serve.batching.max_batch) rows."""
    rows = len(block[0])
    alone = scorer(*block, [rows])
    widest = 0.0
    for _ in range(compositions):
        company: list[tuple[np.ndarray, ...]] = []
        total = rows
        for j in rng.integers(n_requests, size=int(rng.integers(1, MAX_COMPANY + 1))):
            other = company_block(int(j))
            if total + len(other[0]) > max_batch:
                break
            company.append(other)
            total += len(other[0])
        if not company:
            return widest  # no other request fits beside this one: the batcher scores it alone
        at = int(rng.integers(len(company) + 1))
        parts = company[:at] + [block] + company[at:]
        start = sum(len(p[0]) for p in company[:at])
        sizes = [len(p[0]) for p in parts]
        probs = scorer(*(np.concatenate([p[k] for p in parts]) for k in range(3)), sizes)
        widest = max(widest, float(np.abs(probs[start : start + rows] - alone).max()))
    return widest
