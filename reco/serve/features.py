"""In-memory feature store and candidate generation, built once from a dataset's train split.

Per user id: the user-side features of that user's latest train row. Per item id: the item-side
features of that item's latest train row, and its train impression count (popularity). Everything is
kept as dense numpy tables indexed by id, so assembling the model input for N candidates is a few
vectorised gathers:

    ids  [N, F, L] int64   user features broadcast, item features gathered, context from the request
    mask [N, F, L] float32 1 where a position holds a real id
    dense [N, D] float32

An entity absent from the train split (or an id outside its table) is cold-start: every feature of its
side is the shared unknown id 0 (length 1) and its dense features are 0 -- the same row the model uses
for out-of-vocabulary and pruned ids.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from reco.data.schema import Dataset, padding_mask

if TYPE_CHECKING:
    from reco.serve.config import RetrievalConfig


class RequestContext(Protocol):
    """What assemble reads of a parsed request (reco.serve.request.Request has it); a protocol, so this
    module does not depend on the request parser, which depends on it."""

    context_ids: np.ndarray  # [Fc, L] int64
    context_mask: np.ndarray  # [Fc, L] float32
    context_dense: np.ndarray  # [Dc] float32


log = logging.getLogger("reco.serve")


class ServeConfigError(ValueError):
    """The dataset or settings cannot be served (raised before the server binds its port)."""


@dataclass
class FeatureRows:
    """Feature rows of N entities of one side: ids [N, Fs, L] int32, mask [N, Fs, L] f32, dense [N, Ds] f32."""

    ids: np.ndarray
    mask: np.ndarray
    dense: np.ndarray


@dataclass
class SideTable:
    """One side's (user or item) features per entity id.

    ids:   [E+1, Fs, L] int32 (row E = cold-start: id 0, length 1)
    mask:  [E+1, Fs, L] float32
    dense: [E+1, Ds] float32
    row:   [cardinality] int64, entity id -> row (E when the entity is not in the train split)
    """

    cols: np.ndarray
    dense_cols: np.ndarray
    ids: np.ndarray
    mask: np.ndarray
    dense: np.ndarray
    row: np.ndarray

    @property
    def cold(self) -> int:
        return self.ids.shape[0] - 1

    def lookup(self, entity: np.ndarray) -> np.ndarray:
        """Table rows of `entity` ids [N] (any ints) -> [N] rows; out-of-range ids are cold-start."""
        rows = self.row.take(entity, mode="clip")
        if len(entity) and (entity.min() < 0 or entity.max() >= self.row.shape[0]):  # rare: not per request
            rows[(entity < 0) | (entity >= self.row.shape[0])] = self.cold
        return rows


Block = tuple[np.ndarray, np.ndarray, np.ndarray]  # dense [N, D] f32, ids [N, F, L] i64, mask [N, F, L] f32


class BlockPool:
    """Model-input buffers of one worker, reused request after request instead of three new arrays per
    request: a request takes a set for its block (FeatureStore.assemble's `out`) and gives it back once
    its model call has returned. A set still read by a model call (its request timed out) is never given
    back; the pool allocates another. Event loop thread only."""

    def __init__(self, store: FeatureStore, rows: int, keep: int) -> None:
        """Args:
        store: the feature store (F, L, D).
        rows: candidate rows per set (a larger request's block is allocated as before).
        keep: most free sets kept (a burst's extra sets are dropped when given back).
        """
        self.rows, self.keep, self.shape = rows, keep, (store.F, store.L, store.D)
        self._free: list[Block] = []

    def take(self) -> Block:
        """A free buffer set (`rows` rows), a new one when none is free."""
        if self._free:
            return self._free.pop()
        F, L, D = self.shape
        n = self.rows
        return (
            np.empty((n, D), dtype=np.float32),
            np.empty((n, F, L), dtype=np.int64),
            np.empty((n, F, L), dtype=np.float32),
        )

    def give(self, block: Block) -> None:
        """Return a set `take` gave once nothing reads it any more."""
        if len(self._free) < self.keep:
            self._free.append(block)


def _columns(cols: np.ndarray) -> slice | np.ndarray:
    """`cols` (ascending column indices) as a slice when they are contiguous, else as they are."""
    if len(cols) and cols[-1] - cols[0] + 1 == len(cols):
        return slice(int(cols[0]), int(cols[-1]) + 1)
    return cols


def distinct_per_row(ids: np.ndarray, valid: np.ndarray, card: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's distinct ids in [1, card) among its `valid` positions, ascending, left-aligned.

    Args:
        ids: [R, L] ids.
        valid: [R, L] bool, the positions that hold an id.
        card: ids outside [1, card) are left out.
    Returns:
        (groups [R, L] int64, padded with `card`; count [R] int64: how many each row holds).
    """
    x = np.where(valid & (ids > 0) & (ids < card), ids, card).astype(np.int64)
    x.sort(axis=1)
    x[:, 1:][x[:, 1:] == x[:, :-1]] = card  # a repeat of its left neighbour (sorted: of an earlier id)
    x.sort(axis=1)
    return x, (x < card).sum(axis=1)


def _side_table(ds: Dataset, side: str, key: str) -> SideTable:
    """Built with numpy alone: a server's dataset holds numpy arrays (Dataset.load_arrays), a test's may
    hold tensors (np.asarray views either)."""
    s, tr = ds.schema, ds.train
    tr_ids = np.asarray(tr.ids)
    cols = np.array([i for i, f in enumerate(s.sparse) if f.side == side], dtype=np.int64)
    dense_cols = np.array([i for i, f in enumerate(s.dense) if f.side == side], dtype=np.int64)
    card = s.sparse[s.index(key)].cardinality
    ent = tr_ids[:, s.index(key), 0]
    ent = np.where((ent > 0) & (ent < card), ent, 0)  # id 0 rows are unknown entities, never stored
    last = np.full(card, -1, dtype=np.int64)
    np.maximum.at(last, ent, np.arange(len(ent)))  # train rows are time-ordered: latest row wins
    last[0] = -1
    seen = np.flatnonzero(last >= 0)
    L = tr_ids.shape[2]
    n = len(seen)
    ids = np.zeros((n + 1, len(cols), L), dtype=np.int32)
    mask = np.zeros((n + 1, len(cols), L), dtype=np.float32)
    dense = np.zeros((n + 1, len(dense_cols)), dtype=np.float32)
    rows = last[seen]
    full_mask = padding_mask(np.asarray(tr.lengths), L)
    ids[:n] = tr_ids[rows][:, cols]
    mask[:n] = full_mask[rows][:, cols]
    dense[:n] = np.asarray(tr.dense)[rows][:, dense_cols]
    mask[n, :, 0] = 1.0  # cold-start: the unknown id 0 with length 1 in every feature
    row = np.full(card, n, dtype=np.int64)
    row[seen] = np.arange(n)
    return SideTable(cols, dense_cols, ids, mask, dense, row)


class FeatureStore:
    """User/item feature tables and popularity lists of one dataset (see the module docstring)."""

    def __init__(self, ds: Dataset, retrieval: RetrievalConfig | None) -> None:
        """Build the tables from `ds`'s train split.

        Args:
            ds: the dataset; its schema must name user_key and item_key.
            retrieval: candidate generation settings; None = global popularity only.
        """
        s = ds.schema
        if s.user_key is None or s.item_key is None:
            raise ServeConfigError(
                f"dataset {ds.name!r}: schema.user_key={s.user_key!r}, schema.item_key={s.item_key!r}; "
                "serving needs both (which sparse features hold the user id and the item id)"
            )
        self.schema = s
        self.L = ds.train.ids.shape[2]
        self.F, self.D = len(s.sparse), len(s.dense)
        self.users = _side_table(ds, "user", s.user_key)
        self.items = _side_table(ds, "item", s.item_key)
        self.ctx_cols = np.array([i for i, f in enumerate(s.sparse) if f.side == "context"], dtype=np.int64)
        self.ctx_dense_cols = np.array(
            [i for i, f in enumerate(s.dense) if f.side == "context"], dtype=np.int64
        )
        self.ctx_sparse = {f.name: (j, f) for j, f in enumerate(s.sparse[i] for i in self.ctx_cols)}
        self.ctx_dense = {s.dense[i].name: j for j, i in enumerate(self.ctx_dense_cols)}
        self.item_card = s.sparse[s.index(s.item_key)].cardinality

        counts = np.bincount(np.asarray(ds.train.ids)[:, s.index(s.item_key), 0], minlength=self.item_card)
        counts[0] = 0
        known = np.flatnonzero(self.items.row != self.items.cold)
        # Global popularity: known items, most impressions first (ties: lower id first, deterministic).
        self.popular = known[np.lexsort((known, -counts[known]))]
        self.share = float(retrieval.share) if retrieval else 0.0
        self.groups = self._group_index(retrieval, counts, known)
        self.retriever = self._two_tower(ds, retrieval)
        self._seen = np.zeros(self.item_card, dtype=bool)  # scratch for de-duplication (one thread only)
        # scratch of _base (one thread only): a request's user + context row, item columns always 0
        self._base_rows = (
            np.zeros((self.F, self.L), dtype=np.int64),
            np.zeros((self.F, self.L), dtype=np.float32),
            np.zeros(self.D, dtype=np.float32),
        )

        # Where the item side's columns sit in a model row: a slice when they are contiguous (one strided
        # copy per request), else their indices.
        self._item_cols, self._item_dense_cols = _columns(self.items.cols), _columns(self.items.dense_cols)

    def _group_index(
        self, retrieval: RetrievalConfig | None, counts: np.ndarray, known: np.ndarray
    ) -> dict | None:
        """Items grouped by the retrieval item feature, each group most popular first (CSR layout)."""
        uf, itf = (retrieval.user_feature, retrieval.item_feature) if retrieval else (None, None)
        names = {f.name: f for f in self.schema.sparse}
        if not uf or not itf:
            return None
        if uf not in names or names[uf].side != "user" or itf not in names or names[itf].side != "item":
            log.warning(
                "serve.retrieval: user_feature %r (user side) / item_feature %r (item side) not in the "
                "schema; candidates come from global popularity only",
                uf,
                itf,
            )
            return None
        card = names[itf].cardinality
        item_group = self.items.ids[
            self.items.row[known], list(self.items.cols).index(self.schema.index(itf)), 0
        ]
        order = np.lexsort((known, -counts[known], item_group))
        grp_sorted = item_group[order]
        user_col = list(self.users.cols).index(self.schema.index(uf))
        return {
            "user_groups": distinct_per_row(
                self.users.ids[:, user_col], self.users.mask[:, user_col] > 0, card
            ),
            "items": known[order],
            "starts": np.searchsorted(grp_sorted, np.arange(card + 1)),
            "card": card,
            "feature": f"{uf}->{itf}",
        }

    def for_thread(self) -> FeatureStore:
        """A view of this store for another thread: the tables shared, the candidates() scratch its own.

        Returns:
            A shallow copy with fresh scratch arrays (de-duplication, the base row).
        """
        view = copy.copy(self)
        view._seen = np.zeros_like(self._seen)
        view._base_rows = tuple(np.zeros_like(a) for a in self._base_rows)
        return view

    def _two_tower(self, ds: Dataset, retrieval: RetrievalConfig | None):
        """serve.retrieval.kind=two_tower: the trained stage (reco.retrieval.artifact) and its index."""
        if retrieval is None or retrieval.kind != "two_tower":
            return None
        if not retrieval.artifact:
            raise ServeConfigError(
                "serve.retrieval.kind=two_tower needs serve.retrieval.artifact (a trained stage's directory; "
                "`python run.py ...` trains one from `retrieval.two_tower` and sets it)"
            )
        from reco.retrieval.artifact import Retriever, load_artifact

        return Retriever(load_artifact(retrieval.artifact, ds.schema, ds.fingerprint), retrieval.index)

    @property
    def retrieval_name(self) -> str:
        if self.retriever is not None:
            return self.retriever.name
        return self.groups["feature"] if self.groups else "popularity"

    def item_catalogue(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every item the store holds: (item ids [n], ids [n, Fi, L], mask [n, Fi, L], dense [n, Di])."""
        it = self.items
        item_ids = np.flatnonzero(it.row != it.cold)
        rows = it.row[item_ids]
        return item_ids, it.ids[rows], it.mask[rows], it.dense[rows]

    def user_row(self, user_id: int) -> int:
        """Row of `user_id`'s features (any int); the cold-start row for ids not in the train split."""
        row = self.users.row
        return int(row[user_id]) if 0 < user_id < len(row) else self.users.cold

    def check_items(self, item_ids: np.ndarray) -> np.ndarray:
        """The ids among `item_ids` [M] outside [1, cardinality) (they have no embedding row at all)."""
        return item_ids[(item_ids < 1) | (item_ids >= self.item_card)]

    def candidates(self, user_row: int, n: int) -> np.ndarray:
        """Candidates for the user at `user_row`: [<=n] int64 item ids; two_tower: the user tower's nearest
        items; else popular items of the user's recent groups (retrieval.share of them), then global
        popularity."""
        if self.retriever is not None:
            u, r = self.users, slice(user_row, user_row + 1)
            return self.retriever.candidates(u.ids[r], u.mask[r], u.dense[r], n)
        picked = np.empty(0, dtype=np.int64)
        g = self.groups
        if g is not None and self.share > 0:
            groups, count = g["user_groups"]
            grp = groups[user_row, : count[user_row]]  # its distinct groups, ascending (precomputed)
            if len(grp):
                want = int(n * self.share)
                per = math.ceil(want / len(grp))
                st, its = g["starts"], g["items"]
                lo, hi = st[grp].tolist(), st[grp + 1].tolist()
                picked = np.concatenate([its[a : min(a + per, b)] for a, b in zip(lo, hi, strict=True)])[
                    :want
                ]
        if len(picked) == 0:
            return self.popular[:n].copy()
        fill = self.popular[: n + len(picked)]
        self._seen[picked] = True
        fill = fill[~self._seen[fill]][: n - len(picked)]
        self._seen[picked] = False
        return np.concatenate([picked, fill])

    def _base(self, u_ids: np.ndarray, u_mask: np.ndarray, u_dense: np.ndarray, req: RequestContext):
        """One row's user + context columns (item columns 0): ids [F, L] i64, mask [F, L], dense [D].

        Written into this thread's scratch (item columns never written, so they stay 0): valid until
        its next call.
        """
        u = self.users
        base_ids, base_mask, base_dense = self._base_rows
        base_ids[u.cols], base_mask[u.cols], base_dense[u.dense_cols] = u_ids, u_mask, u_dense
        base_ids[self.ctx_cols], base_mask[self.ctx_cols] = req.context_ids, req.context_mask
        base_dense[self.ctx_dense_cols] = req.context_dense
        return base_ids, base_mask, base_dense

    def assemble(
        self, user_row: int, req: RequestContext, items: np.ndarray, out: Block | None = None
    ) -> tuple[np.ndarray, ...]:
        """Model input for one user and N candidate items, from the in-memory tables.

        Args:
            user_row: the user's row (user_row()).
            req: the request's context.
            items: [N] candidate item ids.
            out: buffers to write into (BlockPool.take(); at least N rows); None: new arrays.
        Returns:
            dense [N, D] f32, ids [N, F, L] i64, mask [N, F, L] f32 (views of `out` when given).
        """
        u = self.users
        base_ids, base_mask, base_dense = self._base(
            u.ids[user_row], u.mask[user_row], u.dense[user_row], req
        )
        rows = self.items.lookup(items)
        n, it = len(rows), self.items
        if out is None:
            dense = np.empty((n, self.D), dtype=np.float32)
            ids = np.empty((n, self.F, self.L), dtype=np.int64)
            mask = np.empty((n, self.F, self.L), dtype=np.float32)
        else:
            dense, ids, mask = out[0][:n], out[1][:n], out[2][:n]
        # Every row is the user + context row with the item's columns written over it: the gather reads
        # only the item side's (int32) columns, a few cache lines per candidate, not whole model rows.
        # mode="clip": rows are in the table (lookup), and take buffers its output under "raise".
        ids[:] = base_ids
        ids[:, self._item_cols] = it.ids.take(rows, axis=0, mode="clip")
        mask[:] = base_mask
        mask[:, self._item_cols] = it.mask.take(rows, axis=0, mode="clip")
        dense[:] = base_dense
        dense[:, self._item_dense_cols] = it.dense.take(rows, axis=0, mode="clip")
        return dense, ids, mask

    def assemble_rows(
        self, user: FeatureRows, req: RequestContext, items: FeatureRows
    ) -> tuple[np.ndarray, ...]:
        """Model input from feature rows read elsewhere (an online store): `user` has one row, `items` N.

        Returns dense [N, D] f32, ids [N, F, L] i64, mask [N, F, L] f32 -- what assemble returns for the
        same rows.
        """
        base_ids, base_mask, base_dense = self._base(user.ids[0], user.mask[0], user.dense[0], req)
        it, n = self.items, items.ids.shape[0]
        ids = np.zeros((n, self.F, self.L), dtype=np.int64)
        mask = np.zeros((n, self.F, self.L), dtype=np.float32)
        dense = np.zeros((n, self.D), dtype=np.float32)
        ids[:, it.cols], mask[:, it.cols], dense[:, it.dense_cols] = items.ids, items.mask, items.dense
        ids += base_ids
        mask += base_mask
        dense += base_dense
        return dense, ids, mask
