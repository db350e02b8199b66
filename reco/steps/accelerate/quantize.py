"""INT8 quantization of the exported scorer with ONNX Runtime's quantization tools.

The exporters emit every nn.Linear as Gemm. ONNX Runtime 1.32's dynamic quantizer rewrites a Gemm
with alpha = beta = 1, transA = 0 into MatMul + Add itself (ONNXModel.replace_gemm_with_matmul) and
then quantizes the MatMul; its static (QDQ) path does not, and leaves every Gemm in float unless
"Gemm" is listed. `gemm_to_matmul` does the rewrite up front (any alpha/beta too), so the same
`op_types` quantize every MLP layer in both modes; `census` checks that none is left in float.
ORT's optimizer later fuses DynamicQuantizeLinear + MatMulInteger + scale + bias into
DynamicQuantizeMatMul. The interaction's batched MatMul (activations x activations) stays float in
dynamic mode, which quantizes only MatMuls with a constant B (MatMulConstBOnly).
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from omegaconf import MISSING
from onnx import helper, numpy_helper

from reco.cpu import int8_saturates
from reco.data.schema import Split
from reco.steps.registry import StepError

WEIGHT_TYPES = ("QInt8", "QUInt8")
CALIBRATION_METHODS = ("MinMax", "Entropy", "Percentile", "Distribution")  # onnxruntime's CalibrationMethod
# Ops that compute a quantized matrix product (dynamic, QOperator and the fused forms).
INT_MATMULS = ("MatMulInteger", "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "QLinearMatMul", "QGemm")


@dataclass
class QuantizeConfig:
    weight_type: str = MISSING  # QInt8 | QUInt8
    per_channel: bool = MISSING
    reduce_range: Any = MISSING  # true | false | auto: check() resolves auto with int8_saturates()
    op_types: list[str] = MISSING  # ONNX op types handed to the quantizer, e.g. [MatMul] or [MatMul, Gather]
    gemm_to_matmul: bool = MISSING
    preprocess: bool = MISSING  # onnxruntime.quantization.quant_pre_process (shape inference + optimisation)
    static: bool = MISSING  # static (calibrated activations, QDQ format) instead of dynamic
    calibration_method: str = MISSING  # static only: how activation ranges are set (CALIBRATION_METHODS)
    quantize_outputs: bool = MISSING  # static only: a Q/DQ pair on each quantized op's output too
    calibration_batches: int = MISSING
    calibration_batch_size: int = MISSING

    def check(self, where: str = "") -> None:
        """Checks the settings and resolves reduce_range=auto in place, so the variant's cache key and its
        accelerate.json hold what was used."""
        if self.weight_type not in WEIGHT_TYPES:
            raise StepError(
                f"accelerate: accelerate.quantize.weight_type must be one of {WEIGHT_TYPES}, "
                f"got {self.weight_type!r}"
            )
        if self.calibration_method not in CALIBRATION_METHODS:
            raise StepError(
                f"accelerate: accelerate.quantize.calibration_method must be one of {CALIBRATION_METHODS}, "
                f"got {self.calibration_method!r}"
            )
        if self.reduce_range == "auto":
            self.reduce_range = int8_saturates()
        if not isinstance(self.reduce_range, bool):
            raise StepError(
                f"accelerate: accelerate.quantize.reduce_range must be true, false or auto, got {self.reduce_range!r}"
            )


def gemm_to_matmul(proto: onnx.ModelProto) -> int:
    """In place: Gemm(A, B, C; alpha, beta, transA=0, transB) -> MatMul(A, alpha*B') [+ Add(beta*C)]
    where B is a constant initializer. Returns the number of Gemms rewritten."""
    inits = {t.name: t for t in proto.graph.initializer}
    nodes, n = [], 0
    for node in proto.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type != "Gemm" or attrs.get("transA", 0) or node.input[1] not in inits:
            nodes.append(node)
            continue
        w = numpy_helper.to_array(inits[node.input[1]])
        w = (w.T if attrs.get("transB", 0) else w) * attrs.get("alpha", 1.0)
        w_name = f"{node.input[1]}_matmul"
        proto.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(w, np.float32), w_name))
        has_bias = len(node.input) > 2 and node.input[2] != ""
        mm_out = f"{node.output[0]}_matmul" if has_bias else node.output[0]
        nodes.append(
            helper.make_node("MatMul", [node.input[0], w_name], [mm_out], name=f"{node.name}_MatMul")
        )
        if has_bias:
            bias = node.input[2]
            if attrs.get("beta", 1.0) != 1.0:
                if bias not in inits:
                    raise StepError(f"accelerate: Gemm {node.name} has a non-constant bias with beta != 1")
                b = numpy_helper.to_array(inits[bias]) * attrs["beta"]
                bias = f"{bias}_scaled"
                proto.graph.initializer.append(numpy_helper.from_array(b.astype(np.float32), bias))
            nodes.append(helper.make_node("Add", [mm_out, bias], [node.output[0]], name=f"{node.name}_Add"))
        n += 1
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    _drop_unused_initializers(proto)
    return n


def _drop_unused_initializers(proto: onnx.ModelProto) -> None:
    used = {i for node in proto.graph.node for i in node.input}
    keep = [t for t in proto.graph.initializer if t.name in used]
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(keep)


def quantize(fp32: Path, out: Path, qc: QuantizeConfig, calib: Split | None, work: Path) -> dict:
    """fp32 ONNX file -> INT8 ONNX file at `out`; returns what was done and counted.

    calib: rows of the validation split for static calibration (read in calibration_batch_size batches):
    activation ranges are chosen on validation as every other setting is; test is the report's.
    """
    from onnxruntime.quantization import (
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    qc.check()
    src = fp32
    if qc.preprocess:
        # Before the Gemm rewrite: its optimisation pass would fuse MatMul + Add back into Gemm.
        src = work / "preprocessed.onnx"
        quant_pre_process(str(fp32), str(src), skip_symbolic_shape=True)
    proto = onnx.load(str(src))
    before = count_ops(proto)
    converted = gemm_to_matmul(proto) if qc.gemm_to_matmul else 0
    src = work / "matmul.onnx"
    onnx.save(proto, str(src))
    weight_type = getattr(QuantType, qc.weight_type)
    logging.getLogger("root").setLevel(logging.ERROR)  # the quantizer logs every skipped node
    if qc.static:
        if calib is None:
            raise StepError("accelerate: accelerate.quantize.static needs calibration rows")
        quantize_static(
            str(src),
            str(out),
            CalibrationRows(
                calib,
                qc.calibration_batches,
                qc.calibration_batch_size,
                request="first" in {i.name for i in proto.graph.input},
            ),
            quant_format=QuantFormat.QDQ,
            op_types_to_quantize=list(qc.op_types),
            per_channel=qc.per_channel,
            reduce_range=qc.reduce_range,
            activation_type=QuantType.QUInt8,
            weight_type=weight_type,
            calibrate_method=getattr(CalibrationMethod, qc.calibration_method),
            # Without output Q/DQ a MatMul hands float to its bias and ReLU, as in dynamic mode; only the
            # next layer's input is rounded to 8 bits (experiments/static_int8/README.md).
            extra_options={}
            if qc.quantize_outputs
            else {"OpTypesToExcludeOutputQuantization": list(qc.op_types)},
        )
    else:
        quantize_dynamic(
            str(src),
            str(out),
            op_types_to_quantize=list(qc.op_types),
            per_channel=qc.per_channel,
            reduce_range=qc.reduce_range,
            weight_type=weight_type,
        )
    q = onnx.load(str(out))
    return {
        "gemm_converted": converted,
        "ops_before": before,
        "ops_after": count_ops(q),
        **census(q),
    }


def count_ops(proto: onnx.ModelProto) -> dict[str, int]:
    return dict(sorted(collections.Counter(n.op_type for n in proto.graph.node).items()))


def census(proto: onnx.ModelProto) -> dict[str, int]:
    """Count weight products: float_matmuls = MatMul/Gemm with a float constant weight (unquantized
    MLP layers); quantized_matmuls = integer matrix products plus, in QDQ graphs, MatMuls whose
    weight comes through DequantizeLinear; quantized_tables = Gathers from 8-bit tables;
    quantized_nodes = every quantization-related node."""
    inits = {t.name for t in proto.graph.initializer}
    producer = {o: n for n in proto.graph.node for o in n.output}
    float_mm = quant_mm = 0
    for n in proto.graph.node:
        if n.op_type in INT_MATMULS:
            quant_mm += 1
        elif n.op_type in ("MatMul", "Gemm"):
            w = producer.get(n.input[1])
            if w is not None and w.op_type == "DequantizeLinear" and w.input[0] in inits:
                quant_mm += 1  # QDQ: the weight is an 8-bit initializer
            elif n.input[1] in inits:
                float_mm += 1
    # Embedding tables stored in 8 bit: a Gather reading an 8-bit initializer, directly (dynamic) or
    # through DequantizeLinear (QDQ). Id maps are int32 and don't count.
    eight = {
        t.name
        for t in proto.graph.initializer
        if t.data_type in (onnx.TensorProto.INT8, onnx.TensorProto.UINT8)
    }

    def eight_bit(name: str) -> bool:
        dq = producer.get(name)
        return name in eight or (dq is not None and dq.op_type == "DequantizeLinear" and dq.input[0] in eight)

    q_tables = sum(1 for n in proto.graph.node if n.op_type == "Gather" and eight_bit(n.input[0]))
    qnodes = sum(
        1
        for n in proto.graph.node
        if n.op_type in INT_MATMULS or "Quantize" in n.op_type or n.op_type == "ConvInteger"
    )
    return {
        "quantized_matmuls": quant_mm,
        "float_matmuls": float_mm,
        "quantized_tables": q_tables,
        "quantized_nodes": qnodes,
    }


class CalibrationRows:
    """onnxruntime CalibrationDataReader over the first batches of a split; `request`: for a request graph
    (every row its own request, so the shared columns are calibrated on as many users as the plain graph's)."""

    def __init__(self, split: Split, batches: int, batch_size: int, request: bool = False):
        self.request = request
        # Whole batches only: the histogram calibrators (Percentile, Entropy) stack every batch's
        # activations into one array, so a short last batch fails them; a split shorter than one batch is
        # one batch of all its rows.
        full = min(batches, len(split) // batch_size)
        self.parts = [split.take(slice(i * batch_size, (i + 1) * batch_size)) for i in range(full)] or [split]
        self.it = iter(self.parts)

    def get_next(self) -> dict[str, np.ndarray] | None:
        p = next(self.it, None)
        if p is None:
            return None
        feeds = {"dense": p.dense.numpy(), "ids": p.ids.numpy(), "mask": p.mask().numpy()}
        if self.request:
            feeds["first"] = feeds["owner"] = np.arange(len(p.dense), dtype=np.int64)
        return feeds

    def rewind(self) -> None:
        self.it = iter(self.parts)
