"""The embedding side every ranker shares: TorchRec tables, id maps, pooling, and the protocol's hooks.

A subclass builds its dense layers after calling `super().__init__(cfg)` (so the random init draws the
tables first, then its layers, in declaration order) and implements `head(dense, emb) -> logits`; both
forwards (KeyedJaggedTensor and plain padded tensors) pool the same tables and call `head`.
`forward_plain` looks embeddings up with Gather + masked sum -- no `nn.EmbeddingBag`, which ONNX turns
into slow `Loop`s (and a `KeyedJaggedTensor` cannot be exported at all, TorchRec issue 1550).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from reco.data.schema import to_kjt
from reco.models.protocol import ArchConfig, ModelSettings, TableSpec

if TYPE_CHECKING:  # torchrec is imported where used: see reco.config._schemas
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def table_configs(cfg: ArchConfig, data_types: dict[str, DataType] | None = None) -> list[EmbeddingBagConfig]:
    """TorchRec's config of every table (sum pooling, one feature each); `data_types`: feature -> DataType
    (the quantized collection's per-table precision), else fp32."""
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType

    return [
        EmbeddingBagConfig(
            name=f"t_{t.feature}",
            embedding_dim=cfg.embedding_dim,
            num_embeddings=t.num_rows,
            feature_names=[t.feature],
            pooling=PoolingType.SUM,
            data_type=data_types[t.feature] if data_types else DataType.FP32,
        )
        for t in cfg.tables
    ]


def mlp(sizes: list[int], last_relu: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def mlp_flops(sizes: list[int]) -> int:
    return sum(2 * a * b for a, b in zip(sizes[:-1], sizes[1:], strict=True))


class EmbeddingRanker(nn.Module):
    """Tables `ebc` (one `t_<feature>` per sparse feature) + id maps; subclasses add `bottom`, `top`, ..."""

    Config: ClassVar[type[ArchConfig]]
    Settings: ClassVar[type[ModelSettings]]

    def __init__(self, cfg: ArchConfig) -> None:
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        super().__init__()
        self.cfg = cfg
        self.features = [t.feature for t in cfg.tables]
        self.ebc = EmbeddingBagCollection(tables=table_configs(cfg), device=torch.device("cpu"))
        # Pruned tables: old id -> new row (rare ids -> row 0). Stored int32 to halve their size.
        for t in cfg.tables:
            if t.feature in cfg.remapped:
                self.register_buffer(f"idmap_{t.feature}", torch.zeros(t.cardinality, dtype=torch.int32))

    def head(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """dense [B, D] raw dense features, emb [B, F, d] pooled embeddings -> logits [B]."""
        raise NotImplementedError

    # Embedding side ---------------------------------------------------------------------------------
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
        return self.head(dense, torch.stack([pooled[f] for f in self.features], 1))

    def embed_plain(self, ids: torch.Tensor, mask: torch.Tensor, cols: list[int]) -> torch.Tensor:
        """Pooled embeddings of the sparse columns `cols`: ids [B, F, L] i64, mask [B, F, L] f32 (all F
        columns, schema order) -> [B, len(cols), d], Gather + masked sum (export-friendly)."""
        embs = []
        for i in cols:
            t = self.cfg.tables[i]
            idx = ids[:, i, : t.max_len]
            if (m := self.id_map(t.feature)) is not None:
                idx = m[idx].long()
            e = nn.functional.embedding(idx, self.ebc.embedding_bags[f"t_{t.feature}"].weight)  # [B, l, d]
            embs.append((e * mask[:, i, : t.max_len, None]).sum(1))
        return torch.stack(embs, 1)

    def forward_plain(self, dense: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Export-friendly forward. dense [B, D] f32, ids [B, F, L] i64, mask [B, F, L] f32 -> logits [B]."""
        return self.head(dense, self.embed_plain(ids, mask, list(range(len(self.cfg.tables)))))

    # Protocol hooks for prune and distill ------------------------------------------------------------
    def mlps(self) -> dict[str, nn.Sequential]:
        return {"bottom": self.bottom, "top": self.top}

    def config_with_mlps(self, widths: dict[str, list[int]]) -> ArchConfig:
        """widths: {mlp: out width of each Linear}; the top MLP's last (the logit) is implied."""
        return dataclasses.replace(self.cfg, bottom=list(widths["bottom"]), top=list(widths["top"][:-1]))

    def student_config(
        self,
        tables: list[TableSpec],
        remapped: list[str],
        embedding_dim: int,
        bottom: list[int],
        top: list[int],
    ) -> ArchConfig:
        return dataclasses.replace(
            self.cfg,
            tables=list(tables),
            remapped=list(remapped),
            embedding_dim=embedding_dim,
            bottom=list(bottom),
            top=list(top),
        )
