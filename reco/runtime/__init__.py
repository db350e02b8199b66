"""Load a Variant into a Scorer for the runtime it was built for.

A Scorer maps padded numpy arrays to click probabilities:
    dense [B, D] float32, ids [B, F, L] int64, mask [B, F, L] float32  ->  [B] float32
Evaluation, the in-process benchmark and the HTTP service all score through this one interface, so a
variant's accuracy is measured through its own runtime (ONNX Runtime INT8 is evaluated by ONNX Runtime).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from reco.models.protocol import PlainScorer
from reco.variant import Variant

Scorer = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def load_scorer(variant: Variant, threads: int = 1) -> Scorer:
    """threads: intra-op threads of this runtime (torch's are process-wide)."""
    if variant.backend == "onnxruntime":
        return ort_scorer(variant.verify("onnx"), variant.runtime.get("ort", {}), threads)
    torch.set_num_threads(threads)
    if variant.backend == "torchrec_quant":  # quantized embedding tables (reco.steps.embed_quant)
        from reco.runtime.torchrec_quant import scorer

        return scorer(variant)
    module = PlainScorer(variant.load_torch()).eval()
    if variant.backend == "torch_compile":
        module = torch.compile(module, dynamic=True)
    bf16 = variant.backend == "torch_bf16"

    @torch.inference_mode()
    def score(dense: np.ndarray, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = module(torch.from_numpy(dense), torch.from_numpy(ids), torch.from_numpy(mask))
        return out.float().numpy()

    return score


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


def ort_scorer(path: Path, settings: dict, threads: int = 1) -> Scorer:
    """An ONNX Runtime session of the graph at `path` with session `settings` (see ort_session_options)."""
    import onnxruntime as ort

    sess = ort.InferenceSession(
        str(path), ort_session_options(settings, threads), providers=["CPUExecutionProvider"]
    )

    def score(dense: np.ndarray, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return sess.run(None, {"dense": dense, "ids": ids, "mask": mask})[0]

    return score
