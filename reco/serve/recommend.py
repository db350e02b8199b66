"""The request pipeline both servers share: a variant loaded for serving, candidates + model input for a
parsed request, and top-k + the response body.

reco's own server (reco/serve/app.py) and the Triton model (reco/serve/triton_backend.py) call these, so
a request is answered with the same items and scores whichever server runs the variant; each server adds
only its own transport, admission and batching around them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import orjson

from reco.data.schema import Dataset
from reco.runtime import Scorer
from reco.serve.config import BatchingConfig, ServeConfig
from reco.serve.features import FeatureStore, ServeConfigError
from reco.serve.request import Request, parse_request


@dataclass
class Loaded:
    """A variant ready to serve: its feature store, its warmed-up scorer and its batching settings."""

    name: str  # the variant's name (answered as "model")
    backend: str  # the variant's runtime (Variant.backend)
    store: FeatureStore
    scorer: Scorer
    batching: BatchingConfig  # serve.batching
    data_fingerprint: str  # the served dataset's (keys its rows in an online store)


def check_same_data(variant, data: Dataset, dataset_path: str) -> None:
    """Refuse a variant built on other data (it would index its tables out of range or score nonsense).

    Args:
        variant: the loaded Variant.
        data: the dataset to serve from.
        dataset_path: its path, for the message.
    Raises:
        ServeConfigError naming --dataset when the fingerprints differ.
    """
    if variant.data_fingerprint and data.fingerprint and variant.data_fingerprint != data.fingerprint:
        raise ServeConfigError(
            f"--dataset {dataset_path}: data fingerprint {data.fingerprint} differs from the one variant "
            f"{variant.name!r} was built on ({variant.data_fingerprint}); pass that variant's dataset"
        )


def load_variant(variant_dir: str, dataset_path: str, cfg: ServeConfig) -> Loaded:
    """Load the variant and the dataset, build the feature store and warm the model up.

    Args:
        variant_dir: the variant directory (holds variant.json).
        dataset_path: the Dataset file whose train split feeds the feature store.
        cfg: the serve settings (retrieval, intra_op_threads, batching, warmup_calls, limits).
    Returns:
        The Loaded variant; ServeConfigError / ArtifactError when it cannot be served.
    """
    from reco.runtime import load_scorer
    from reco.variant import Variant

    variant = Variant.load(variant_dir)
    data = Dataset.load_arrays(str(dataset_path))
    check_same_data(variant, data, dataset_path)
    store = FeatureStore(data, cfg.retrieval)
    shared = data.schema.shared_columns if cfg.user_once else None
    scorer = load_scorer(variant, threads=cfg.intra_op_threads, shared=shared)
    loaded = Loaded(variant.name, variant.backend, store, scorer, cfg.batching, data.fingerprint)
    # First calls of a runtime allocate and pick kernels; do them before accepting traffic.
    req = parse_request(b'{"user_id": 0, "k": 1}', store, cfg.max_k, cfg.max_candidates)
    block = store.assemble(store.users.cold, req, store.candidates(store.users.cold, cfg.n_candidates))
    for _ in range(cfg.warmup_calls):
        loaded.scorer(*block, [len(block[0])])
    return loaded


def candidate_items(store: FeatureStore, user_row: int, req: Request, n_candidates: int) -> np.ndarray:
    """The items to score: the request's own candidates, else `n_candidates` generated for the user.

    Returns:
        [M] int64 item ids.
    """
    return req.candidates if req.candidates is not None else store.candidates(user_row, n_candidates)


def top_k(name: str, items: np.ndarray, probs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best-scored items, best first (ties: the earlier candidate first).

    Args:
        name: the model's name, for the error.
        items: [M] int64 candidate ids.
        probs: [M] float32 their scores.
        k: how many to return (at most M are).
    Returns:
        (ids [min(k, M)], scores [min(k, M)]); RuntimeError when a returned score is not finite.
    """
    k = min(k, len(items))
    top = np.argpartition(-probs, k - 1)[:k] if 0 < k < len(items) else np.arange(k)
    top = top[np.argsort(-probs[top], kind="stable")]
    if not np.isfinite(probs[top]).all():  # orjson would write NaN/inf as null
        raise RuntimeError(f"model {name} returned non-finite scores")
    return items[top], probs[top]


def response_body(name: str, ids: np.ndarray, scores: np.ndarray) -> bytes:
    """The JSON answer: {"items": [{"item_id", "score"}, ...], "model": name}."""
    return orjson.dumps(
        {
            "items": [{"item_id": i, "score": p} for i, p in zip(ids.tolist(), scores.tolist(), strict=True)],
            "model": name,
        }
    )
