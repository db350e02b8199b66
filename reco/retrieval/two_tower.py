"""A two-tower retrieval model: a user tower and an item tower on TorchRec embedding bags, trained so that
a user's vector scores the items it engaged with above the rest of the catalogue.

Each tower pools its side's sparse features (schema `side`: user or item) through its own
EmbeddingBagCollection, concatenates its dense features and maps them through an MLP to an L2-normalised
vector, so a dot product is a cosine similarity and an inner-product index (FAISS) finds the nearest items.

Training: the train split's positive rows (label 1), each a (user features at the time of the event,
item) pair, with in-batch negatives -- every other item of the batch is a negative for the user -- and
the sampled softmax's popularity correction (logQ: Yi et al., RecSys 2019, "Sampling-bias-corrected
neural modeling for large corpus item recommendations"): an item appears as an in-batch negative in
proportion to its popularity, so its logit is lowered by log q(item), q its share of the positives.
Another row's copy of the same item is masked out (it is not a negative).

Mixed negative sampling (Yang et al., WWW 2020, "Mixed negative sampling for learning two-tower neural
networks in recommendations"), `uniform_negatives` > 0: that many items drawn uniformly from the catalogue
(every item with a train row, its latest train row's features: what the server's feature store holds) are
shared negatives of every row of a batch. In-batch negatives are only items someone clicked, so an item
never clicked in train is otherwise never pushed away from any user and its random vector can land in
anyone's top-N; the uniform ones reach the whole catalogue. With logQ on, every candidate's logit is
corrected by the log of the mixture it was drawn from: B in-batch slots drawn by popularity q and M uniform
slots, log(B q(item) + M / n_catalogue) (with M = 0 this is log q plus a constant, which the softmax
ignores). A sampled item equal to the row's own positive is masked out like an in-batch copy.

`drop_features`: schema features neither tower reads. An id seen in one or two clicks (the median user
and item of the default data) gets an embedding that memorises those clicks; without the ids the towers
generalise from what users and items share (categories, brand, price, popularity).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from omegaconf import MISSING
from torch import nn

from reco.config import ConfigError
from reco.data.schema import Dataset, Schema, to_kjt


@dataclass
class TwoTowerConfig:
    """`retrieval.two_tower` (conf/config.yaml; its defaults were chosen on validation with
    `python -m bench.two_tower_sweep`, experiments/retrieval/README.md)."""

    embedding_dim: int = MISSING  # every table's width
    hidden: list[int] = field(default_factory=list)  # each tower's hidden layer widths
    out_dim: int = MISSING  # the vectors' width (what the index holds)
    temperature: float = MISSING  # softmax temperature on the cosine similarities
    epochs: int = MISSING
    batch_size: int = MISSING  # also the number of in-batch negatives + 1
    lr: float = MISSING
    max_rows: int | None = MISSING  # positive rows per epoch (a random subset when fewer); null: all
    logq: bool = MISSING  # the sampled softmax's popularity correction (module docstring)
    uniform_negatives: int = MISSING  # catalogue items drawn uniformly per batch as extra negatives; 0: none
    drop_features: list[str] = field(default_factory=list)  # schema features (sparse or dense) no tower reads

    def check(self, where: str) -> None:
        if self.uniform_negatives < 0:
            raise ConfigError(
                f"{where}.uniform_negatives: expected >= 0 (uniformly drawn negatives per batch), "
                f"got {self.uniform_negatives}"
            )
        if (
            min(self.embedding_dim, self.out_dim, self.epochs, self.batch_size) < 1
            or not self.temperature > 0
        ):
            raise ConfigError(
                f"{where}: expected embedding_dim, out_dim, epochs, batch_size >= 1 and temperature > 0; got "
                f"{self.embedding_dim}, {self.out_dim}, {self.epochs}, {self.batch_size}, {self.temperature}"
            )


def side_columns(schema: Schema, side: str) -> tuple[list[int], list[int]]:
    """(sparse column indices, dense column indices) of one side's features."""
    return (
        [i for i, f in enumerate(schema.sparse) if f.side == side],
        [i for i, f in enumerate(schema.dense) if f.side == side],
    )


