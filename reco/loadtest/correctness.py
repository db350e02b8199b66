"""Correctness under load (MLPerf TEST01's idea): the scores a variant returned under load equal its
offline scores for the same request.

During a common-load window the generator records the items and scores returned for every Nth request
(loadtest.score_every; `<latencies.csv>.scores.jsonl`, with the index of the request body). Here the same
bodies are scored in-process, unbatched, through the variant's own runtime (reco.runtime.load_scorer) on
the same feature store and candidate generation as the server (reco.serve.features.FeatureStore), and
every returned item's score is compared: |served - offline| <= tolerance (fp32: 1e-5). A server that
batched requests together must agree with this unbatched scoring as well. A returned item that is not
among the request's candidates, or an unreadable answer, is an infinite difference.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from reco.data.schema import Dataset
from reco.loadtest.outcome import CorrectnessCheck
from reco.serve.config import ServeConfig
from reco.variant import Variant


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
) -> CorrectnessCheck:
    """Compare the recorded served scores with offline scores of the same requests.

    Args:
        variant: the served variant (scored here through its own runtime, one thread).
        data: the dataset the server was started with.
        serve: the serve settings the server ran with (n_candidates, max_k, max_candidates, retrieval).
        requests_path: the request file the generator replayed (bodies by line index).
        score_files: the generator's .scores.jsonl files.
        tolerance: max |served - offline| score.
    Returns:
        CorrectnessCheck; passed is False when nothing was recorded.
    """
    from reco.runtime import load_scorer
    from reco.serve.features import FeatureStore

    samples = read_scores(score_files)
    if not samples:
        return CorrectnessCheck(0, math.inf, tolerance, False)
    bodies = [ln for ln in Path(requests_path).read_text().splitlines() if ln.strip()]
    store = FeatureStore(data, serve.retrieval)
    scorer = load_scorer(variant, threads=1)
    worst = 0.0
    for s in samples:
        worst = max(worst, _max_diff(s, bodies, store, scorer, serve))
    return CorrectnessCheck(len(samples), worst, tolerance, worst <= tolerance)


def _max_diff(sample: dict, bodies: list[str], store, scorer, serve: ServeConfig) -> float:
    from reco.serve.request import parse_request

    if sample["items"] is None:
        return math.inf
    req = parse_request(bodies[sample["payload"]].encode(), store, serve.max_k, serve.max_candidates)
    urow = store.user_row(req.user_id)
    items = req.candidates if req.candidates is not None else store.candidates(urow, serve.n_candidates)
    probs = scorer(*store.assemble(urow, req, items))  # [N] float32, one request alone: unbatched
    offline = dict(zip(items.tolist(), probs.tolist(), strict=True))
    served = np.array([[i, s] for i, s in sample["items"]], dtype=np.float64).reshape(-1, 2)
    diffs = [abs(s - offline[int(i)]) if int(i) in offline else math.inf for i, s in served]
    return max(diffs, default=0.0)
