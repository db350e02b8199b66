"""Synthetic e-commerce click log with a planted ground-truth click model.

Users, items, categories, brands, prices and context (hour, device). Item and user activity follow
power laws; half the impressions come from a user's recent categories, half from global popularity.
Each label is drawn from a known click probability (latent user x item factors plus feature effects),
so the oracle AUC -- the AUC of the true probabilities on the test split -- bounds what any model can
reach and is logged beside the model's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from reco.data.schema import Dataset, DenseFeature, Schema, SparseFeature, Split, time_split


@dataclass(frozen=True)
class SyntheticConfig:
    n_rows: int
    n_users: int
    n_items: int
    n_categories: int
    n_brands: int
    latent_dim: int
    max_recent: int
    seed: int
    target_ctr: float = 0.25
    item_zipf: float = 1.05
    user_zipf: float = 0.9


def _zipf_weights(n: int, a: float, rng: np.random.Generator) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** a
    rng.shuffle(w)  # popularity rank independent of id
    return w / w.sum()


@dataclass
class Simulation:
    """The generated dataset and the planted click model behind it, row for row over all n rows (time
    order; the splits are `time_split(n)`): reco.learnability reads what a model could learn."""

    dataset: Dataset
    terms: dict[str, np.ndarray]  # the click logit's additive terms
    offset: float  # the constant added to their sum for the target CTR; sigmoid(sum + offset) = P(click)
    users: np.ndarray
    items: np.ndarray


def generate(cfg: SyntheticConfig) -> Dataset:
    return simulate(cfg).dataset


def simulate(cfg: SyntheticConfig) -> Simulation:
    rng = np.random.default_rng(cfg.seed)
    k = cfg.latent_dim
    n_u, n_i, n_c = cfg.n_users, cfg.n_items, cfg.n_categories

    # Items: category, brand, price, popularity, latent factors.
    cat_w = _zipf_weights(n_c, 0.8, rng)
    item_cat = rng.choice(n_c, size=n_i, p=cat_w)
    item_brand = (item_cat * 7 + rng.integers(0, 40, size=n_i)) % cfg.n_brands
    cat_price = rng.normal(3.0, 0.8, size=n_c)
    log_price = cat_price[item_cat] + rng.normal(0, 0.4, size=n_i)
    item_pop = _zipf_weights(n_i, cfg.item_zipf, rng)
    cat_vec = rng.normal(0, 1 / np.sqrt(k), size=(n_c, k))
    item_vec = 0.6 * cat_vec[item_cat] + rng.normal(0, 0.8 / np.sqrt(k), size=(n_i, k))
    item_bias = rng.normal(0, 0.4, size=n_i) + 0.15 * np.log(item_pop * n_i)

    # Users: latent taste, segment, price sensitivity, recent categories (their favourite ones).
    user_vec = rng.normal(0, 1 / np.sqrt(k), size=(n_u, k))
    user_pop = _zipf_weights(n_u, cfg.user_zipf, rng)
    segment = rng.integers(0, 10, size=n_u)
    price_sens = rng.normal(0.3, 0.3, size=n_u) + 0.05 * segment
    n_recent = rng.integers(1, cfg.max_recent + 1, size=n_u)
    top_cats = np.empty((n_u, cfg.max_recent), dtype=np.int64)
    for lo in range(0, n_u, 20_000):  # chunked: [chunk, n_c] affinity matrix
        aff = user_vec[lo : lo + 20_000] @ cat_vec.T + rng.gumbel(0, 0.3, size=(min(20_000, n_u - lo), n_c))
        top_cats[lo : lo + 20_000] = np.argsort(-aff, axis=1)[:, : cfg.max_recent]
    hour_device = rng.normal(0, 0.3, size=(24, 4))
    seg_cat = rng.normal(0, 0.3, size=(10, n_c))

    # Impressions, in time order.
    n = cfg.n_rows
    users = rng.choice(n_u, size=n, p=user_pop)
    items = rng.choice(n_i, size=n, p=item_pop)
    from_recent = rng.random(n) < 0.5
    pick = rng.integers(0, 1 << 30, size=n) % n_recent[users]
    want_cat = top_cats[users, pick]
    items[from_recent] = _sample_in_category(
        item_cat, item_pop, want_cat[from_recent], items[from_recent], rng
    )
    seconds = np.sort(rng.integers(0, 30 * 86400, size=n))
    hour = (seconds // 3600) % 24
    device = rng.choice(4, size=n, p=[0.55, 0.3, 0.1, 0.05])

    c = item_cat[items]
    in_recent = (top_cats[users] == c[:, None]) & (
        np.arange(cfg.max_recent)[None, :] < n_recent[users][:, None]
    )
    terms = {
        "user_x_item": 2.0 * np.einsum("nk,nk->n", user_vec[users], item_vec[items]),
        "user_x_category": 1.0 * np.einsum("nk,nk->n", user_vec[users], cat_vec[c]),
        "in_recent": 0.7 * in_recent.any(axis=1),
        "item_bias": item_bias[items],
        "price": -price_sens[users] * (log_price[items] - 3.0),
        "hour_device": hour_device[hour, device],
        "segment_x_category": seg_cat[segment[users], c],
    }
    logit = sum(terms.values())  # left to right, in the order above
    offset = _offset_for_ctr(logit, cfg.target_ctr)
    logit += offset
    prob = 1 / (1 + np.exp(-logit))
    labels = (rng.random(n) < prob).astype(np.float32)

    # Features. Ids are shifted by one: 0 is the shared "unknown" row of every table.
    L = cfg.max_recent
    recent = np.where(np.arange(L)[None, :] < n_recent[users][:, None], top_cats[users] + 1, 0)
    single = np.stack(
        [users + 1, segment[users] + 1, items + 1, c + 1, item_brand[items] + 1, hour + 1, device + 1]
    )
    ids = np.zeros((n, 8, L), dtype=np.int64)
    ids[:, [0, 1, 3, 4, 5, 6, 7], 0] = single.T
    ids[:, 2, :] = recent
    lengths = np.ones((n, 8), dtype=np.int64)
    lengths[:, 2] = n_recent[users]
    dense = np.stack(
        [
            (log_price[items] - 3.0) / 1.0,
            np.log(item_pop[items] * n_i) / 3.0,
            np.log(user_pop[users] * n_u) / 3.0,
        ],
        axis=1,
    ).astype(np.float32)

    schema = Schema(
        dense=(
            DenseFeature("log_price", "item"),
            DenseFeature("item_pop", "item"),
            DenseFeature("user_activity", "user"),
        ),
        sparse=(
            SparseFeature("user_id", n_u + 1, 1, "user"),
            SparseFeature("segment", 11, 1, "user"),
            SparseFeature("recent_categories", n_c + 1, L, "user"),
            SparseFeature("item_id", n_i + 1, 1, "item"),
            SparseFeature("category", n_c + 1, 1, "item"),
            SparseFeature("brand", cfg.n_brands + 1, 1, "item"),
            SparseFeature("hour", 25, 1, "context"),
            SparseFeature("device", 5, 1, "context"),
        ),
        user_key="user_id",
        item_key="item_id",
    )
    full = Split(
        torch.from_numpy(dense),
        torch.from_numpy(ids),
        torch.from_numpy(lengths),
        torch.from_numpy(labels),
        torch.from_numpy(prob.astype(np.float32)),
    )
    tr, va, te = time_split(n)
    ds = Dataset(schema, full.take(tr), full.take(va), full.take(te), name="synthetic_ecommerce")
    ds.compute_fingerprint()
    return Simulation(ds, terms, offset, users, items)


def _sample_in_category(
    item_cat: np.ndarray,
    item_pop: np.ndarray,
    cats: np.ndarray,
    fallback: np.ndarray,
    rng: np.random.Generator,
) -> np.ndarray:
    """Popularity-weighted item draw restricted to each row's category (vectorised).

    A category without items keeps the row's `fallback` item.
    """
    order = np.lexsort((-item_pop, item_cat))  # items grouped by category
    cat_sorted = item_cat[order]
    w = item_pop[order]
    starts = np.searchsorted(cat_sorted, np.arange(item_cat.max() + 2))
    cum = np.cumsum(w)
    base = np.concatenate([[0.0], cum])
    lo, hi = base[starts[cats]], base[starts[cats + 1]]
    r = lo + rng.random(cats.shape[0]) * (hi - lo)
    pos = np.searchsorted(cum, r, side="right")
    empty = starts[cats] == starts[cats + 1]
    pos = np.clip(pos, starts[cats], np.maximum(starts[cats + 1] - 1, starts[cats]))
    return np.where(empty, fallback, order[np.minimum(pos, len(order) - 1)])


def _offset_for_ctr(logit: np.ndarray, ctr: float) -> float:
    lo, hi = -20.0, 20.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if (1 / (1 + np.exp(-(logit + mid)))).mean() < ctr:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
