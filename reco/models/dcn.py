"""DCN-v2 ranker: TorchRec tables + bottom MLP + a low-rank cross network + top MLP (stacked DCN-v2).

The layer arithmetic is TorchRec's `torchrec.models.dlrm.DLRM_DCN` (a test checks equal outputs with
copied weights): the bottom MLP's output and the F pooled embeddings are concatenated into
x0 [B, bottom[-1] + F*d]; `torchrec.modules.crossnet.LowRankCrossNet` computes
x_{l+1} = x0 * (W_l (V_l x_l) + b_l) + x_l for `cross_layers` layers of rank `low_rank`; the top MLP maps
the result to one logit. Unlike DLRM's dot interaction, `bottom[-1]` may differ from `embedding_dim`.

Steps: prune narrows the bottom and top MLPs (and the tables' rows) and keeps the cross net as it is --
its width is the concatenated input's, so narrowing it would mean dropping embedding dimensions;
distill's student keeps the teacher's `cross_layers` and its rank-to-width ratio (`low_rank` scaled to the
student's cross width), and takes its tables and MLP sizes from `distill.student`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from omegaconf import MISSING

from reco.data.schema import Schema
from reco.models.embedding import EmbeddingRanker, mlp, mlp_flops
from reco.models.protocol import ArchConfig, ModelSettings, TableSpec


@dataclass
class DCNSettings(ModelSettings):
    """The `model` config group for DCN-v2 (conf/model/dcn.yaml)."""

    cross_layers: int = MISSING  # layers of the low-rank cross network
    low_rank: int = MISSING  # rank r of each layer's W (N x r) V (r x N) factorisation

    def check(self, where: str = "") -> None:
        if self.cross_layers < 1:
            raise ValueError(f"model.cross_layers must be >= 1, got {self.cross_layers}")
        if self.low_rank < 1:
            raise ValueError(f"model.low_rank must be >= 1, got {self.low_rank}")
        if not self.bottom:
            raise ValueError("model.bottom: the dense MLP needs at least one layer, got []")


@dataclass
class DCNConfig(ArchConfig):
    cross_layers: int = field(default=0, kw_only=True)  # 0 only as a dataclass placeholder: checked below
    low_rank: int = field(default=0, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.cross_layers < 1 or self.low_rank < 1:
            raise ValueError(
                f"model.cross_layers ({self.cross_layers}) and model.low_rank ({self.low_rank}) must be >= 1"
            )
        if not self.bottom:
            raise ValueError("model.bottom: the dense MLP needs at least one layer, got []")

    @property
    def cross_in(self) -> int:
        """Width of the cross network: the bottom MLP's output + every pooled embedding."""
        return self.bottom[-1] + len(self.tables) * self.embedding_dim

    def flops_per_candidate(self) -> int:
        """Multiply-adds x 2 for one scored row: MLPs, the cross layers' V and W products, the pooling adds."""
        n = self.cross_in
        pooling = sum(t.max_len * self.embedding_dim for t in self.tables)
        cross = self.cross_layers * (2 * 2 * n * self.low_rank + 2 * n)
        return mlp_flops([self.dense_in, *self.bottom]) + cross + mlp_flops([n, *self.top, 1]) + pooling


class DCN(EmbeddingRanker):
    Config = DCNConfig
    Settings = DCNSettings

    def __init__(self, cfg: DCNConfig) -> None:
        from torchrec.modules.crossnet import LowRankCrossNet  # here: see reco.config._schemas

        super().__init__(cfg)
        self.bottom = mlp([cfg.dense_in, *cfg.bottom])
        self.cross = LowRankCrossNet(
            in_features=cfg.cross_in, num_layers=cfg.cross_layers, low_rank=cfg.low_rank
        )
        self.top = mlp([cfg.cross_in, *cfg.top, 1], last_relu=False)

    @classmethod
    def from_settings(cls, schema: Schema, settings: ModelSettings) -> DCN:
        assert isinstance(settings, DCNSettings)
        tables = [TableSpec(f.name, f.cardinality, f.max_len) for f in schema.sparse]
        cfg = DCNConfig(
            len(schema.dense),
            tables,
            settings.embedding_dim,
            list(settings.bottom),
            list(settings.top),
            cross_layers=settings.cross_layers,
            low_rank=settings.low_rank,
        )
        return cls(cfg)

    def student_config(
        self,
        tables: list[TableSpec],
        remapped: list[str],
        embedding_dim: int,
        bottom: list[int],
        top: list[int],
    ) -> DCNConfig:
        """The teacher's cross_layers, and its rank-to-width ratio: low_rank scaled by the student's cross
        width / the teacher's (128 of 576 -> 32 of 144 with the default shapes, TorchRec's ~N/4). Keeping
        the teacher's rank left the default DCN student just short of the 6x size target
        (experiments/dcn_case_study/README.md#the-dcn-student-check)."""
        cfg = super().student_config(tables, remapped, embedding_dim, bottom, top)
        assert isinstance(cfg, DCNConfig)
        scaled = round(self.cfg.low_rank * cfg.cross_in / self.cfg.cross_in)
        cfg.low_rank = max(1, min(scaled, cfg.cross_in))
        return cfg

    def head(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """dense [B, D], emb [B, F, d] -> logits [B]: x0 [B, N] -> cross net [B, N] -> top MLP."""
        x0 = torch.cat([self.bottom(dense), emb.flatten(1)], 1)
        return self.top(self.cross(x0)).squeeze(1)
