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
    model: ClickModel


@dataclass(frozen=True)
class ClickModel:
    """The planted click model, for any (user, item, hour, device), not only the logged ones: what grades a
    served list by its true expected clicks (reco.serve.quality.planted_gains)."""

    cfg: SyntheticConfig
    it: dict[str, np.ndarray]
    us: dict[str, np.ndarray]
    offset: float

    def prob(self, users: np.ndarray, items: np.ndarray, hour: np.ndarray, device: np.ndarray) -> np.ndarray:
        """True P(click) [n] of 0-based ids (a feature's id minus one: 0 is the unknown row there)."""
        logit = sum(_click_terms(self.cfg, self.it, self.us, users, items, hour, device).values())
        return 1 / (1 + np.exp(-(logit + self.offset)))


def generate(cfg: SyntheticConfig) -> Dataset:
    return simulate(cfg).dataset


def simulate(cfg: SyntheticConfig) -> Simulation:
    """The catalogue, the users, their impressions and clicks, as a Dataset with its planted click model.

    One generator draws everything in a fixed order (items, users, impressions, clicks), so a config gives
    the same data, and the same fingerprint, every time; the helpers below keep that order.
    """
    rng = np.random.default_rng(cfg.seed)
    model, (users, items, hour, device), terms = _planted(cfg, rng)
    logit = sum(terms.values())  # left to right, in the order of _click_terms
    logit += model.offset
    prob = 1 / (1 + np.exp(-logit))
    labels = (rng.random(cfg.n_rows) < prob).astype(np.float32)
    dense, ids, lengths = _features(cfg, model.it, model.us, users, items, hour, device)
    full = Split(
        torch.from_numpy(dense),
        torch.from_numpy(ids),
        torch.from_numpy(lengths),
        torch.from_numpy(labels),
        torch.from_numpy(prob.astype(np.float32)),
    )
    tr, va, te = time_split(cfg.n_rows)
    ds = Dataset(_schema(cfg), full.take(tr), full.take(va), full.take(te), name="synthetic_ecommerce")
    ds.compute_fingerprint()
    return Simulation(ds, terms, model.offset, users, items, model)


def click_model(cfg: SyntheticConfig) -> ClickModel:
    """The click model `simulate(cfg)` plants, without building the data set (the same draws: the labels
    and features come after it)."""
    return _planted(cfg, np.random.default_rng(cfg.seed))[0]


def _planted(
    cfg: SyntheticConfig, rng: np.random.Generator
) -> tuple[ClickModel, tuple[np.ndarray, ...], dict[str, np.ndarray]]:
    """(the click model, the impressions (users, items, hours, devices), their logit terms)."""
    it = _items(cfg, rng)
    us = _users(cfg, rng, it)
    impressions = _impressions(cfg, rng, it, us)
    terms = _click_terms(cfg, it, us, *impressions)
    offset = _offset_for_ctr(sum(terms.values()), cfg.target_ctr)
    return ClickModel(cfg, it, us, offset), impressions, terms


def planted_catalogue(cfg: SyntheticConfig, n_queries: int) -> tuple[np.ndarray, np.ndarray]:
    """The planted click model's taste geometry over a catalogue of `cfg.n_items` items, for index
    benchmarks at sizes a click log of this machine cannot hold (a 1M-item catalogue would need ~10M rows
    for most items to be seen): item vectors [n_items, k] = 2 vec + cat_vec (the model's user x item and
    user x category terms, so items cluster by category as they do) and `n_queries` user taste vectors
    [q, k], both L2-normalised as a two-tower's are (the item bias, price, hour and segment terms are not
    a similarity and are left out). float32; the same config gives the same vectors.
    """
    rng = np.random.default_rng(cfg.seed)
    it = _items(cfg, rng)
    items = 2.0 * it["vec"] + it["cat_vec"][it["cat"]]
    users = rng.normal(0, 1 / np.sqrt(cfg.latent_dim), size=(n_queries, cfg.latent_dim))
    unit = [(x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32) for x in (items, users)]
    return unit[0], unit[1]


