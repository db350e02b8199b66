"""Load a Variant into a Scorer for the runtime it was built for.

A Scorer maps padded numpy arrays to click probabilities:
    dense [B, D] float32, ids [B, F, L] int64, mask [B, F, L] float32  ->  [B] float32
Evaluation, the in-process benchmark and the HTTP service all score through this one interface, so a
variant's accuracy is measured through its own runtime (ONNX Runtime INT8 is evaluated by ONNX Runtime).

Served blocks are whole requests: `sizes` (rows per request, in order) says so, and a scorer loaded with
the schema's `shared` columns then embeds each request's user and context once (RequestScorer in torch,
the variant's request graph `request.onnx` in ONNX Runtime) instead of once per candidate. Without
`sizes` (evaluation: independent rows) every row is scored on its own. TorchRec's quantized collection
(backend torchrec_quant) has no request form and scores per candidate either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from reco.data.schema import request_groups
from reco.variant import ArtifactError, Variant

REQUEST_ROLE = "onnx_request"  # the request graph's artifact role (reco.steps.accelerate.export)


class Scorer(Protocol):
    def __call__(
        self, dense: np.ndarray, ids: np.ndarray, mask: np.ndarray, sizes: Sequence[int] | None = None
    ) -> np.ndarray:
        """dense [B, D] f32, ids [B, F, L] i64, mask [B, F, L] f32 -> probabilities [B] f32; sizes: rows
        per request when the block is whole requests (see the module docstring)."""
        ...


def load_scorer(
    variant: Variant, threads: int = 1, shared: list[int] | None = None, batch: bool = False
) -> Scorer:
    """threads: intra-op threads of this runtime (torch's are process-wide); shared: the schema's shared
    columns (`Schema.shared_columns`) to score whole requests with (None: always per candidate); batch: a
    job that scores many rows at once (accuracy, what users see), which runs on `threads` even where the
    variant's ONNX session was tuned for a server's latency (one thread, which left the second core idle);
    the scores are the same bit for bit (tests/test_user_once.py).

    Raises:
        ArtifactError when the variant's request graph was built for other shared columns.
    """
    if variant.backend == "onnxruntime":
        request = None
        if shared and REQUEST_ROLE in variant.artifacts:
            built = variant.runtime.get("shared_columns")
            if built != list(shared):
                raise ArtifactError(
                    f"variant {variant.name!r}: its request graph embeds columns {built} once per request, the "
                    f"dataset's schema shares {list(shared)}; rebuild the variant"
                )
            request = variant.verify(REQUEST_ROLE)
        settings = variant.runtime.get("ort", {})
        if batch:
            settings = {**settings, "intra_op_num_threads": threads}
        return ort_scorer(variant.verify("onnx"), settings, threads, request)
    return torch_scorer(variant, threads, shared)


def torch_scorer(variant: Variant, threads: int, shared: list[int] | None) -> Scorer:
    """The torch backends (imported here: a server of an ONNX variant runs without torch, ~1.3 s of CPU
    less per start)."""
    import torch

    from reco.models.protocol import PlainScorer, RequestScorer

    torch.set_num_threads(threads)
    if variant.backend == "torchrec_quant":  # quantized embedding tables (reco.steps.embed_quant)
        from reco.runtime.torchrec_quant import scorer

        return scorer(variant)
    model = variant.load_torch().eval()
    module = PlainScorer(model).eval()
    grouped = RequestScorer(model, shared).eval() if shared else None
    if variant.backend == "torch_compile":
        module = torch.compile(module, dynamic=True)
        grouped = torch.compile(grouped, dynamic=True) if grouped is not None else None
    bf16 = variant.backend == "torch_bf16"

    @torch.inference_mode()
    def score(
        dense: np.ndarray, ids: np.ndarray, mask: np.ndarray, sizes: Sequence[int] | None = None
    ) -> np.ndarray:
        x = (torch.from_numpy(dense), torch.from_numpy(ids), torch.from_numpy(mask))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            if grouped is not None and sizes is not None:
                out = grouped(*x, *(torch.from_numpy(a) for a in request_groups(list(sizes))))
            else:
                out = module(*x)
        return out.float().numpy()

    return score


# ONNX ops that quantize activations with a scale taken from the whole call (dynamic INT8, and ORT's fused form)
DYNAMIC_QUANT_OPS = frozenset({"DynamicQuantizeLinear", "DynamicQuantizeMatMul", "DynamicQuantizeLSTM"})


def batch_invariant(variant: Variant) -> bool:
    """Whether the variant's runtime scores a row the same whatever other rows share its call (up to float
    rounding): False when one of its ONNX graphs quantizes activations dynamically, so a request's scores
    move with its batch-mates (reco.loadtest.correctness); static INT8 (scales fixed at calibration),
    fp32 and the torch backends are."""
    if variant.backend != "onnxruntime":
        return True
    import onnx

    roles = ["onnx"] + ([REQUEST_ROLE] if REQUEST_ROLE in variant.artifacts else [])
    for role in roles:
        graph = onnx.load(str(variant.verify(role)), load_external_data=False).graph
        if any(n.op_type in DYNAMIC_QUANT_OPS for n in graph.node):
            return False
    return True


def ort_session_options(settings: dict, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    level = settings.get("graph_optimization_level", "ORT_ENABLE_ALL")
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    so.intra_op_num_threads = int(settings.get("intra_op_num_threads", threads))
    so.inter_op_num_threads = int(settings.get("inter_op_num_threads", 1))
    mode = settings.get("execution_mode", "ORT_SEQUENTIAL")
    so.execution_mode = getattr(ort.ExecutionMode, mode)
    # Spinning threads burn the core the load generator or a second worker needs.
    so.add_session_config_entry("session.intra_op.allow_spinning", str(settings.get("allow_spinning", "0")))
    so.log_severity_level = 3
    return so


def ort_scorer(path: Path, settings: dict, threads: int = 1, request: Path | None = None) -> Scorer:
    """An ONNX Runtime session of the graph at `path` with session `settings` (see ort_session_options);
    with `request` (the variant's request graph), blocks given `sizes` are scored by that graph."""
    import onnxruntime as ort

    def session(p: Path):
        return ort.InferenceSession(
            str(p), ort_session_options(settings, threads), providers=["CPUExecutionProvider"]
        )

    sess = session(path)
    req = session(request) if request is not None else None

    def score(
        dense: np.ndarray, ids: np.ndarray, mask: np.ndarray, sizes: Sequence[int] | None = None
    ) -> np.ndarray:
        feeds = {"dense": dense, "ids": ids, "mask": mask}
        if req is not None and sizes is not None:
            first, owner = request_groups(list(sizes))
            return req.run(None, {**feeds, "first": first, "owner": owner})[0]
        return sess.run(None, feeds)[0]

    return score
