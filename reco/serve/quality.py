"""The top-k a variant serves for a fixed set of test requests: what the report's quality table compares.

The requests are the same for every variant: up to `users` test-split users with at least one positive
(label 1) test row, drawn with the experiment's seed; each carries the context of that user's first
positive test row and gets the service's own candidates (serve.n_candidates, serve.retrieval) and
ranking -- the functions the server calls (reco.serve.recommend), in process (the study's correctness
check shows the server answers the same scores over HTTP). A user's relevant items are its positive
test items, so recall@k and NDCG@k measure what the user would have seen, candidate generation included.

Logged relevance is exposure x click, so it rewards popular items; on data with a planted click model
(reco.data.synthetic) every candidate of a request is also graded by its true P(click) (`planted_gains`),
and two reference rankers of the same candidates (`reference_topk`: training popularity, the oracle) show
what each measure rewards.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from omegaconf import MISSING

from reco.config import ConfigError
from reco.data.schema import Dataset
from reco.data.synthetic import ClickModel
from reco.runtime import Scorer
from reco.serve.config import ServeConfig
from reco.serve.features import FeatureStore
from reco.serve.recommend import top_k


@dataclass
class QualityConfig:
    """`quality` (conf/config.yaml): the top-k quality table (its gate: gate.max_expected_clicks_drop_pct)."""

    users: int = MISSING  # test users (with a positive) whose served top-k is compared; 0: off
    k: int = MISSING  # the list compared: NDCG@k, recall@k, overlap@k, RBO to depth k
    rbo_p: float = MISSING  # RBO's persistence: the weight of rank d is p^(d-1)
    # interim looks (request counts < users, rising): a variant stops answering at the first look where
    # its look_confidence interval of Δexpected clicks@k decides the gate (TopK.measure); []: none
    looks: list[int] = MISSING
    look_confidence: float = MISSING

    def check(self, where: str) -> None:
        if self.users < 0 or self.k < 1 or not 0 < self.rbo_p < 1:
            raise ConfigError(
                f"{where}: expected users >= 0, k >= 1 and 0 < rbo_p < 1; got users={self.users}, k={self.k}, "
                f"rbo_p={self.rbo_p}"
            )
        looks = list(self.looks)
        if looks and any(b <= a for a, b in zip([0, *looks], [*looks, self.users], strict=True)):
            raise ConfigError(
                f"{where}.looks: expected rising request counts above 0 and below users={self.users}; got {looks}"
            )
        if not 0.5 < self.look_confidence < 1:
            raise ConfigError(
                f"{where}.look_confidence: expected a level in (0.5, 1); got {self.look_confidence}"
            )


@dataclass(frozen=True)
class QualityRequests:
    """The requests every variant answers: one per user."""

    users: np.ndarray  # [U] user ids
    rows: np.ndarray  # [U] the row (of the split drawn from) whose context the request carries
    relevant: list[np.ndarray]  # per user: its positive items in that split
    split: str = "test"  # the split `rows` index (its contexts are the requests')


@dataclass(frozen=True)
class _Context:  # reco.serve.features.RequestContext from a test row
    context_ids: np.ndarray
    context_mask: np.ndarray
    context_dense: np.ndarray


SPLITS = ("train", "val", "test")


def look_order(n: int, seed: int) -> np.ndarray:
    """The order the quality.looks answer requests in: a seeded shuffle, since the requests are sorted by
    user id and the first m of them would be the lowest ids, not a sample of the users."""
    return np.random.default_rng([seed, n]).permutation(n)


def look_rows(n: int, m: int, seed: int) -> np.ndarray:
    """The requests (indices, ascending) answered by the look at m of n: a variant's lists of m rows are
    these requests' (m = n: all of them)."""
    return np.arange(n) if m >= n else np.sort(look_order(n, seed)[:m])


def subset(reqs: QualityRequests, rows: np.ndarray) -> QualityRequests:
    """The requests at `rows` (indices into reqs), in that order."""
    return QualityRequests(reqs.users[rows], reqs.rows[rows], [reqs.relevant[i] for i in rows], reqs.split)


