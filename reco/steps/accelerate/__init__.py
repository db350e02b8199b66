"""Accelerate a torch variant for CPU serving: ONNX Runtime fp32 / INT8, torch.compile or bf16.

onnx_fp32 / onnx_int8: export (.export) -> parity check against torch on a random and a
real validation batch (fail if max |p_onnx - p_torch| > parity_tol) -> [INT8: Gemm->MatMul rewrite + ORT
quantization, .quantize] -> session-parameter tuning (.tuning). The same export and quantization give the
request graph the service runs (request.onnx: user and context embedded once per request), held to
parity_tol against model.onnx on the same rows cut into requests.
torch_compile / torch_bf16: the parent's weights with another torch backend (reco.runtime handles them).
Every mode ends with the AUC guard: the child is scored on the test split through its own runtime
(reco.runtime.load_scorer) and may lose at most `auc_guard` (relative) of the parent's test AUC.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

from omegaconf import MISSING

from reco.data.schema import Dataset
from reco.measure import evaluate
from reco.models.protocol import count_params
from reco.runtime import REQUEST_ROLE, load_scorer, ort_scorer
from reco.steps.accelerate.export import (
    check_parity,
    export_onnx,
    max_abs_diff,
    op_counts,
    random_batch,
    real_batch,
    request_parity,
)
from reco.steps.accelerate.quantize import QuantizeConfig, census, quantize
from reco.steps.accelerate.tuning import TuneConfig, tune_into
from reco.steps.registry import StepError, StepRun, child_variant, register, require_artifact
from reco.variant import Variant


class Mode(Enum):
    onnx_fp32 = "onnx_fp32"
    onnx_int8 = "onnx_int8"
    torch_compile = "torch_compile"
    torch_bf16 = "torch_bf16"

    @property
    def backend(self) -> str:
        """The runtime (Variant.backend) that serves the result."""
        return "onnxruntime" if self.name.startswith("onnx") else self.name


class Exporter(Enum):
    torchscript = "torchscript"  # torch.onnx.export(dynamo=False)
    dynamo = "dynamo"  # the torch.export-based exporter (opset >= 18)


@dataclass
class AccelerateConfig:
    """conf/step/accelerate.yaml (override as accelerate.<key>, or per variant in the variant graph)."""

    mode: Mode = MISSING
    exporter: Exporter = MISSING
    opset: int = MISSING
    parity_tol: float = MISSING  # max |p_onnx - p_torch| of the fp32 export
    parity_rows: int = MISSING  # rows of each parity batch (random and real)
    auc_guard: float = MISSING  # max relative test-AUC drop vs the parent
    quantize: QuantizeConfig = field(default_factory=QuantizeConfig)
    tune: TuneConfig | None = None  # null: keep the runtime's defaults

    def check(self, where: str = "") -> None:
        self.quantize.check()
        if self.auc_guard < 0:
            raise StepError(f"accelerate: accelerate.auc_guard must be >= 0, got {self.auc_guard}")


@register("accelerate", AccelerateConfig)
def run(parent: Variant | None, data: Dataset, ac: AccelerateConfig, ctx: StepRun) -> Variant:
    """The parent's torch model for a faster runtime (see the module docstring).

    Returns:
        An onnxruntime variant (model.onnx, tuned session settings in runtime["ort"]) or the same torch
        weights under another torch backend; either passed the parity check and the AUC guard.
    """
    assert parent is not None
    ac.check()
    require_artifact(parent, "torch", "accelerate")
    model = parent.load_torch()
    backend = ac.mode.backend
    v = child_variant(parent, data, ac, ctx, "accelerate", backend)
    if backend != "onnxruntime":
        v.save_torch(model)  # same weights; the backend decides how they run
    else:
        # The graph holds the same parameters; params/FLOPs describe the model, not its runtime.
        v.params, v.flops_per_candidate = count_params(model), model.cfg.flops_per_candidate()
        report = build_onnx(v, model, data, ac)
        (v.path / "accelerate.json").write_text(json.dumps(report, indent=2))
        v.add_artifact("report", "accelerate.json")
    auc_guard(parent, v, data, ac.auc_guard, ctx.trainer.threads)
    v.save()
    return v


def build_onnx(v: Variant, model, data: Dataset, ac: AccelerateConfig) -> dict:
    """Writes model.onnx into the variant dir, fills v.runtime/metrics; returns the step report."""
    work = v.path / "_work"
    work.mkdir(exist_ok=True)
    try:
        fp32 = work / "fp32.onnx"
        t0 = time.perf_counter()
        proto = export_onnx(model, fp32, data.val.take(slice(0, 8)), ac.opset, ac.exporter.value)
        export_s = time.perf_counter() - t0
        batches = {
            "random": random_batch(model, ac.parity_rows, data.val.ids.shape[2], seed=0),
            "real": real_batch(data.val, ac.parity_rows),
        }
        what = f"{ac.exporter.value} exporter, opset {ac.opset}"
        parity = check_parity(ort_scorer(fp32, {}), model, batches, ac.parity_tol, what)
        report: dict = {
            "exporter": ac.exporter.value,
            "opset": ac.opset,
            "export_seconds": export_s,
            "fp32_ops": op_counts(proto),
            "parity_max_abs": parity,
        }
        v.metrics.update(
            parity_max_abs_random=parity["random"],
            parity_max_abs_real=parity["real"],
            mlp_layers=float(len(model.cfg.bottom) + len(model.cfg.top) + 1),
        )
        final = v.path / "model.onnx"
        calib = data.val if ac.quantize.static else None  # hyper-parameters are chosen on val
        if ac.mode is Mode.onnx_int8:
            q = quantize(fp32, final, ac.quantize, calib, work)
            int8 = {k: max_abs_diff(ort_scorer(final, {}), model, b) for k, b in batches.items()}
            report.update(quantize=asdict(ac.quantize), quantization=q, int8_max_abs=int8)
            v.metrics.update(
                quantized_nodes=float(q["quantized_nodes"]),
                quantized_matmuls=float(q["quantized_matmuls"]),
                float_matmuls=float(q["float_matmuls"]),
                quantized_tables=float(q["quantized_tables"]),
                gemm_converted=float(q["gemm_converted"]),
                int8_max_abs_random=int8["random"],
                int8_max_abs_real=int8["real"],
            )
        else:
            shutil.copyfile(fp32, final)
            report["census"] = census(proto)
        if shared := data.schema.shared_columns:

            def transform(src: Path, out: Path) -> None:
                if ac.mode is Mode.onnx_int8:
                    quantize(src, out, ac.quantize, calib, work)
                else:
                    shutil.copyfile(src, out)

            report["request_parity_max_abs"] = build_request_graph(
                v, model, data, ac.opset, ac.exporter.value, batches, ac.parity_tol, transform, shared
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    v.add_artifact("onnx", "model.onnx")
    tuning = tune_into(v, final, data.val, ac.tune)
    if tuning is not None:
        report["tuning"] = tuning
        best = tuning["chosen"]
        if ac.mode is Mode.onnx_fp32:  # graph optimisation levels fuse differently: re-check what will serve
            tuned = check_parity(
                ort_scorer(final, best), model, batches, ac.parity_tol, f"{what}, tuned {best}"
            )
            v.metrics["parity_max_abs_tuned"] = max(tuned.values())
    return report


def build_request_graph(
    v: Variant,
    model,
    data: Dataset,
    opset: int,
    exporter: str,
    batches: dict,
    tol: float,
    transform: Callable[[Path, Path], None],
    shared: list[int],
) -> dict[str, float]:
    """Export RequestScorer(model, shared), `transform` it (fp32 path -> final path) as the plain graph
    was, check it against the variant's model.onnx on the same rows cut into requests, and record it
    (artifact onnx_request, runtime["shared_columns"]). Returns max |p_request - p_plain| per batch.

    Raises:
        StepError when the two graphs differ by more than `tol` on some batch.
    """
    work = v.path / "_work"
    fp32 = work / "request_fp32.onnx"
    export_onnx(model, fp32, data.val.take(slice(0, 8)), opset, exporter, shared)
    final = v.path / "request.onnx"
    transform(fp32, final)
    diffs = request_parity(ort_scorer(v.path / "model.onnx", {}, request=final), batches, shared)
    if max(diffs.values()) > tol:
        raise StepError(
            f"{v.step}: the request graph (user and context embedded once per request) does not score what "
            f"model.onnx scores for the same rows: max |p_request - p_plain| per batch {diffs} > {tol}"
        )
    v.add_artifact(REQUEST_ROLE, final.name)
    v.runtime["shared_columns"] = list(shared)
    v.metrics["request_parity_max_abs"] = max(diffs.values())
    return diffs


def auc_guard(parent: Variant, child: Variant, data: Dataset, guard: float, threads: int) -> None:
    """Score parent and child through their own runtimes on the validation split (the test split is the
    report's); raise if the child's AUC fell more than `guard` (relative)."""
    ref = evaluate(load_scorer(parent, threads, batch=True), data.val)["auc"]
    got = evaluate(load_scorer(child, threads, batch=True), data.val)["auc"]
    drop = (ref - got) / ref
    child.metrics.update(guard_parent_val_auc=float(ref), guard_val_auc=float(got), auc_rel_drop=float(drop))
    if drop > guard:
        raise StepError(
            f"accelerate: mode {child.backend}/{child.step_config.get('mode')} lost too much validation AUC: "
            f"parent {parent.name!r} auc {ref:.5f} -> {child.name!r} auc {got:.5f} (relative drop {drop:.4%} > "
            f"accelerate.auc_guard={guard:.4%})"
        )