class Tower(nn.Module):
    """One side's features (but `drop_features`) -> an L2-normalised vector [B, out_dim]."""

    def __init__(self, name: str, schema: Schema, side: str, cfg: TwoTowerConfig) -> None:
        from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        super().__init__()
        all_cols, all_dense = side_columns(schema, side)
        drop = set(cfg.drop_features)
        # Positions within the side's columns (what side_rows hands the tower), of the features it reads.
        self.keep = [k for k, i in enumerate(all_cols) if schema.sparse[i].name not in drop]
        self.keep_dense = [k for k, i in enumerate(all_dense) if schema.dense[i].name not in drop]
        cols = [all_cols[k] for k in self.keep]
        if not cols:
            raise ConfigError(
                f"retrieval: the {name} tower has no {side}-side sparse feature left (the schema's, but "
                f"retrieval.two_tower.drop_features={sorted(drop)})"
            )
        self.features = [f"{name}_{schema.sparse[i].name}" for i in cols]
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name=f"t_{key}",
                    embedding_dim=cfg.embedding_dim,
                    num_embeddings=schema.sparse[i].cardinality,
                    feature_names=[key],
                    pooling=PoolingType.SUM,
                )
                for key, i in zip(self.features, cols, strict=True)
            ],
            device=torch.device("cpu"),
        )
        sizes = [len(cols) * cfg.embedding_dim + len(self.keep_dense), *cfg.hidden, cfg.out_dim]
        layers: list[nn.Module] = []
        for k, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            layers.append(nn.Linear(a, b))
            if k < len(sizes) - 2:
                layers.append(nn.ReLU())
        self.mlp = nn.Sequential(*layers)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """ids [B, Fs, L] int64, lengths [B, Fs], dense [B, Ds] (all the side's columns) -> [B, out_dim],
        unit length."""
        ids, lengths, dense = ids[:, self.keep], lengths[:, self.keep], dense[:, self.keep_dense]
        pooled = self.ebc(to_kjt(ids, lengths, self.features)).to_dict()
        x = torch.cat([pooled[f] for f in self.features] + [dense], 1)
        return nn.functional.normalize(self.mlp(x), dim=1)


class TwoTower(nn.Module):
    def __init__(self, schema: Schema, cfg: TwoTowerConfig) -> None:
        super().__init__()
        names = {f.name for f in schema.sparse} | {f.name for f in schema.dense}
        unknown = sorted(set(cfg.drop_features) - names)
        if unknown:
            raise ConfigError(
                f"retrieval.two_tower.drop_features: {unknown} are not features of the schema; expected some "
                f"of {sorted(names)}"
            )
        self.user = Tower("user", schema, "user", cfg)
        self.item = Tower("item", schema, "item", cfg)


@dataclass(frozen=True)
class SideRows:
    """One side's columns of some rows: ids [N, Fs, L] int64, lengths [N, Fs] int64, dense [N, Ds] f32."""

    ids: torch.Tensor
    lengths: torch.Tensor
    dense: torch.Tensor

    def take(self, idx: torch.Tensor) -> SideRows:
        return SideRows(self.ids[idx], self.lengths[idx], self.dense[idx])

    @classmethod
    def from_arrays(cls, ids: np.ndarray, mask: np.ndarray, dense: np.ndarray) -> SideRows:
        """From a feature store's arrays: ids [N, Fs, L] (any int), mask [N, Fs, L], dense [N, Ds]."""
        return cls(
            torch.from_numpy(np.asarray(ids, np.int64)),
            torch.from_numpy(np.asarray(mask)).sum(-1).long(),
            torch.from_numpy(np.asarray(dense, np.float32)),
        )


def side_rows(schema: Schema, split, side: str, rows: torch.Tensor | None = None) -> SideRows:
    """`side`'s columns of `split` (its rows `rows`, else all)."""
    cols, dense_cols = side_columns(schema, side)
    idx = slice(None) if rows is None else rows
    return SideRows(split.ids[idx][:, cols], split.lengths[idx][:, cols], split.dense[idx][:, dense_cols])


@dataclass(frozen=True)
class TrainReport:
    epochs: int
    rows: int  # positive rows per epoch
    loss: list[float]  # mean loss per epoch
    seconds: float


def catalogue_rows(schema: Schema, split) -> tuple[torch.Tensor, torch.Tensor]:
    """(item ids [n], rows [n]): every item with a row in `split` and its latest row (as the server's
    feature store holds it), ids ascending."""
    ids = split.ids[:, schema.index(schema.item_key), 0].numpy()
    last = len(ids) - 1 - np.unique(ids[::-1], return_index=True)[1]
    uniq = np.unique(ids)
    keep = uniq > 0  # id 0 is the shared unknown row, not an item
    return torch.from_numpy(uniq[keep]), torch.from_numpy(last[keep])


def sample_uniform(catalogue: torch.Tensor, m: int, gen: torch.Generator) -> torch.Tensor:
    """`m` positions into `catalogue` [n], uniformly with replacement."""
    return torch.randint(len(catalogue), (m,), generator=gen)