def quality_requests(data: Dataset, n_users: int, seed: int, split: str = "test") -> QualityRequests:
    """Up to `n_users` users with a positive in `split` (test; val to choose settings without looking at
    test; train for requests to learn from), drawn with `seed` (sorted by id, so a larger draw with the
    same seed is not a reshuffle); rows and relevant items are that split's."""
    if split not in SPLITS:
        raise ValueError(f"quality_requests: split {split!r}: expected one of {SPLITS}")
    s, t = data.schema, getattr(data, split)
    if s.user_key is None or s.item_key is None:
        return QualityRequests(np.empty(0, np.int64), np.empty(0, np.int64), [], split)
    users = t.ids[:, s.index(s.user_key), 0].numpy()
    items = t.ids[:, s.index(s.item_key), 0].numpy()
    pos = np.flatnonzero(t.labels.numpy() > 0.5)
    known = pos[users[pos] > 0]  # id 0 is the unknown user: not one person
    order = np.argsort(users[known], kind="stable")
    u_sorted = users[known][order]
    uniq, first = np.unique(u_sorted, return_index=True)
    pick = np.sort(np.random.default_rng(seed).permutation(len(uniq))[:n_users])
    bounds = np.append(first, len(u_sorted))
    rows = known[order][first[pick]]
    relevant = [items[known[order][bounds[i] : bounds[i + 1]]] for i in pick]
    return QualityRequests(uniq[pick], rows, relevant, split)


class RequestInputs:
    """Each request's candidates and model input, as the service builds them (retrieval from the user's
    stored features, then the in-memory assembly with the context of the request's row)."""

    def __init__(self, store: FeatureStore, data: Dataset, reqs: QualityRequests) -> None:
        t = getattr(data, reqs.split)
        self.store, self.reqs = store, reqs
        self.ids, self.dense, self.mask = t.ids.numpy(), t.dense.numpy(), t.mask().numpy()

    def candidates(self, i: int, n: int) -> np.ndarray:
        """Request i's candidates [<= n] item ids."""
        return self.store.candidates(self.store.user_row(int(self.reqs.users[i])), n)

    def __call__(
        self, i: int, n: int, items: np.ndarray | None = None
    ) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        """Request i's candidates [<= n] item ids (or the given `items`) and their input (dense [M, D],
        ids [M, F, L], mask [M, F, L])."""
        store, row = self.store, int(self.reqs.rows[i])
        ctx = _Context(
            self.ids[row, store.ctx_cols],
            self.mask[row, store.ctx_cols],
            self.dense[row, store.ctx_dense_cols],
        )
        urow = store.user_row(int(self.reqs.users[i]))
        if items is None:
            items = store.candidates(urow, n)
        return items, store.assemble(urow, ctx, items)


PER_CALL = 8  # requests whose candidate blocks served_topk scores in one model call (a batcher's share)


def served_topk(
    scorer: Scorer,
    store: FeatureStore,
    data: Dataset,
    reqs: QualityRequests,
    serve: ServeConfig,
    k: int,
    per_call: int = PER_CALL,
) -> np.ndarray:
    """The top-k item ids [U, k] the service answers to each request (-1 pads a list shorter than k);
    `per_call` requests' candidate blocks are scored in one model call (as the dynamic batcher would): the
    same lists as one a call where the runtime is batch-invariant (reco.runtime.batch_invariant); where it
    is not, per_call=1 is what its unbatched server answers."""
    inputs = RequestInputs(store, data, reqs)
    out = np.full((len(reqs.users), k), -1, dtype=np.int64)
    for a in range(0, len(reqs.users), per_call):
        got = [inputs(i, serve.n_candidates) for i in range(a, min(a + per_call, len(reqs.users)))]
        cands = [items for items, _ in got]
        sizes = [len(items) for items in cands]
        probs = scorer(*(np.concatenate(parts) for parts in zip(*(b for _, b in got), strict=True)), sizes)
        start = 0
        for j, items in enumerate(cands):
            top, _ = top_k("quality", items, probs[start : start + len(items)], k)
            out[a + j, : len(top)] = top
            start += len(items)
    return out


