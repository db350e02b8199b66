"""The torch runtime of an embedding-quantized variant: TorchRec's quantized EmbeddingBagCollection.

On disk (`model_qemb.pt`) the model is a state dict of plain tensors, loaded with
torch.load(weights_only=True) after its SHA-256 is checked, so loading executes no pickled code:
    dense.<key>                the model's non-embedding state (MLPs, id maps, ...), as in model.pt
    emb.<feature>.data         fp32/fp16 [N, d] or uint8 [N, d * bits / 8] packed codes (rowwise.QTable)
    emb.<feature>.scale_bias   float16 [N, 2] for the integer formats
TorchRec's own quantized state dict holds UInt4Tensor subclasses and rows padded to 16 bytes (an INT4 row
of dim 16 takes as many bytes as an INT8 or fp16 one there), so it is neither loadable weights-only
nor a fair size figure. At load the model (the variant's allow-listed class) is rebuilt with a TorchRec quantized EmbeddingBagCollection
(FBGEMM's IntNBitTableBatchedEmbeddingBagsCodegen, CPU kernels) whose tables are these tensors, and
scores through its KeyedJaggedTensor forward (the protocol's `ebc`, reco.models.protocol).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from reco.models.embedding import table_configs
from reco.models.protocol import ArchConfig, RankingModel, TableSpec
from reco.runtime.rowwise import QTable, from_stored
from reco.variant import ArtifactError, Variant

if TYPE_CHECKING:  # torchrec is imported where used: see reco.config._schemas
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection

ROLE = "qtorch"  # the artifact role of the file (Variant.serving_role of backend torchrec_quant)
FILE = "model_qemb.pt"
# FBGEMM's own CPU default; TorchRec passes 16, which pads an INT4 row of dim 64 from 36 to 48 bytes in
# memory (and a dim-16 INT4 row to the size of an fp16 one) without a measured speed benefit on CPU.
ROW_ALIGNMENT = 1


def state_dict(model: RankingModel, tables: dict[str, QTable]) -> dict[str, torch.Tensor]:
    """The file's content (see the module docstring) for `model`'s dense parts and quantized `tables`."""
    out = {f"dense.{k}": v for k, v in model.state_dict().items() if not k.startswith("ebc.")}
    for f, t in tables.items():
        out[f"emb.{f}.data"] = t.data.contiguous()
        if t.scale_bias is not None:
            out[f"emb.{f}.scale_bias"] = t.scale_bias.contiguous()
    return out


def save(path: Path, model: RankingModel, tables: dict[str, QTable]) -> None:
    torch.save(state_dict(model, tables), path)


def quant_ebc(cfg: ArchConfig, tables: dict[str, QTable]) -> QuantEmbeddingBagCollection:
    """TorchRec's quantized EmbeddingBagCollection holding `tables` (feature -> QTable), one per table."""
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection

    configs = table_configs(cfg, {f: q.precision.data_type for f, q in tables.items()})
    weights = {}
    for t in cfg.tables:
        q = tables[t.feature]
        fused = q.fused()
        # The constructor wants (codes, scale/bias bytes) for integer formats, (raw bytes, None) else.
        weights[f"t_{t.feature}"] = (fused[:, :-4], fused[:, -4:]) if q.precision.rowwise else (fused, None)
    return QuantEmbeddingBagCollection(
        configs,
        is_weighted=False,
        device=torch.device("cpu"),
        table_name_to_quantized_weights=weights,
        row_alignment=ROW_ALIGNMENT,
    )


def build(
    cls: type[RankingModel], cfg: ArchConfig, state: dict[str, torch.Tensor], where: str
) -> RankingModel:
    """A `cls` model whose `ebc` is TorchRec's quantized collection, from a state dict written by `save`.

    Raises:
        ArtifactError naming `where` if the state dict does not match `cfg`.
    """
    # Build the float skeleton with one row per table (its EmbeddingBagCollection is replaced below),
    # so loading never allocates the fp32 tables the quantized file exists to avoid.
    small = dataclasses.replace(
        cfg, tables=[TableSpec(t.feature, 1, t.max_len, t.cardinality) for t in cfg.tables]
    )
    model = cls(small)
    model.cfg = cfg
    try:
        tables = {
            t.feature: from_stored(
                state[f"emb.{t.feature}.data"], state.get(f"emb.{t.feature}.scale_bias"), cfg.embedding_dim
            )
            for t in cfg.tables
        }
    except (KeyError, ValueError) as e:
        raise ArtifactError(f"{where}: not an embedding-quantized {cls.__name__} state dict ({e})") from None
    for t in cfg.tables:
        if tables[t.feature].rows != t.num_rows:
            raise ArtifactError(
                f"{where}: table {t.feature!r} has {tables[t.feature].rows} rows, model_config says {t.num_rows}"
            )
    model.ebc = quant_ebc(cfg, tables)
    dense = {k.removeprefix("dense."): v for k, v in state.items() if k.startswith("dense.")}
    res = model.load_state_dict(dense, strict=False)
    missing = [k for k in res.missing_keys if not k.startswith("ebc.")]
    if missing or res.unexpected_keys:
        raise ArtifactError(
            f"{where}: dense state mismatch: missing {missing}, unexpected {res.unexpected_keys}"
        )
    return model.eval()


def load(variant: Variant) -> RankingModel:
    """The variant's quantized model; the file's SHA-256 is checked first, nothing pickled is executed."""
    path = variant.verify(ROLE)
    state = torch.load(path, weights_only=True)
    return build(variant.model_class(), variant.model_cfg(), state, str(path))


class KJTScorer(nn.Module):
    """Padded tensors in, probabilities [B] out, through the model's KeyedJaggedTensor forward (the
    quantized collection has no per-table weight for `forward_plain`'s Gather). Masks are prefixes
    (the first `length` positions), as every Split and the feature store produce them."""

    def __init__(self, model: RankingModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, dense: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """dense [B, D] f32, ids [B, F, L] i64, mask [B, F, L] f32 -> probabilities [B]."""
        lengths = mask.sum(2).long()  # [B, F]
        return torch.sigmoid(self.model(dense, self.model.kjt(ids, lengths)))


def scorer(variant: Variant) -> Callable[..., np.ndarray]:
    """reco.runtime's Scorer for a `torchrec_quant` variant (threads are set by the caller). Per candidate
    always: the quantized collection pools a KeyedJaggedTensor of every row (`sizes` is accepted, unused)."""
    module = KJTScorer(load(variant)).eval()

    @torch.inference_mode()
    def score(dense: np.ndarray, ids: np.ndarray, mask: np.ndarray, sizes=None) -> np.ndarray:
        return module(torch.from_numpy(dense), torch.from_numpy(ids), torch.from_numpy(mask)).numpy()

    return score
