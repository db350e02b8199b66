"""Row-wise embedding-table precisions in FBGEMM's format, the one both runtimes read.

An INTn table (n = 8, 4, 2) stores each row as n-bit codes packed into bytes (lowest bits first: element
2k of an INT4 row is the low nibble of byte k) plus a float16 scale and bias per row:
    value = code * scale + bias          (bias = the row's minimum, scale = (max - min) / (2^n - 1))
This is `torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf`, exactly what TorchRec's
quantized EmbeddingBagCollection builds and its CPU kernels read, so the torch runtime, the ONNX graph
and the float "fake-quantized" reference used for the sensitivity sweep all see the same numbers.
The bias is a float, not an integer zero point, which is why the ONNX graph dequantizes with
Mul + Add rather than DequantizeLinear (whose zero point must be an integer code).

Kernel constraint (measured on fbgemm-gpu-cpu 1.8.0): the packed row must be a whole number of
float16s, i.e. embedding_dim * bits % 16 == 0, else FBGEMM raises "ncols needs to be multiple of 2
Bytes". fp16 and fp32 tables have no constraint.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # torchrec is imported where used: see reco.config._schemas
    from torchrec.modules.embedding_configs import DataType

SCALE_BIAS_BYTES = 4  # float16 scale + float16 bias per row


class Precision(Enum):
    """Storage precision of one embedding table."""

    fp32 = "fp32"
    fp16 = "fp16"
    int8 = "int8"
    int4 = "int4"
    int2 = "int2"

    @property
    def bits(self) -> int:
        return {"fp32": 32, "fp16": 16, "int8": 8, "int4": 4, "int2": 2}[self.value]

    @property
    def rowwise(self) -> bool:
        """True for the integer formats (codes + per-row scale/bias)."""
        return self.bits <= 8

    @property
    def data_type(self) -> DataType:
        """TorchRec's name for it (EmbeddingBagConfig.data_type)."""
        from torchrec.modules.embedding_configs import DataType

        return {
            "fp32": DataType.FP32,
            "fp16": DataType.FP16,
            "int8": DataType.INT8,
            "int4": DataType.INT4,
            "int2": DataType.INT2,
        }[self.value]


def unsupported(p: Precision, dim: int) -> str | None:
    """Why FBGEMM's row-wise kernels cannot hold a table of `dim` columns at `p`, or None if they can."""
    if p.rowwise and dim * p.bits % 16:
        return (
            f"{p.value} rows of embedding_dim {dim} pack into {dim * p.bits / 8:g} bytes; FBGEMM needs "
            f"embedding_dim * {p.bits} bits to be a multiple of 16 (embedding_dim % {16 // p.bits} == 0)"
        )
    return None


@dataclass
class QTable:
    """One table at its storage precision.

    data:       fp32 [N, d] | fp16 [N, d] | uint8 [N, d * bits / 8] packed codes
    scale_bias: float16 [N, 2] (scale, bias) for the integer formats, else None
    """

    precision: Precision
    dim: int
    data: torch.Tensor
    scale_bias: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        sb = self.scale_bias.numel() * self.scale_bias.element_size() if self.scale_bias is not None else 0
        return self.data.numel() * self.data.element_size() + sb

    def fused(self) -> torch.Tensor:
        """uint8 [N, bytes per row]: FBGEMM's fused row layout (codes then scale, bias), or the raw bytes of
        a float table -- what TorchRec's quantized EmbeddingBagCollection takes as weights."""
        if not self.precision.rowwise:
            return self.data.contiguous().view(torch.uint8)
        assert self.scale_bias is not None
        return torch.cat([self.data, self.scale_bias.contiguous().view(torch.uint8)], 1)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, d]: the values the kernels compute with."""
        if not self.precision.rowwise:
            return self.data.float()
        return _fbgemm().FusedNBitRowwiseQuantizedSBHalfToFloat(self.fused(), self.precision.bits)


def _fbgemm():
    """torch.ops.fbgemm, registered on first use (fbgemm_gpu is not imported at the top: see
    reco.config._schemas)."""
    import fbgemm_gpu  # noqa: F401 (registers torch.ops.fbgemm)

    return torch.ops.fbgemm


def quantize_table(weight: torch.Tensor, p: Precision) -> QTable:
    """weight float32 [N, d] -> the table at precision `p` (see the module docstring for the format)."""
    w = weight.detach().float().contiguous()
    dim = w.shape[1]
    why = unsupported(p, dim)
    assert why is None, why  # callers check user settings with `unsupported` first
    if p is Precision.fp32:
        return QTable(p, dim, w.clone())
    if p is Precision.fp16:
        return QTable(p, dim, w.half())
    fused = _fbgemm().FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(w, p.bits)
    codes = fused[:, :-SCALE_BIAS_BYTES].contiguous()
    sb = fused[:, -SCALE_BIAS_BYTES:].contiguous().view(torch.float16)  # [N, 2]
    return QTable(p, dim, codes, sb)


def from_stored(data: torch.Tensor, scale_bias: torch.Tensor | None, dim: int) -> QTable:
    """A QTable from its stored tensors; the precision follows from dtype and packed width.

    Raises:
        ValueError if the tensors do not form a table of `dim` columns.
    """
    if scale_bias is None:
        p = {torch.float32: Precision.fp32, torch.float16: Precision.fp16}.get(data.dtype)
        if p is None or data.dim() != 2 or data.shape[1] != dim:
            raise ValueError(
                f"float table: expected float32/float16 [N, {dim}], got {data.dtype} {list(data.shape)}"
            )
        return QTable(p, dim, data)
    bits = {dim * b // 8: b for b in (8, 4, 2) if dim * b % 8 == 0}.get(
        data.shape[1] if data.dim() == 2 else -1
    )
    if (
        data.dtype != torch.uint8
        or bits is None
        or scale_bias.dtype != torch.float16
        or list(scale_bias.shape) != [data.shape[0], 2]
    ):
        raise ValueError(
            f"row-wise table: expected uint8 codes [N, {dim} * bits / 8] and float16 scale/bias [N, 2], "
            f"got {data.dtype} {list(data.shape)} and {scale_bias.dtype} {list(scale_bias.shape)}"
        )
    return QTable(Precision(f"int{bits}"), dim, data, scale_bias)