def request_candidates(store: FeatureStore, reqs: QualityRequests, n: int) -> list[np.ndarray]:
    """Each request's candidates [<= n] item ids, as served_topk's service retrieves them (they do not
    depend on the variant)."""
    return [store.candidates(store.user_row(int(u)), n) for u in reqs.users]


def popularity(data: Dataset) -> np.ndarray:
    """Training impressions per item id [item cardinality]: the popularity reference ranker's score."""
    s = data.schema
    assert s.item_key is not None
    col = data.train.ids[:, s.index(s.item_key), 0].numpy()
    return np.bincount(col, minlength=s.sparse[s.index(s.item_key)].cardinality).astype(np.float64)


def reference_topk(cands: list[np.ndarray], scores: list[np.ndarray], k: int) -> np.ndarray:
    """[U, k] the top-k of each request's candidates by `scores` (one array per request, aligned with its
    candidates; -1 pads), ordered as the service orders a model's scores (reco.serve.recommend.top_k)."""
    out = np.full((len(cands), k), -1, dtype=np.int64)
    for u, (items, sc) in enumerate(zip(cands, scores, strict=True)):
        top, _ = top_k("reference", items, sc.astype(np.float32), k)
        out[u, : len(top)] = top
    return out


def _context(data: Dataset, rows: np.ndarray, split: str = "test") -> tuple[np.ndarray, np.ndarray]:
    """The click model's (hour, device) of `split` rows: feature ids are shifted by one (0: unknown)."""
    s, t = data.schema, getattr(data, split)
    return t.ids[rows, s.index("hour"), 0].numpy() - 1, t.ids[rows, s.index("device"), 0].numpy() - 1


def reproduces(model: ClickModel, data: Dataset, tol: float = 1e-5) -> bool:
    """Whether `model` gives the test rows the P(click) logged with them (Split.oracle): the data is the
    one it planted, so its grades of unlogged candidates can be trusted."""
    t, s = data.test, data.schema
    if t.oracle is None or s.user_key is None or s.item_key is None:
        return False
    rows = np.arange(len(t))
    users, items = (t.ids[:, s.index(k), 0].numpy() - 1 for k in (s.user_key, s.item_key))
    got = model.prob(users, items, *_context(data, rows))
    return bool(np.allclose(got, t.oracle.numpy(), rtol=tol, atol=tol))


def planted_gains(
    model: ClickModel, data: Dataset, reqs: QualityRequests, cands: list[np.ndarray]
) -> list[np.ndarray]:
    """True P(click) of each request's candidates (one [M] array per request, aligned with `cands`): the
    request's user, each candidate item and the context (hour, device) of the request's row, through
    the planted click model. Feature ids are shifted by one (0: unknown), the model's are not."""
    hour, device = _context(data, reqs.rows, reqs.split)
    out = []
    for u, h, d, items in zip(reqs.users.tolist(), hour.tolist(), device.tolist(), cands, strict=True):
        m = len(items)
        out.append(model.prob(np.full(m, u - 1), items - 1, np.full(m, h), np.full(m, d)))
    return out


def gains_of(top: np.ndarray, cands: list[np.ndarray], gains: list[np.ndarray]) -> np.ndarray:
    """[U, k] the gain of each served item (0 where -1 pads); a served item outside its request's
    candidates is an error (the service ranks only those)."""
    out = np.zeros(top.shape)
    for u, (row, items, g) in enumerate(zip(top, cands, gains, strict=True)):
        lookup = dict(zip(items.tolist(), g.tolist(), strict=True))
        for r, i in enumerate(row.tolist()):
            if i >= 0:
                if i not in lookup:
                    raise ValueError(f"request {u}: served item {i} is not among its candidates")
                out[u, r] = lookup[i]
    return out
