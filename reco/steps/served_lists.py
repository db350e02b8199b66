"""Distillation on what is served: training users' candidate lists and list-aware losses.

A pointwise student is asked to match the teacher on logged impressions only, while the service asks it to
order a user's candidates (popular items of the user's categories, then global popularity), most of which
were never logged for that user. Here `list_users` training users (with a positive in the train split,
each with the context of its first positive row) get the service's own candidates (reco.serve.quality's
RequestInputs: the retrieval and feature assembly /recommend runs); `list_size` of them per user, drawn
once at random, are scored by the teacher once and reused every epoch. Each training batch then also
carries `lists_per_batch` of these lists, and the student learns, weighted `list_weight`:

- listwise KD: T^2 * cross-entropy between softmax(t / T) and softmax(s / T) over each list (T =
  `list_temperature`), the teacher's ranking distribution over the request's candidates;
- margin-MSE (Hofstaetter et al. 2020): mean over the ordered pairs (i, j) of one list of
  ((s_i - s_j) - (t_i - t_j))^2 = 2 x the list's variance of (s - t): all pairs at the cost of one pass,
  and blind to a per-list offset (which no ordering depends on).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch

from reco.data.schema import Dataset
from reco.models.protocol import RankingModel
from reco.serve.config import RetrievalConfig
from reco.serve.features import FeatureStore, ServeConfigError
from reco.serve.quality import RequestInputs, quality_requests


class ListLoss(Enum):
    """The list-aware term of the distillation loss (module docstring)."""

    none = "none"
    listwise = "listwise"
    margin_mse = "margin_mse"


class ListError(ValueError):
    """Served lists cannot be built as configured (the message names the distill.<key>)."""


class Unservable(ListError):
    """The data has nothing the service can serve (no user/item key, no user with a positive): there are
    no lists to distil, whatever distill.* says."""


@dataclass
class ListSettings:
    """The distill.list_* keys (conf/step/distill.yaml) that shape the lists."""

    users: int  # training users with a list
    size: int  # candidates per list
    n_candidates: int  # the candidate pool the lists are drawn from (distill.n_candidates)
    retrieval: RetrievalConfig  # serve.retrieval


def listwise_kd(s: torch.Tensor, t: torch.Tensor, temperature: float) -> torch.Tensor:
    """s, t: [G, M] student and teacher logits of G lists -> scalar T^2 x mean cross-entropy."""
    p = torch.softmax(t / temperature, dim=1)
    return -(temperature**2) * (p * torch.log_softmax(s / temperature, dim=1)).sum(dim=1).mean()


def margin_mse(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """s, t: [G, M] -> scalar mean over lists and ordered pairs of ((s_i - s_j) - (t_i - t_j))^2."""
    d = s - t
    return 2 * d.var(dim=1, unbiased=False).mean()


def list_term(kind: ListLoss, s: torch.Tensor, t: torch.Tensor, temperature: float) -> torch.Tensor:
    if kind is ListLoss.listwise:
        return listwise_kd(s, t, temperature)
    assert kind is ListLoss.margin_mse
    return margin_mse(s, t)


class ServedLists:
    """`users` training requests with `size` of their served candidates each, and the teacher's logits on
    them ([U, size], computed once)."""

    def __init__(self, teacher: RankingModel, data: Dataset, ls: ListSettings, seed: int) -> None:
        try:
            store = FeatureStore(data, ls.retrieval)
        except ServeConfigError as e:
            raise Unservable(
                f"the service cannot retrieve candidates on this data (serve.retrieval): {e}"
            ) from e
        reqs = quality_requests(data, ls.users, seed, split="train")
        if not len(reqs.users):
            raise Unservable(f"no training user with a positive row and a user id (dataset {data.name!r})")
        self.inputs = RequestInputs(store, data, reqs)
        rng = np.random.default_rng(seed)
        self.items = np.empty((len(reqs.users), ls.size), dtype=np.int64)
        for i in range(len(reqs.users)):
            cands = self.inputs.candidates(i, ls.n_candidates)
            if len(cands) < ls.size:
                raise ListError(
                    f"distill.list_size={ls.size} is larger than the {len(cands)} candidates the service "
                    f"retrieves for training user {int(reqs.users[i])} (distill.n_candidates="
                    f"{ls.n_candidates}, retrieval {store.retrieval_name}); lower distill.list_size"
                )
            self.items[i] = rng.choice(cands, ls.size, replace=False)
        self.teacher = torch.empty(self.items.shape)
        with torch.no_grad():
            for a in range(0, len(self.items), 64):
                b = min(a + 64, len(self.items))
                dense, ids, mask = self.batch(np.arange(a, b))
                self.teacher[a:b] = teacher.forward_plain(dense, ids, mask).reshape(b - a, -1)
        self.gen = torch.Generator().manual_seed(seed)
        self.order, self.next = torch.randperm(len(self.items), generator=self.gen), 0

    def __len__(self) -> int:
        return len(self.items)

    def batch(self, which: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The model input of lists `which` [G], list-major: dense [G*M, D], ids [G*M, F, L], mask."""
        parts = [self.inputs(int(i), 0, self.items[i])[1] for i in which]
        return tuple(torch.from_numpy(np.concatenate(p)) for p in zip(*parts, strict=True))  # type: ignore[return-value]

    def draw(self, g: int) -> np.ndarray:
        """The next g lists of a shuffled pass over all of them (reshuffled when a pass ends)."""
        out = []
        while len(out) < g:
            if self.next == len(self.order):
                self.order, self.next = torch.randperm(len(self.items), generator=self.gen), 0
            take = min(g - len(out), len(self.order) - self.next)
            out += self.order[self.next : self.next + take].tolist()
            self.next += take
        return np.array(out)

    def loss(self, student: RankingModel, kind: ListLoss, g: int, temperature: float) -> torch.Tensor:
        """The list term on the next g lists (module docstring)."""
        which = self.draw(g)
        dense, ids, mask = self.batch(which)
        lengths = mask.sum(dim=2).long()
        s = student(dense, student.kjt(ids, lengths)).float().reshape(len(which), -1)
        return list_term(kind, s, self.teacher[torch.from_numpy(which)], temperature)


def within_list_order(scores: torch.Tensor, truth: torch.Tensor) -> float:
    """Within-list pairwise accuracy: over G lists ([G, M] each), the share of the pairs (i, j) of one list
    with truth_i > truth_j that `scores` order the same way (ties count as wrong)."""
    ds = scores[:, :, None] - scores[:, None, :]
    dt = truth[:, :, None] - truth[:, None, :]
    pairs = dt > 0
    return float(((ds > 0) & pairs).sum() / pairs.sum())
