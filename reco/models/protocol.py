"""The ranking-model protocol: what a model class must provide so every step can use it.

A model is chosen by `_target_` in conf/model/<name>.yaml (`python run.py model=dcn`); the train step
imports that dotted path (importlib, not `hydra.utils.instantiate`, which would import any target
before it is checked) after two checks, both naming `model._target_`:
the path is allow-listed (some conf/model/*.yaml names it: adding the YAML is what allows a class, and a
variant manifest can never name arbitrary code) and the class has every member listed below.

What the class takes
    `Settings`: its conf/model schema, a dataclass extending `ModelSettings` (the YAML's keys, typed).
    `Config`: its resolved architecture, a dataclass extending `ArchConfig` (the schema's tables + the
        settings), JSON-able through `to_dict()` and rebuilt by `Config(**d)`.
    `from_settings(schema, settings)` -> a fresh model (the train step); `cls(cfg)` -> an untrained model
        of that architecture (loading, pruning, distillation). Raise ValueError naming `model.<key>`
        for settings that cannot build a model.

What it returns
    `forward(dense [B, D] f32, kjt(ids, lengths)) -> logits [B]` for training (TorchRec KeyedJaggedTensor);
    `forward_plain(dense [B, D] f32, ids [B, F, L] i64, mask [B, F, L] f32) -> logits [B]` with the same
    weights over padded tensors: what ONNX export, evaluation and serving run (`PlainScorer` adds the
    sigmoid). It must avoid EmbeddingBag and data-dependent control flow so the ONNX graph is loop-free.
    `embed_plain(ids, mask, cols) -> [B, len(cols), d]` (the pooled embeddings of some sparse columns) and
    `head(dense [B, D], emb [B, F, d]) -> logits [B]` split `forward_plain` in two, so `RequestScorer` can
    embed the columns a request's candidates share once per request.

Its embedding tables (embed_quant, prune, export)
    `ebc`: a TorchRec EmbeddingBagCollection with one SUM-pooled table `t_<feature>` per sparse feature, all
    of width `cfg.embedding_dim`; the KJT forward must pool through `self.ebc` (embed_quant swaps in
    TorchRec's quantized collection) and `forward_plain` must Gather from `tables()[feature]` (embed_quant
    rewrites those Gathers to read INT8/INT4 codes). `tables()` -> {feature: weight [num_rows, d]};
    `id_map(feature)` -> the [cardinality] int32 buffer `idmap_<feature>` mapping schema ids to rows when
    the feature is in `cfg.remapped` (pruned rows), else None.

Its dense MLPs (prune)
    `mlps()` -> {attribute name: nn.Sequential of Linear/ReLU}; prune removes hidden neurons of every
    Linear but the last of each MLP (whose width other layers depend on), rebuilding the model from
    `config_with_mlps({name: [out width of each Linear]})`. Anything else (DCN's cross net) is kept as is.

A smaller student of the same family (distill)
    `student_config(tables, remapped, embedding_dim, bottom, top)` -> a Config of the same architecture
    with those shapes (other architecture settings kept from the teacher).

Saving and loading (reco.variant)
    The state dict is saved with torch.save and loaded with torch.load(weights_only=True) after its SHA-256
    check; `variant.json` records `model_config` (cfg.to_dict()) and `model_target` (this class's path),
    resolved on load through the same allow-list, so loading never unpickles code.

`EmbeddingRanker` (reco.models.embedding) implements the embedding side and the MLP hooks; a new
architecture usually subclasses it and writes `head`, `from_settings`, `Config` and `Settings`
(reco.models.dcn is the example).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import asdict, dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
import torch
from omegaconf import MISSING, OmegaConf
from torch import nn

from reco.config import CONF_DIR, ConfigError

if TYPE_CHECKING:
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from reco.data.schema import Schema


@dataclass
class ModelSettings:
    """The keys every conf/model/*.yaml has (its schema extends this with the architecture's own)."""

    _target_: str = MISSING  # the model class, e.g. reco.models.dlrm.DLRM (allow-listed by conf/model/)
    name: str = MISSING
    embedding_dim: int = MISSING  # width of every embedding table
    bottom: list[int] = MISSING  # hidden sizes of the dense-feature MLP
    top: list[int] = MISSING  # hidden sizes of the top MLP; a final Linear(top[-1], 1) is added

    @classmethod
    def schema_for(cls, node: Any, where: str) -> type[ModelSettings]:
        """The schema of the model `node["_target_"]` names (the train step's config type).

        Raises:
            ConfigError naming model._target_ when the class is not allowed or breaks the protocol.
        """
        target = node.get("_target_") if hasattr(node, "get") else None
        if not isinstance(target, str) or not target:
            raise ConfigError(f"{where}: model._target_ is missing (expected the model class's dotted path)")
        try:
            return resolve(target, "model._target_").Settings
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None


@dataclass
class TableSpec:
    feature: str
    num_rows: int  # rows actually stored (after pruning <= the schema's cardinality)
    max_len: int = 1
    cardinality: int = 0  # ids the table accepts; > num_rows when rows were pruned into row 0

    def __post_init__(self) -> None:
        self.cardinality = self.cardinality or self.num_rows


@dataclass
class ArchConfig:
    """The shape every architecture shares (what prune and distill change); subclasses add their own."""

    dense_in: int
    tables: list[TableSpec]
    embedding_dim: int
    bottom: list[int]  # hidden sizes of the dense MLP
    top: list[int]  # hidden sizes; a final Linear(top[-1], 1) is added
    remapped: list[str] = field(default_factory=list)  # features whose ids pass through an id map

    def __post_init__(self) -> None:
        self.tables = [t if isinstance(t, TableSpec) else TableSpec(**t) for t in self.tables]

    def to_dict(self) -> dict:
        return asdict(self)

    def flops_per_candidate(self) -> int:
        """Multiply-adds x 2 for one scored row."""
        raise NotImplementedError


class RankingModel(Protocol):
    """What the steps use of a model (see the module docstring for each member's contract)."""

    Config: ClassVar[type[ArchConfig]]
    Settings: ClassVar[type[ModelSettings]]
    cfg: ArchConfig
    features: list[str]
    ebc: EmbeddingBagCollection

    @classmethod
    def from_settings(cls, schema: Schema, settings: ModelSettings) -> RankingModel: ...
    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor: ...
    def forward_plain(self, dense: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor: ...
    def embed_plain(self, ids: torch.Tensor, mask: torch.Tensor, cols: list[int]) -> torch.Tensor: ...
    def head(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor: ...
    def kjt(self, ids: torch.Tensor, lengths: torch.Tensor) -> KeyedJaggedTensor: ...
    def tables(self) -> dict[str, nn.Parameter]: ...
    def id_map(self, feature: str) -> torch.Tensor | None: ...
    def mlps(self) -> dict[str, nn.Sequential]: ...
    def config_with_mlps(self, widths: dict[str, list[int]]) -> ArchConfig: ...
    def student_config(
        self,
        tables: list[TableSpec],
        remapped: list[str],
        embedding_dim: int,
        bottom: list[int],
        top: list[int],
    ) -> ArchConfig: ...


METHODS = (
    "from_settings",
    "forward",
    "forward_plain",
    "embed_plain",
    "head",
    "kjt",
    "tables",
    "id_map",
    "mlps",
    "config_with_mlps",
    "student_config",
)


def missing_members(cls: type) -> list[str]:
    """What `cls` lacks of the protocol (empty when it follows it)."""
    out = [] if isinstance(cls, type) and issubclass(cls, nn.Module) else ["a torch.nn.Module subclass"]
    out += [f"method {m}()" for m in METHODS if not callable(getattr(cls, m, None))]
    for attr, base in (("Config", ArchConfig), ("Settings", ModelSettings)):
        value = getattr(cls, attr, None)
        if not (isinstance(value, type) and dataclasses.is_dataclass(value) and issubclass(value, base)):
            out.append(f"class attribute {attr} (a dataclass extending reco.models.protocol.{base.__name__})")
    return out


@cache
def allowed_targets() -> dict[str, str]:
    """{class path: conf/model file naming it}: the classes a config or a variant manifest may name."""
    out = {}
    for path in sorted((CONF_DIR / "model").glob("*.yaml")):
        target = OmegaConf.load(path).get("_target_")
        if isinstance(target, str):
            out[target] = f"conf/model/{path.name}"
    return out


def target_of(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def resolve(target: str, where: str, allowed: dict[str, str] | None = None) -> type[RankingModel]:
    """The model class `target` names, after the allow-list and protocol checks.

    Args:
        target: dotted class path (conf/model/*.yaml `_target_`, or a variant's `model_target`).
        where: the setting named in errors (`model._target_`).
        allowed: the allow-list (default: `allowed_targets()`).
    Raises:
        ConfigError naming `where`, the class and what is missing.
    """
    allowed = allowed_targets() if allowed is None else allowed
    if target not in allowed:
        raise ConfigError(
            f"{where}: {target!r} is not an allowed model class; allowed: {sorted(allowed)} (a class is "
            f"allowed by a conf/model/<name>.yaml whose _target_ names it)"
        )
    module, _, name = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{where}: cannot import {target!r} ({allowed[target]}): {e}") from None
    if isinstance(cls, type) and target_of(cls) != target:
        raise ConfigError(
            f"{where}: {target!r} is an alias; name the class where it is defined: {target_of(cls)!r}"
        )
    if missing := missing_members(cls):
        raise ConfigError(
            f"{where}: {target!r} does not follow the ranking-model protocol (reco/models/protocol.py); "
            f"missing: {', '.join(missing)}"
        )
    return cls


class PlainScorer(nn.Module):
    """What gets exported and served: padded tensors in, click probabilities [B] out."""

    def __init__(self, model: RankingModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, dense: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """dense [B, D] f32, ids [B, F, L] i64, mask [B, F, L] f32 -> probabilities [B]."""
        return torch.sigmoid(self.model.forward_plain(dense, ids, mask))


class RequestScorer(nn.Module):
    """PlainScorer for blocks of whole requests: the columns a request's candidates share (user and
    context, `Schema.shared_columns`) are embedded once per request and broadcast to its candidates.

    The same probabilities as PlainScorer on the same rows (a parity test holds them to float rounding),
    for less work: on the default schema 12 of a candidate's 15 table lookups are the user's and the
    context's. What serves (reco.runtime) and what the accelerate step exports as the request graph.
    """

    def __init__(self, model: RankingModel, shared: list[int]) -> None:
        super().__init__()
        self.model = model
        n = len(model.cfg.tables)
        if not shared or min(shared) < 0 or max(shared) >= n:
            raise ValueError(
                f"RequestScorer: shared columns {shared} must be a non-empty subset of 0..{n - 1}"
            )
        self.shared = sorted(shared)
        self.own = [i for i in range(n) if i not in self.shared]
        self.register_buffer("order", torch.argsort(torch.tensor(self.own + self.shared)), persistent=False)

    def forward(
        self,
        dense: torch.Tensor,
        ids: torch.Tensor,
        mask: torch.Tensor,
        first: torch.Tensor,
        owner: torch.Tensor,
    ) -> torch.Tensor:
        """dense [N, D] f32, ids [N, F, L] i64, mask [N, F, L] f32: the rows of U requests, request u's
        rows sharing its shared columns; first [U] i64: a row of each request; owner [N] i64: each row's
        request -> probabilities [N]."""
        shared = self.model.embed_plain(ids[first], mask[first], self.shared)[owner]  # [N, Fs, d]
        parts = [self.model.embed_plain(ids, mask, self.own), shared] if self.own else [shared]
        emb = torch.cat(parts, 1)[:, self.order]
        return torch.sigmoid(self.model.head(dense, emb))


def request_groups(sizes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Rows per request [U] (summing to N) -> (first [U] i64: each request's first row, owner [N] i64)."""
    counts = np.asarray(sizes, dtype=np.int64)
    counts = counts[counts > 0]  # a request without rows owns none and needs no first row
    first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    return first, np.repeat(np.arange(len(counts), dtype=np.int64), counts)


def as_requests(
    batch: tuple[np.ndarray, np.ndarray, np.ndarray], shared: list[int], sizes: list[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows of `batch` as whole requests of `sizes` rows: each request's rows take its first row's
    shared columns (what one request's candidates look like to the model)."""
    dense, ids, mask = (a.copy() for a in batch)
    first, owner = request_groups(sizes)
    ids[:, shared] = ids[first][owner][:, shared]
    mask[:, shared] = mask[first][owner][:, shared]
    return dense, ids, mask


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