def batch_logits(
    user: torch.Tensor,
    item: torch.Tensor,
    pos_ids: torch.Tensor,
    neg: torch.Tensor | None,
    neg_ids: torch.Tensor | None,
    log_proposal: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """The sampled softmax's logits [B, B + M]: row r's candidates are the batch's items (its positive on
    the diagonal) then the M shared negatives.

    Args:
        user: [B, D] user vectors; item: [B, D] their positives' vectors; pos_ids: [B] those items' ids.
        neg: [M, D] extra negatives' vectors, neg_ids: [M] their ids (None: in-batch negatives only).
        log_proposal: [n_items] log of how often each item is drawn as a candidate (None: no correction).
    Every candidate equal to the row's positive, other than the diagonal, is -inf (not a negative).
    """
    cand_ids, vecs = pos_ids, item
    if neg is not None:
        cand_ids, vecs = torch.cat([pos_ids, neg_ids]), torch.cat([item, neg])
    logits = user @ vecs.T / temperature
    if log_proposal is not None:
        logits = logits - log_proposal[cand_ids][None, :]
    same = pos_ids[:, None] == cand_ids[None, :]
    same[:, : len(pos_ids)] &= ~torch.eye(len(pos_ids), dtype=torch.bool)
    return logits.masked_fill(same, -math.inf)


def train_two_tower(data: Dataset, cfg: TwoTowerConfig, seed: int, say=print) -> tuple[TwoTower, TrainReport]:
    """Train on the train split's positives (see the module docstring)."""
    s, tr = data.schema, data.train
    if s.item_key is None:
        raise ConfigError(f"dataset {data.name!r}: schema.item_key is not set; retrieval needs the item id")
    pos = torch.nonzero(tr.labels > 0.5).flatten()
    if len(pos) < 2:
        raise ConfigError(f"dataset {data.name!r}: {len(pos)} positive train rows; retrieval needs >= 2")
    torch.manual_seed(seed)
    model = TwoTower(s, cfg)
    users, items = side_rows(s, tr, "user", pos), side_rows(s, tr, "item", pos)
    item_ids = tr.ids[pos, s.index(s.item_key), 0]
    cat_ids, cat_rows = catalogue_rows(s, tr)
    cat_items = side_rows(s, tr, "item", cat_rows)
    m = cfg.uniform_negatives
    counts = torch.bincount(item_ids, minlength=s.sparse[s.index(s.item_key)].cardinality).double()
    # Expected draws of each item per batch (up to the batch size, which the softmax ignores): B q + M / n.
    proposal = cfg.batch_size * counts / counts.sum() + m / len(cat_ids)
    log_proposal = torch.log(proposal).float() if cfg.logq else None
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(seed)
    n = len(pos) if cfg.max_rows is None else min(len(pos), cfg.max_rows)
    t0, losses = time.time(), []
    for epoch in range(cfg.epochs):
        order = torch.randperm(len(pos), generator=gen)[:n]
        total, batches = 0.0, 0
        for a in range(0, n, cfg.batch_size):
            b = order[a : a + cfg.batch_size]
            if len(b) < 2:
                continue
            u, i = users.take(b), items.take(b)
            neg = neg_ids = None
            if m:
                k = sample_uniform(cat_ids, m, gen)
                c = cat_items.take(k)
                neg, neg_ids = model.item(c.ids, c.lengths, c.dense), cat_ids[k]
            logits = batch_logits(
                model.user(u.ids, u.lengths, u.dense),
                model.item(i.ids, i.lengths, i.dense),
                item_ids[b],
                neg,
                neg_ids,
                log_proposal,
                cfg.temperature,
            )
            loss = nn.functional.cross_entropy(logits, torch.arange(len(b)))
            opt.zero_grad()
            loss.backward()
            opt.step()
            total, batches = total + loss.item(), batches + 1
        losses.append(total / max(batches, 1))
        say(f"  two-tower epoch {epoch + 1}/{cfg.epochs}: loss {losses[-1]:.4f} ({n:,} positives)")
    return model.eval(), TrainReport(cfg.epochs, n, losses, time.time() - t0)


@torch.no_grad()
def encode(tower: Tower, rows: SideRows, batch: int = 8192) -> np.ndarray:
    """Vectors [N, out_dim] float32 of `rows`."""
    out = [
        tower(rows.ids[a : a + batch], rows.lengths[a : a + batch], rows.dense[a : a + batch])
        for a in range(0, rows.ids.shape[0], batch)
    ]
    return torch.cat(out).numpy().astype(np.float32, copy=False)
