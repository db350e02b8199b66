"""DLRM ranker: TorchRec EmbeddingBagCollection + bottom MLP + dot interaction + top MLP.

The layer arithmetic is TorchRec's `torchrec.models.dlrm.DLRM` (a test checks equal outputs with
copied weights); the MLPs are plain `nn.Sequential`s so pruning can rebuild them narrower. The tables,
id maps and the two forwards (KeyedJaggedTensor, plain padded tensors for export) are
reco.models.embedding's; the protocol every model follows is reco.models.protocol's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reco.data.schema import Schema
from reco.models.embedding import EmbeddingRanker, mlp, mlp_flops
from reco.models.protocol import ArchConfig, ModelSettings, PlainScorer, TableSpec, count_params

__all__ = ["DLRM", "DLRMConfig", "ModelConfig", "PlainScorer", "TableSpec", "count_params", "mlp"]


@dataclass
class ModelConfig(ModelSettings):
    """The `model` config group for DLRM (conf/model/dlrm.yaml): the architecture the train step builds.

    The tables come from the dataset's schema; `bottom[-1]` must equal `embedding_dim` (the dot
    interaction), which the YAML derives by interpolation so overriding `model.embedding_dim` alone works.
    """

    def check(self, where: str = "") -> None:
        if not self.bottom or self.bottom[-1] != self.embedding_dim:
            raise ValueError(
                f"model.bottom: the last layer must equal model.embedding_dim ({self.embedding_dim}) "
                f"for the dot interaction, got {self.bottom}"
            )


@dataclass
class DLRMConfig(ArchConfig):
    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bottom[-1] != self.embedding_dim:
            raise ValueError(
                f"model.bottom: last layer must equal model.embedding_dim ({self.embedding_dim}) "
                f"for the dot interaction, got {self.bottom}"
            )

    @staticmethod
    def from_schema(schema: Schema, embedding_dim: int, bottom: list[int], top: list[int]) -> DLRMConfig:
        tables = [TableSpec(f.name, f.cardinality, f.max_len) for f in schema.sparse]
        return DLRMConfig(len(schema.dense), tables, embedding_dim, list(bottom), list(top))

    def flops_per_candidate(self) -> int:
        """Multiply-adds x 2 for one scored row: MLPs, the pairwise dot products, the pooling adds."""
        n = len(self.tables) + 1
        d = self.embedding_dim
        top_in = d + n * (n - 1) // 2
        pooling = sum(t.max_len * d for t in self.tables)
        return (
            mlp_flops([self.dense_in, *self.bottom])
            + 2 * n * n * d
            + mlp_flops([top_in, *self.top, 1])
            + pooling
        )


class DLRM(EmbeddingRanker):
    Config = DLRMConfig
    Settings = ModelConfig

    def __init__(self, cfg: DLRMConfig) -> None:
        super().__init__(cfg)
        self.bottom = mlp([cfg.dense_in, *cfg.bottom])
        n = len(cfg.tables) + 1
        rows, cols = torch.triu_indices(n, n, offset=1)
        self.register_buffer("triu", rows * n + cols, persistent=False)
        self.top = mlp([cfg.embedding_dim + n * (n - 1) // 2, *cfg.top, 1], last_relu=False)

    @classmethod
    def from_settings(cls, schema: Schema, settings: ModelSettings) -> DLRM:
        return cls(DLRMConfig.from_schema(schema, settings.embedding_dim, settings.bottom, settings.top))

    def head(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """dense [B, D], emb [B, F, d] -> logits [B] (TorchRec's DenseArch + InteractionArch + OverArch)."""
        x = self.bottom(dense)
        comb = torch.cat([x[:, None, :], emb], 1)  # [B, F+1, d]
        z = torch.bmm(comb, comb.transpose(1, 2)).flatten(1)[:, self.triu]
        return self.top(torch.cat([x, z], 1)).squeeze(1)


def flops_per_candidate(cfg: ArchConfig) -> int:
    return cfg.flops_per_candidate()
