"""DLRM ranker: TorchRec EmbeddingBagCollection + bottom MLP + dot interaction + top MLP.

The layer arithmetic is TorchRec's `torchrec.models.dlrm.DLRM` (a test checks equal outputs with
copied weights); the MLPs are plain `nn.Sequential`s so pruning can rebuild them narrower, and there
is a second forward over plain padded tensors (`forward_plain`) with the same weights, because a
`KeyedJaggedTensor` cannot be exported to ONNX (TorchRec issue 1550). `forward_plain` looks
embeddings up with Gather + masked sum -- no `nn.EmbeddingBag`, which ONNX turns into slow `Loop`s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from omegaconf import MISSING
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from reco.data.schema import Schema, to_kjt


@dataclass
class ModelConfig:
    """The `model` config group (conf/model/dlrm.yaml): the architecture the train step builds.

    The tables come from the dataset's schema; `bottom[-1]` must equal `embedding_dim` (the dot
    interaction), which the YAML derives by interpolation so overriding `model.embedding_dim` alone works.
    """

    name: str = MISSING
    embedding_dim: int = MISSING
    bottom: list[int] = MISSING  # hidden sizes of the dense-feature MLP
    top: list[int] = MISSING  # hidden sizes of the top MLP; a final Linear(top[-1], 1) is added

    def validate(self) -> None:
        if not self.bottom or self.bottom[-1] != self.embedding_dim:
            raise ValueError(
                f"model.bottom: the last layer must equal model.embedding_dim ({self.embedding_dim}) "
                f"for the dot interaction, got {self.bottom}"
            )


@dataclass
class TableSpec:
    feature: str
    num_rows: int  # rows actually stored (after pruning <= the schema's cardinality)
    max_len: int = 1
    cardinality: int = 0  # ids the table accepts; > num_rows when rows were pruned into row 0

    def __post_init__(self) -> None:
        self.cardinality = self.cardinality or self.num_rows


@dataclass
class DLRMConfig:
    dense_in: int
    tables: list[TableSpec]
    embedding_dim: int
    bottom: list[int]  # hidden sizes; the last must equal embedding_dim
    top: list[int]  # hidden sizes; a final Linear(top[-1], 1) is added
    remapped: list[str] = field(default_factory=list)  # features whose ids pass through an id map

    def __post_init__(self) -> None:
        self.tables = [t if isinstance(t, TableSpec) else TableSpec(**t) for t in self.tables]
        if self.bottom[-1] != self.embedding_dim:
            raise ValueError(
                f"model.bottom: last layer must equal model.embedding_dim ({self.embedding_dim}) "
                f"for the dot interaction, got {self.bottom}"
            )

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_schema(schema: Schema, embedding_dim: int, bottom: list[int], top: list[int]) -> DLRMConfig:
        tables = [TableSpec(f.name, f.cardinality, f.max_len) for f in schema.sparse]
        return DLRMConfig(len(schema.dense), tables, embedding_dim, list(bottom), list(top))


def mlp(sizes: list[int], last_relu: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    def __init__(self, cfg: DLRMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.features = [t.feature for t in cfg.tables]
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name=f"t_{t.feature}",
                    embedding_dim=cfg.embedding_dim,
                    num_embeddings=t.num_rows,
                    feature_names=[t.feature],
                    pooling=PoolingType.SUM,
                )
                for t in cfg.tables
            ],
            device=torch.device("cpu"),
        )
        self.bottom = mlp([cfg.dense_in, *cfg.bottom])
        n = len(cfg.tables) + 1
        rows, cols = torch.triu_indices(n, n, offset=1)
        self.register_buffer("triu", rows * n + cols, persistent=False)
        self.top = mlp([cfg.embedding_dim + n * (n - 1) // 2, *cfg.top, 1], last_relu=False)
        # Pruned tables: old id -> new row (rare ids -> row 0). Stored int32 to halve their size.
        for t in cfg.tables:
            if t.feature in cfg.remapped:
                self.register_buffer(f"idmap_{t.feature}", torch.zeros(t.cardinality, dtype=torch.int32))

    def id_map(self, feature: str) -> torch.Tensor | None:
        return getattr(self, f"idmap_{feature}", None)

    def tables(self) -> dict[str, nn.Parameter]:
        return {f: self.ebc.embedding_bags[f"t_{f}"].weight for f in self.features}

    def map_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, F, L] int64 in schema space -> row indices into this model's tables."""
        if not self.cfg.remapped:
            return ids
        cols = [
            m[ids[:, i, :]].long() if (m := self.id_map(f)) is not None else ids[:, i, :]
            for i, f in enumerate(self.features)
        ]
        return torch.stack(cols, 1)

    def kjt(self, ids: torch.Tensor, lengths: torch.Tensor) -> KeyedJaggedTensor:
        return to_kjt(self.map_ids(ids), lengths, self.features)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """dense [B, D], sparse KJT (ids already mapped, see `kjt`) -> logits [B]."""
        pooled = self.ebc(sparse).to_dict()
        emb = torch.stack([pooled[f] for f in self.features], 1)  # [B, F, d]
        return self._interact(self.bottom(dense), emb)

    def forward_plain(self, dense: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Export-friendly forward. dense [B, D] f32, ids [B, F, L] i64, mask [B, F, L] f32 -> logits [B]."""
        x = self.bottom(dense)
        embs = []
        for i, t in enumerate(self.cfg.tables):
            idx = ids[:, i, : t.max_len]
            if (m := self.id_map(t.feature)) is not None:
                idx = m[idx].long()
            e = nn.functional.embedding(idx, self.ebc.embedding_bags[f"t_{t.feature}"].weight)  # [B, l, d]
            embs.append((e * mask[:, i, : t.max_len, None]).sum(1))
        return self._interact(x, torch.stack(embs, 1))

    def _interact(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """x [B, d], emb [B, F, d] -> logits [B] (TorchRec's InteractionArch + OverArch)."""
        comb = torch.cat([x[:, None, :], emb], 1)  # [B, F+1, d]
        z = torch.bmm(comb, comb.transpose(1, 2)).flatten(1)[:, self.triu]
        return self.top(torch.cat([x, z], 1)).squeeze(1)


class PlainScorer(nn.Module):
    """What gets exported and served: padded tensors in, click probabilities [B] out."""

    def __init__(self, model: DLRM) -> None:
        super().__init__()
        self.model = model

    def forward(self, dense: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.model.forward_plain(dense, ids, mask))


def count_params(model: DLRM) -> int:
    return sum(p.numel() for p in model.parameters())


def flops_per_candidate(cfg: DLRMConfig) -> int:
    """Multiply-adds x 2 for one scored row: MLPs, the pairwise dot products, the pooling adds."""
    n = len(cfg.tables) + 1
    d = cfg.embedding_dim

    def mlp_flops(sizes: list[int]) -> int:
        return sum(2 * a * b for a, b in zip(sizes[:-1], sizes[1:], strict=True))

    top_in = d + n * (n - 1) // 2
    pooling = sum(t.max_len * d for t in cfg.tables)
    return mlp_flops([cfg.dense_in, *cfg.bottom]) + 2 * n * n * d + mlp_flops([top_in, *cfg.top, 1]) + pooling