def _items(cfg: SyntheticConfig, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Items: category, brand, price, popularity, latent factors ([n_items] arrays; cat_vec [n_cat, k])."""
    k, n_i, n_c = cfg.latent_dim, cfg.n_items, cfg.n_categories
    cat_w = _zipf_weights(n_c, 0.8, rng)
    cat = rng.choice(n_c, size=n_i, p=cat_w)
    brand = (cat * 7 + rng.integers(0, 40, size=n_i)) % cfg.n_brands
    cat_price = rng.normal(3.0, 0.8, size=n_c)
    log_price = cat_price[cat] + rng.normal(0, 0.4, size=n_i)
    pop = _zipf_weights(n_i, cfg.item_zipf, rng)
    cat_vec = rng.normal(0, 1 / np.sqrt(k), size=(n_c, k))
    vec = 0.6 * cat_vec[cat] + rng.normal(0, 0.8 / np.sqrt(k), size=(n_i, k))
    bias = rng.normal(0, 0.4, size=n_i) + 0.15 * np.log(pop * n_i)
    return {"cat": cat, "brand": brand, "log_price": log_price, "pop": pop, "cat_vec": cat_vec, "vec": vec,
            "bias": bias}  # fmt: skip


def _users(cfg: SyntheticConfig, rng: np.random.Generator, it: dict) -> dict[str, np.ndarray]:
    """Users: latent taste, segment, price sensitivity, recent categories (their favourite ones); plus the
    context (hour x device) and segment x category effects."""
    k, n_u, n_c = cfg.latent_dim, cfg.n_users, cfg.n_categories
    vec = rng.normal(0, 1 / np.sqrt(k), size=(n_u, k))
    pop = _zipf_weights(n_u, cfg.user_zipf, rng)
    segment = rng.integers(0, 10, size=n_u)
    price_sens = rng.normal(0.3, 0.3, size=n_u) + 0.05 * segment
    n_recent = rng.integers(1, cfg.max_recent + 1, size=n_u)
    top_cats = np.empty((n_u, cfg.max_recent), dtype=np.int64)
    for lo in range(0, n_u, 20_000):  # chunked: [chunk, n_c] affinity matrix
        aff = vec[lo : lo + 20_000] @ it["cat_vec"].T + rng.gumbel(0, 0.3, size=(min(20_000, n_u - lo), n_c))
        top_cats[lo : lo + 20_000] = np.argsort(-aff, axis=1)[:, : cfg.max_recent]
    hour_device = rng.normal(0, 0.3, size=(24, 4))
    seg_cat = rng.normal(0, 0.3, size=(10, n_c))
    return {"vec": vec, "pop": pop, "segment": segment, "price_sens": price_sens, "n_recent": n_recent,
            "top_cats": top_cats, "hour_device": hour_device, "seg_cat": seg_cat}  # fmt: skip


def _impressions(
    cfg: SyntheticConfig, rng: np.random.Generator, it: dict, us: dict
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """[n_rows] users, items, hours and devices of the impressions, in time order; half the items come
    from one of the user's recent categories."""
    n = cfg.n_rows
    users = rng.choice(cfg.n_users, size=n, p=us["pop"])
    items = rng.choice(cfg.n_items, size=n, p=it["pop"])
    from_recent = rng.random(n) < 0.5
    pick = rng.integers(0, 1 << 30, size=n) % us["n_recent"][users]
    want_cat = us["top_cats"][users, pick]
    items[from_recent] = _sample_in_category(
        it["cat"], it["pop"], want_cat[from_recent], items[from_recent], rng
    )
    seconds = np.sort(rng.integers(0, 30 * 86400, size=n))
    hour = (seconds // 3600) % 24
    device = rng.choice(4, size=n, p=[0.55, 0.3, 0.1, 0.05])
    return users, items, hour, device


def _click_terms(
    cfg: SyntheticConfig, it: dict, us: dict, users: np.ndarray, items: np.ndarray, hour, device
) -> dict[str, np.ndarray]:
    """The planted click model's additive logit terms, [n_rows] each (summed in this order)."""
    c = it["cat"][items]
    in_recent = (us["top_cats"][users] == c[:, None]) & (
        np.arange(cfg.max_recent)[None, :] < us["n_recent"][users][:, None]
    )
    return {
        "user_x_item": 2.0 * np.einsum("nk,nk->n", us["vec"][users], it["vec"][items]),
        "user_x_category": 1.0 * np.einsum("nk,nk->n", us["vec"][users], it["cat_vec"][c]),
        "in_recent": 0.7 * in_recent.any(axis=1),
        "item_bias": it["bias"][items],
        "price": -us["price_sens"][users] * (it["log_price"][items] - 3.0),
        "hour_device": us["hour_device"][hour, device],
        "segment_x_category": us["seg_cat"][us["segment"][users], c],
    }


def _features(
    cfg: SyntheticConfig, it: dict, us: dict, users: np.ndarray, items: np.ndarray, hour, device
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """dense [n, 3] float32, ids [n, 8, L] int64, lengths [n, 8] int64 in _schema's feature order. Ids are
    shifted by one: 0 is the shared "unknown" row of every table."""
    n, L = cfg.n_rows, cfg.max_recent
    c = it["cat"][items]
    n_recent = us["n_recent"]
    recent = np.where(np.arange(L)[None, :] < n_recent[users][:, None], us["top_cats"][users] + 1, 0)
    single = np.stack(
        [users + 1, us["segment"][users] + 1, items + 1, c + 1, it["brand"][items] + 1, hour + 1, device + 1]
    )
    ids = np.zeros((n, 8, L), dtype=np.int64)
    ids[:, [0, 1, 3, 4, 5, 6, 7], 0] = single.T
    ids[:, 2, :] = recent
    lengths = np.ones((n, 8), dtype=np.int64)
    lengths[:, 2] = n_recent[users]
    dense = np.stack(
        [
            (it["log_price"][items] - 3.0) / 1.0,
            np.log(it["pop"][items] * cfg.n_items) / 3.0,
            np.log(us["pop"][users] * cfg.n_users) / 3.0,
        ],
        axis=1,
    ).astype(np.float32)
    return dense, ids, lengths


def _schema(cfg: SyntheticConfig) -> Schema:
    n_c, L = cfg.n_categories, cfg.max_recent
    return Schema(
        dense=(
            DenseFeature("log_price", "item"),
            DenseFeature("item_pop", "item"),
            DenseFeature("user_activity", "user"),
        ),
        sparse=(
            SparseFeature("user_id", cfg.n_users + 1, 1, "user"),
            SparseFeature("segment", 11, 1, "user"),
            SparseFeature("recent_categories", n_c + 1, L, "user"),
            SparseFeature("item_id", cfg.n_items + 1, 1, "item"),
            SparseFeature("category", n_c + 1, 1, "item"),
            SparseFeature("brand", cfg.n_brands + 1, 1, "item"),
            SparseFeature("hour", 25, 1, "context"),
            SparseFeature("device", 5, 1, "context"),
        ),
        user_key="user_id",
        item_key="item_id",
    )


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
