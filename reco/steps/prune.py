"""Structured pruning: a physically smaller model, then fine-tuning.

Two levers, because parameters and latency live in different places:
- embedding rows (most of the parameters): rows of ids rarely seen in the train split are dropped and
  their ids mapped to row 0 through the model's id map (`cfg.remapped`, `idmap_<feature>`);
  the table's `num_rows` shrinks, its `cardinality` (ids accepted) stays;
- hidden MLP neurons (most of the FLOPs, hence latency): a fixed fraction of each prunable layer's
  neurons is removed by score and the `nn.Linear`s are rebuilt narrower (and the next layer's input
  columns with them). The MLPs are the model's `mlps()` (reco.models.protocol); the last layer of each
  keeps its width (DLRM's bottom output = embedding_dim for the dot interaction, DCN's feeds the cross
  net, the top's is the logit). Other layers (DCN's cross net) are kept as they are.
`mlp_fraction` sets the latency cut; embedding rows make up the rest of `amount` (rarest first, with
`embeddings.min_count` as a floor), so the parameter target is always met.
Fine-tuning after each round is kept only if it raises validation AUC: on the synthetic default a
second pass over rows the parent already saw lowered test AUC (0.682 -> 0.632, the one-epoch
overfitting of CTR models), while Taylor-scored pruning alone cost < 0.001.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from enum import Enum

import torch
from omegaconf import MISSING
from torch import nn

from reco.data.schema import Dataset, Split
from reco.models.protocol import ArchConfig, RankingModel, TableSpec, count_params
from reco.steps.registry import StepError, StepRun, child_variant, register, require_artifact
from reco.train.loop import TrainConfig, step_budget, train, val_metrics, val_rows
from reco.variant import Variant


class Criterion(Enum):
    """How an MLP neuron is scored (lowest scores are removed)."""

    taylor = "taylor"  # |w * grad| accumulated over train batches (first-order loss change)
    l1 = "l1"  # weight L1 norm, fan-in x fan-out
    l2 = "l2"  # weight L2 norm, fan-in x fan-out


@dataclass
class EmbeddingRule:
    min_count: int = MISSING  # rows of ids seen fewer times in train are always dropped
    min_rows: int = MISSING  # only tables with at least this many rows are pruned


@dataclass
class PruneConfig:
    """conf/step/prune.yaml (override as prune.<key>, or per variant in the variant graph)."""

    amount: float = MISSING  # fraction of parameters to remove, in (0, 1)
    criterion: Criterion = MISSING
    taylor_batches: int = MISSING  # train batches the taylor score accumulates over
    mlp_fraction: float = MISSING  # fraction of hidden neurons removed from every MLP layer, in [0, 1)
    embeddings: EmbeddingRule = field(default_factory=EmbeddingRule)
    iterations: int = MISSING  # prune -> fine-tune rounds
    finetune_epochs: int = MISSING
    finetune_rows: int | None = MISSING  # train rows per fine-tune epoch; None: the whole split

    def check(self, where: str = "") -> None:
        if not 0 < self.amount < 1:
            raise StepError(
                f"prune: prune.amount must be in (0, 1) (fraction of parameters), got {self.amount}"
            )
        if not 0 <= self.mlp_fraction < 1:
            raise StepError(f"prune: prune.mlp_fraction must be in [0, 1), got {self.mlp_fraction}")
        if self.iterations < 1:
            raise StepError(f"prune: prune.iterations must be >= 1, got {self.iterations}")
        if self.embeddings.min_count < 0:
            raise StepError(
                f"prune: prune.embeddings.min_count must be >= 0, got {self.embeddings.min_count}"
            )


@register("prune", PruneConfig, trains=True)
def run(parent: Variant | None, data: Dataset, pc: PruneConfig, ctx: StepRun) -> Variant:
    """Structured pruning of the parent's MLP neurons and rare embedding rows, then fine-tuning.

    Returns:
        A physically smaller torch variant (params_removed_pct, flops_removed_pct, ... in its metrics).
    """
    assert parent is not None
    pc.check()
    trainer, name = ctx.trainer, ctx.name
    require_artifact(parent, "torch", "prune")
    model = parent.load_torch()
    p0, f0 = count_params(model), model.cfg.flops_per_candidate()
    ft = step_budget(trainer, epochs=pc.finetune_epochs, max_rows_per_epoch=pc.finetune_rows)
    keep_frac = (1 - pc.mlp_fraction) ** (1 / pc.iterations)  # equal multiplicative share per round
    rows_removed, kept, val = 0, 0, {}
    for r in range(1, pc.iterations + 1):
        target = math.floor(p0 * (1 - pc.amount * r / pc.iterations))  # params allowed after round r
        model = prune_mlps(model, pc.criterion.value, 1 - keep_frac, data.train, ft, pc.taylor_batches)
        model, n = prune_embeddings(model, data.train, target, pc.embeddings)
        rows_removed += n
        if pc.finetune_epochs > 0:
            # Another seed than the parent's run: a partially trained parent saw the first rows of the
            # trainer.seed permutation, and a second pass over seen rows overfits CTR models.
            ft_r = dataclasses.replace(ft, seed=trainer.seed + r)
            val = finetune(model, data, ft_r, f"prune[{name}] round {r}/{pc.iterations}")
            kept += int(val["kept"])
    p1, f1 = count_params(model), model.cfg.flops_per_candidate()
    if p1 > p0 * (1 - pc.amount):  # invariant of prune_embeddings' budget
        raise StepError(f"prune: could not remove prune.amount={pc.amount} of {p0} params (left {p1})")

    v = child_variant(parent, data, pc, ctx, "prune", "torch")
    v.save_torch(model)
    v.metrics.update(
        params_before=float(p0),
        params_removed_pct=100.0 * (p0 - p1) / p0,
        flops_removed_pct=100.0 * (f0 - f1) / f0,
        emb_rows_removed=float(rows_removed),
        mlp_neurons_removed=float(hidden_width(parent.model_cfg()) - hidden_width(model.cfg)),
        finetune_rounds_kept=float(kept),
        **{k: float(x) for k, x in val.items() if k != "kept"},
    )
    v.save()
    return v


def finetune(model: RankingModel, data: Dataset, ft: TrainConfig, desc: str) -> dict[str, float]:
    """Train in place; keep the result only if validation AUC (measured as train() does) improved.

    Returns {pruned_val_auc, finetune_val_auc, kept}.
    """
    before = val_metrics(model, val_rows(ft, data))["auc"]
    state = copy.deepcopy(model.state_dict())
    after = train(model, data, ft, desc=desc).best_val_auc
    if after <= before:
        model.load_state_dict(state)
    return {"pruned_val_auc": before, "finetune_val_auc": after, "kept": after > before}


def hidden_width(cfg: ArchConfig) -> int:
    return sum(cfg.bottom) + sum(cfg.top)


# MLP neurons --------------------------------------------------------------------------------------
def linears(seq: nn.Sequential) -> list[nn.Linear]:
    return [m for m in seq if isinstance(m, nn.Linear)]


def neuron_scores(
    model: RankingModel, criterion: str, train_split: Split, trainer: TrainConfig, batches: int
) -> dict[tuple[str, int], torch.Tensor]:
    """Score of every output neuron of every Linear: {(mlp, layer index): [out_features]}.

    l1/l2: norm of the neuron's incoming weights (row + bias) times the norm of its outgoing column
    in the next layer -- a neuron with large inputs but ~zero outgoing weights contributes nothing.
    taylor: sum over its incoming weights of |w * dL/dw|, accumulated over `batches` train batches
    (first-order estimate of the loss change when the neuron is removed, Molchanov et al. 2017).
    """
    layers = {(k, i): lin for k, seq in model.mlps().items() for i, lin in enumerate(linears(seq))}
    if criterion in ("l1", "l2"):
        p = 1 if criterion == "l1" else 2
        out = {}
        for (k, i), lin in layers.items():
            s = torch.cat([lin.weight, lin.bias[:, None]], 1).detach().norm(p=p, dim=1)
            nxt = layers.get((k, i + 1))
            out[(k, i)] = s * nxt.weight.detach().norm(p=p, dim=0) if nxt is not None else s
        return out
    acc = {key: torch.zeros(lin.out_features) for key, lin in layers.items()}
    gen = torch.Generator().manual_seed(trainer.seed)
    perm = torch.randperm(len(train_split), generator=gen)
    model.eval()
    emb = list(model.ebc.parameters())
    for p in emb:  # only MLP gradients are needed; dense table gradients would cost a table-sized copy
        p.requires_grad_(False)
    for b in range(batches):
        part = train_split.take(perm[b * trainer.batch_size : (b + 1) * trainer.batch_size])
        if len(part) == 0:
            break
        model.zero_grad(set_to_none=True)
        logits = model(part.dense, model.kjt(part.ids, part.lengths))
        nn.functional.binary_cross_entropy_with_logits(logits, part.labels).backward()
        for key, lin in layers.items():
            acc[key] += (lin.weight * lin.weight.grad).abs().sum(1).detach()
            acc[key] += (lin.bias * lin.bias.grad).abs().detach()
    model.zero_grad(set_to_none=True)
    for p in emb:
        p.requires_grad_(True)
    return acc


def prune_mlps(
    model: RankingModel,
    criterion: str,
    fraction: float,
    train_split: Split,
    trainer: TrainConfig,
    batches: int,
) -> RankingModel:
    """Remove `fraction` of the hidden neurons of every prunable layer; returns a new, narrower model."""
    if fraction <= 0:
        return model
    scores = neuron_scores(model, criterion, train_split, trainer, batches)
    mlps = model.mlps()
    keep: dict[tuple[str, int], torch.Tensor] = {}
    for k, seq in mlps.items():
        n_lin = len(linears(seq))
        for i in range(n_lin - 1):  # the last Linear of each MLP keeps its width
            s = scores[(k, i)]
            n_keep = max(1, round(s.numel() * (1 - fraction)))
            keep[(k, i)] = torch.topk(s, n_keep).indices.sort().values
    state = model.state_dict()
    sizes = {}
    for k, seq in mlps.items():
        lin_pos = [j for j, m in enumerate(seq) if isinstance(m, nn.Linear)]
        for i, j in enumerate(lin_pos):
            w, b = state[f"{k}.{j}.weight"], state[f"{k}.{j}.bias"]
            if (rows := keep.get((k, i))) is not None:
                w, b = w[rows], b[rows]
            if (cols := keep.get((k, i - 1))) is not None:
                w = w[:, cols]
            state[f"{k}.{j}.weight"], state[f"{k}.{j}.bias"] = w.clone(), b.clone()
        sizes[k] = [int(state[f"{k}.{j}.weight"].shape[0]) for j in lin_pos]
    return rebuild(model, model.config_with_mlps(sizes), state)


def rebuild(model: RankingModel, cfg: ArchConfig, state: dict[str, torch.Tensor]) -> RankingModel:
    """A new model of `model`'s class with architecture `cfg` holding `state`."""
    new = type(model)(cfg)
    new.load_state_dict(state, strict=True)
    return new.eval()


