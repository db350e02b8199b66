"""Per-table precision from a sensitivity sweep on the validation split.

Each table is quantized alone (every other table stays fp32) and the model scored on validation rows;
its relative AUC drop is that table's sensitivity at that precision. Evaluation uses the float model
with the table's *dequantized* values swapped in: the same numbers the quantized kernels compute with
(rowwise.py), at the cost of one forward pass per point, with no runtime built.

Choice:
1. every table not fixed by the user gets the fewest-bits candidate whose solo drop <= table_budget
   (the highest candidate if none qualifies);
2. the mix is scored; while its drop exceeds `budget`, the table with the largest solo drop at its
   current precision moves up one candidate, and the mix is scored again.
Drops are paired (same rows, same model), so they are deterministic, but a drop of 1e-4 on a few
thousand validation rows says little about the test split: the pipeline measures test AUC afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from reco.data.schema import Split
from reco.measure import evaluate
from reco.models.protocol import RankingModel
from reco.runtime.rowwise import Precision, QTable, quantize_table
from reco.steps.accelerate.export import torch_probs


@dataclass
class Point:
    """One scored configuration: the precisions that differ from fp32 and the validation AUC."""

    precisions: dict[str, str]
    val_auc: float
    rel_drop: float  # (parent AUC - this AUC) / parent AUC; negative when quantization helped


@dataclass
class Choice:
    precision: dict[str, Precision]  # feature -> chosen precision
    parent_auc: float
    solo: dict[str, dict[str, Point]]  # feature -> precision name -> the table alone at it
    mix: list[Point] = field(default_factory=list)  # the mixes scored, last = chosen

    @property
    def mix_drop(self) -> float:
        return self.mix[-1].rel_drop


class Sweep:
    """Scores `model` on `split` with chosen tables swapped for their quantized values (cached)."""

    def __init__(self, model: RankingModel, split: Split) -> None:
        self.model, self.split = model, split
        self._q: dict[tuple[str, Precision], QTable] = {}
        self.parent_auc = self._auc({})

    def table(self, feature: str, p: Precision) -> QTable:
        key = (feature, p)
        if key not in self._q:
            self._q[key] = quantize_table(self.model.tables()[feature], p)
        return self._q[key]

    def score(self, precisions: dict[str, Precision]) -> Point:
        auc = self._auc({f: p for f, p in precisions.items() if p is not Precision.fp32})
        named = {f: p.value for f, p in precisions.items()}
        return Point(named, auc, (self.parent_auc - auc) / self.parent_auc)

    def _auc(self, precisions: dict[str, Precision]) -> float:
        values = {f: self.table(f, p).dequantize() for f, p in precisions.items()}
        with swapped(self.model, values):
            return evaluate(lambda *batch: torch_probs(self.model, batch), self.split)["auc"]


@contextlib.contextmanager
def swapped(model: RankingModel, values: dict[str, torch.Tensor]) -> Iterator[RankingModel]:
    """`model` with the float tables of `values` (feature -> float32 [N, d]) replaced, restored after."""
    tables = model.tables()
    saved = {f: tables[f].data.clone() for f in values}
    try:
        with torch.no_grad():
            for f, v in values.items():
                tables[f].copy_(v)
        yield model
    finally:
        with torch.no_grad():
            for f, v in saved.items():
                tables[f].copy_(v)


def choose(
    sweep: Sweep,
    candidates: list[Precision],
    fixed: dict[str, Precision],
    table_budget: float,
    budget: float,
) -> Choice:
    """The per-table precisions (see the module docstring). `candidates` may be in any order.

    Returns:
        The choice; `mix[-1]` is the mix it ends with, whose drop may still exceed `budget` when every
        free table already sits at the highest candidate (the caller decides what that means).
    """
    order = sorted(candidates, key=lambda p: p.bits)
    features = sweep.model.features
    solo: dict[str, dict[str, Point]] = {f: {} for f in features}

    def solo_drop(f: str, p: Precision) -> float:
        if p.value not in solo[f]:
            solo[f][p.value] = (
                sweep.score({f: p}) if p is not Precision.fp32 else Point({}, sweep.parent_auc, 0.0)
            )
        return solo[f][p.value].rel_drop

    precision: dict[str, Precision] = {}
    for f in features:
        solo_drop(f, order[0])  # every table's sensitivity at the lowest candidate, for the report
        if f in fixed:
            precision[f] = fixed[f]
            solo_drop(f, fixed[f])
            continue
        precision[f] = next((p for p in order if solo_drop(f, p) <= table_budget), order[-1])
    choice = Choice(precision, sweep.parent_auc, solo)
    choice.mix.append(sweep.score(precision))
    while choice.mix_drop > budget:
        free = [f for f in features if f not in fixed and precision[f] is not order[-1]]
        if not free:
            break
        worst = max(free, key=lambda f: solo_drop(f, precision[f]))
        precision[worst] = order[order.index(precision[worst]) + 1]
        solo_drop(worst, precision[worst])  # the report gives every table's drop at the precision it got
        choice.mix.append(sweep.score(precision))
    return choice


def limit_rows(split: Split, rows: int | None) -> Split:
    return split if rows is None or rows >= len(split) else split.take(slice(0, rows))
