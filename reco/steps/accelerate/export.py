"""Export a model's plain-tensor scorer to ONNX and prove the export computes the same probabilities.

Graph contract (what reco.runtime feeds ONNX Runtime):
    inputs  dense [B, D] float32, ids [B, F, L] int64, mask [B, F, L] float32   (B dynamic)
    output  probs [B] float32
The request graph (`shared` columns given; reco.models.protocol.RequestScorer) adds
    first [U] int64 (a row of each request), owner [B] int64 (each row's request)   (U dynamic)
and embeds the shared columns once per request; it is what the service runs, the plain graph is what
evaluation and a Triton model repository run.
Exporters: "torchscript" is `torch.onnx.export(dynamo=False)` (the legacy tracer, deprecated since torch
2.9 but still shipped), "dynamo" is the torch.export-based exporter (needs onnxscript). Both give a
Loop-free graph of Gather / Mul / ReduceSum / Gemm ops because `forward_plain` avoids EmbeddingBag;
`assert_static_graph` enforces that.
"""

from __future__ import annotations

import collections
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch

from reco.data.schema import Split
from reco.models.protocol import PlainScorer, RankingModel, RequestScorer, as_requests, request_groups
from reco.steps.registry import StepError

INPUTS = ("dense", "ids", "mask")
REQUEST_INPUTS = (*INPUTS, "first", "owner")
OUTPUT = "probs"
EXPORTERS = ("torchscript", "dynamo")
CONTROL_FLOW = ("Loop", "Scan", "If")

Batch = tuple[np.ndarray, np.ndarray, np.ndarray]  # dense [B, D] f32, ids [B, F, L] i64, mask [B, F, L] f32


def export_onnx(
    model: RankingModel,
    path: Path,
    example: Split,
    opset: int,
    exporter: str,
    shared: list[int] | None = None,
) -> onnx.ModelProto:
    """Write PlainScorer(model) -- RequestScorer(model, shared) when `shared` is given -- to `path`
    (weights inside the file) and return the loaded graph."""
    if exporter not in EXPORTERS:
        raise StepError(f"accelerate: accelerate.exporter must be one of {EXPORTERS}, got {exporter!r}")
    scorer = (PlainScorer(model) if shared is None else RequestScorer(model, shared)).eval()
    args: tuple = (example.dense, example.ids, example.mask())
    names = INPUTS if shared is None else REQUEST_INPUTS
    axes = {n: "batch" for n in names} | ({"first": "requests"} if shared is not None else {})
    if shared is not None:  # two requests in the example, so neither axis is traced as a constant
        half = len(example.dense) // 2
        args += tuple(torch.from_numpy(a) for a in request_groups([half, len(example.dense) - half]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=DeprecationWarning)  # the torchscript exporter's notice
        if exporter == "torchscript":
            dyn = {n: {0: a} for n, a in axes.items()} | {OUTPUT: {0: "batch"}}
            shapes: dict = {"dynamo": False, "dynamic_axes": dyn}
        else:
            dims = {a: torch.export.Dim(a, min=1) for a in set(axes.values())}
            shapes = {
                "dynamo": True,
                "dynamic_shapes": {n: {0: dims[a]} for n, a in axes.items()},
                "external_data": False,
            }
        torch.onnx.export(
            scorer,
            args,
            str(path),
            input_names=list(names),
            output_names=[OUTPUT],
            opset_version=opset,
            verbose=False,
            **shapes,
        )
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto)
    assert_static_graph(proto, path, names)
    return proto


def op_counts(proto: onnx.ModelProto) -> dict[str, int]:
    return dict(sorted(collections.Counter(n.op_type for n in proto.graph.node).items()))


def assert_static_graph(proto: onnx.ModelProto, path: Path, inputs: tuple[str, ...] = INPUTS) -> None:
    """No control flow: a Loop per EmbeddingBag is what makes naive DLRM exports slow."""
    bad = {op: n for op, n in op_counts(proto).items() if op in CONTROL_FLOW}
    if bad:
        raise StepError(f"accelerate: exported graph {path} contains control-flow ops {bad}; expected none")
    names = [i.name for i in proto.graph.input]
    if names != list(inputs) or [o.name for o in proto.graph.output] != [OUTPUT]:
        raise StepError(
            f"accelerate: exported graph {path} has inputs {names}; expected {list(inputs)} -> {OUTPUT}"
        )


def real_batch(split: Split, rows: int) -> Batch:
    part = split.take(slice(0, rows))
    return part.dense.numpy(), part.ids.numpy(), part.mask().numpy()


def random_batch(model: RankingModel, rows: int, max_len: int, seed: int) -> Batch:
    """Any valid input, not just data-like ones: random dense values, ids over each table's full
    cardinality (so pruned ids hit row 0 through the id map), random lengths."""
    rng = np.random.default_rng(seed)
    tables = model.cfg.tables
    dense = rng.normal(size=(rows, model.cfg.dense_in)).astype(np.float32)
    ids = np.zeros((rows, len(tables), max_len), dtype=np.int64)
    mask = np.zeros((rows, len(tables), max_len), dtype=np.float32)
    for i, t in enumerate(tables):
        lengths = rng.integers(0 if t.max_len > 1 else 1, t.max_len + 1, size=rows)
        pos = np.arange(max_len)[None, :] < lengths[:, None]
        ids[:, i, :] = np.where(pos, rng.integers(0, t.cardinality, size=(rows, max_len)), 0)
        mask[:, i, :] = pos
    return dense, ids, mask


def request_parity(scorer, batches: dict[str, Batch], shared: list[int]) -> dict[str, float]:
    """max |p_request - p_plain| per named batch, each cut into requests of uneven sizes (one of a
    single row); scorer(dense, ids, mask, sizes) answers with the request graph, scorer(dense, ids, mask)
    per candidate (reco.runtime.ort_scorer given both graphs), each -> [B] probabilities."""
    out = {}
    for k, b in batches.items():
        n = len(b[0])
        sizes = [1, n // 3, n - 1 - n // 3] if n > 2 else [n]
        rows = as_requests(b, shared, sizes)
        out[k] = float(np.abs(scorer(*rows, sizes) - scorer(*rows)).max())
    return out


@torch.inference_mode()
def torch_probs(model: RankingModel, batch: Batch) -> np.ndarray:
    return PlainScorer(model).eval()(*(torch.from_numpy(a) for a in batch)).numpy()


def max_abs_diff(scorer, model: RankingModel, batch: Batch) -> float:
    """max |p_scorer - p_torch| over the batch; scorer(dense, ids, mask) -> [B] probabilities."""
    return float(np.abs(scorer(*batch) - torch_probs(model, batch)).max())


def check_parity(
    scorer, model: RankingModel, batches: dict[str, Batch], tol: float, what: str
) -> dict[str, float]:
    """max |p_scorer - p_torch| per named batch; raises if any exceeds `tol`."""
    diffs = {k: max_abs_diff(scorer, model, b) for k, b in batches.items()}
    if max(diffs.values()) > tol:
        raise StepError(
            f"accelerate: ONNX export parity failed for {what}: max |p_onnx - p_torch| per batch {diffs} > "
            f"accelerate.parity_tol={tol}"
        )
    return diffs