# Embedding rows ---------------------------------------------------------------------------------
def id_map(model: RankingModel, feature: str) -> torch.Tensor:
    """[cardinality] int64: schema id -> row of this model's table (identity if not remapped)."""
    m = model.id_map(feature)
    if m is not None:
        return m.long()
    spec = next(t for t in model.cfg.tables if t.feature == feature)
    return torch.arange(spec.cardinality)


def row_counts(split: Split, feature_idx: int, idmap: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[num_rows] int64: how often each table row is looked up by the rows of `split`."""
    ids = split.ids[:, feature_idx, :]
    real = torch.arange(ids.shape[1])[None, :] < split.lengths[:, feature_idx, None]
    return torch.bincount(idmap[ids[real]], minlength=num_rows)


def rows_to_drop(
    counts: dict[str, torch.Tensor], dim: int, min_count: int, params_to_remove: int
) -> dict[str, torch.Tensor]:
    """Per table, a [num_rows] bool mask of rows to drop: every row seen < min_count times, then the
    rarest remaining rows across all tables until `params_to_remove` parameters are gone.

    Row 0 (unknown / pruned ids) is never dropped. Ties are broken by table order, then row.
    """
    feats = list(counts)
    all_counts = torch.cat([counts[f] for f in feats])
    owner = torch.cat([torch.full((counts[f].numel(),), i) for i, f in enumerate(feats)])
    row = torch.cat([torch.arange(counts[f].numel()) for f in feats])
    cand = row > 0
    order = torch.argsort(all_counts[cand], stable=True)
    c_sorted = all_counts[cand][order]
    n_floor = int((c_sorted < min_count).sum())
    n_budget = max(0, math.ceil(params_to_remove / dim))
    n = min(max(n_floor, n_budget), c_sorted.numel())
    drop_flat = torch.zeros_like(cand)
    drop_flat[torch.nonzero(cand).squeeze(1)[order[:n]]] = True
    return {f: drop_flat[owner == i] for i, f in enumerate(feats)}


def prunable_tables(model: RankingModel, min_rows: int) -> list[TableSpec]:
    return [t for t in model.cfg.tables if t.num_rows >= min_rows]


def prune_embeddings(
    model: RankingModel, train_split: Split, target_params: int, rule: EmbeddingRule
) -> tuple[RankingModel, int]:
    """Drop rare rows so that count_params <= target_params (and all rows below rule.min_count).

    Dropped ids map to row 0, re-initialised as the count-weighted mean of the rows it absorbs (a
    trained "rare id" vector rather than the untrained unknown-id row). Returns (new model, rows dropped).
    """
    tables = prunable_tables(model, rule.min_rows)
    if not tables:
        return model, 0
    weights = model.tables()
    maps = {t.feature: id_map(model, t.feature) for t in tables}
    counts = {
        t.feature: row_counts(train_split, model.features.index(t.feature), maps[t.feature], t.num_rows)
        for t in tables
    }
    excess = count_params(model) - target_params
    drop = rows_to_drop(counts, model.cfg.embedding_dim, rule.min_count, excess)
    if sum(int(m.sum()) for m in drop.values()) * model.cfg.embedding_dim < excess:
        raise StepError(
            f"prune: prune.amount too large: even dropping every row of tables "
            f"{[t.feature for t in tables]} leaves {count_params(model)} - target {target_params} > 0 params"
        )
    state = model.state_dict()
    new_tables, remapped, n_dropped = [], list(model.cfg.remapped), 0
    for t in model.cfg.tables:
        if t.feature not in drop or not drop[t.feature].any():
            new_tables.append(t)
            continue
        d, c, w = drop[t.feature], counts[t.feature].double(), weights[t.feature].detach()
        keep = (~d).nonzero().squeeze(1)  # includes row 0
        new_row = torch.zeros(t.num_rows, dtype=torch.long)  # dropped rows -> 0
        new_row[keep] = torch.arange(keep.numel())
        w_new = w[keep].clone()
        absorbed = d.clone()
        absorbed[0] = True
        if c[absorbed].sum() > 0:
            w_new[0] = (c[absorbed, None] * w[absorbed].double()).sum(0).float() / c[absorbed].sum().float()
        state[f"ebc.embedding_bags.t_{t.feature}.weight"] = w_new
        state[f"idmap_{t.feature}"] = new_row[maps[t.feature]].to(torch.int32)
        new_tables.append(TableSpec(t.feature, int(keep.numel()), t.max_len, t.cardinality))
        if t.feature not in remapped:
            remapped.append(t.feature)
        n_dropped += int(d.sum())
    cfg = dataclasses.replace(model.cfg, tables=new_tables, remapped=remapped)
    return rebuild(model, cfg, state), n_dropped
