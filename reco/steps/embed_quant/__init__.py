"""The `embed_quant` step: embedding tables stored row-wise in INT8 / INT4 / INT2 / fp16, chosen per table.

Recommenders are embedding-bound in memory: the default DLRM's tables are ~94% of its file, which
dense INT8 (accelerate's onnx_int8) leaves alone. This step
1. sweeps each table's sensitivity on the validation split and picks its precision (.sensitivity),
2. stores the tables in FBGEMM's row-wise format (.rowwise), and serves them through
   - runtime=torch: TorchRec's quantized EmbeddingBagCollection on FBGEMM's CPU kernels (.qmodel,
     backend `torchrec_quant`, file model_qemb.pt of plain tensors), or
   - runtime=onnxruntime: the accelerate export with each table Gather reading uint8 codes + per-row
     scale/bias (.onnx_tables), optionally with accelerate's dense INT8 on top (`dense_int8`),
3. checks the runtime against the float model holding the same dequantized values (parity_tol) and the
   whole variant's validation AUC against `budget`.
Both runtimes read the same bytes, so they agree to float rounding (tests check it). Test AUC and rank
latency are measured by the pipeline afterwards, through reco.runtime.load_scorer.
"""

from __future__ import annotations

import copy
import json
import shutil
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import onnx
import torch
from omegaconf import MISSING

from reco.config import typed
from reco.data.schema import Dataset
from reco.measure import evaluate
from reco.models.protocol import RankingModel, count_params
from reco.runtime import load_scorer, ort_scorer
from reco.runtime import torchrec_quant as qmodel
from reco.runtime.rowwise import Precision, QTable, unsupported
from reco.steps.accelerate import Exporter, build_request_graph
from reco.steps.accelerate.export import export_onnx, max_abs_diff, random_batch, real_batch
from reco.steps.accelerate.quantize import QuantizeConfig, quantize
from reco.steps.accelerate.tuning import TuneConfig, tune_into
from reco.steps.embed_quant.onnx_tables import replace_tables
from reco.steps.embed_quant.sensitivity import Choice, Sweep, choose, limit_rows
from reco.steps.registry import StepError, StepRun, child_variant, register, require_artifact
from reco.variant import Backend, Variant

REPORT = "embed_quant.json"


class Runtime(Enum):
    torch = "torch"  # TorchRec quantized EmbeddingBagCollection (FBGEMM CPU kernels)
    onnxruntime = "onnxruntime"  # uint8 Gather + row-wise dequantization in the exported graph

    @property
    def backend(self) -> Backend:
        return "torchrec_quant" if self is Runtime.torch else "onnxruntime"


@dataclass
class EmbedQuantConfig:
    """conf/step/embed_quant.yaml (override as embed_quant.<key>, or per variant in the variant graph)."""

    runtime: Runtime = MISSING
    precisions: list[Precision] = MISSING  # candidates for the sweep, any order (fewest bits tried first)
    tables: dict[str, Precision] = MISSING  # feature -> fixed precision (not swept)
    budget: float = MISSING  # max relative val-AUC drop of the variant vs its parent
    table_budget: float = MISSING  # max relative val-AUC drop of one table alone at a precision
    sweep_rows: int | None = MISSING  # validation rows scored per sweep point (null: all)
    dense_int8: bool = MISSING  # onnxruntime only: also INT8 MLPs through accelerate's quantizer
    # accelerate's QuantizeConfig and TuneConfig (null: no tuning). Untyped here because the YAML
    # interpolates accelerate's blocks, which Hydra cannot merge into a typed node; check() types them.
    quantize: Any = MISSING  # dense_int8 settings
    exporter: Exporter = MISSING
    opset: int = MISSING
    parity_tol: float = MISSING  # max |p_runtime - p_reference| (reference: float model, dequantized tables)
    parity_rows: int = MISSING
    tune: Any = MISSING  # onnxruntime session-settings search (null: the runtime's defaults)

    def check(self, where: str = "") -> None:
        if self.quantize is not None:
            self.quantize = typed(self.quantize, QuantizeConfig, "embed_quant.quantize")
            self.quantize.check()
        if self.tune is not None:
            self.tune = typed(self.tune, TuneConfig, "embed_quant.tune")
        if not self.precisions:
            raise StepError("embed_quant: embed_quant.precisions is empty; expected e.g. [int4, int8, fp16]")
        if len(set(self.precisions)) < len(self.precisions):
            raise StepError(
                f"embed_quant: embed_quant.precisions repeats a value: {[p.value for p in self.precisions]}"
            )
        for key in ("budget", "table_budget", "parity_tol"):
            if getattr(self, key) < 0:
                raise StepError(f"embed_quant: embed_quant.{key} must be >= 0, got {getattr(self, key)}")
        if self.sweep_rows is not None and self.sweep_rows < 100:
            raise StepError(
                f"embed_quant: embed_quant.sweep_rows must be null or >= 100, got {self.sweep_rows}"
            )
        if self.dense_int8 and self.runtime is not Runtime.onnxruntime:
            raise StepError(
                "embed_quant: embed_quant.dense_int8=true needs embed_quant.runtime=onnxruntime (dense INT8 is "
                f"ONNX Runtime's quantizer), got embed_quant.runtime={self.runtime.value}"
            )
        if self.dense_int8 and self.quantize is None:
            raise StepError(
                "embed_quant: embed_quant.dense_int8=true needs the embed_quant.quantize settings"
            )
        if self.dense_int8 and "Gather" in self.quantize.op_types:
            raise StepError(
                "embed_quant: embed_quant.quantize.op_types must not list Gather: this step quantizes the "
                f"tables itself (row-wise), got {self.quantize.op_types}"
            )


@register("embed_quant", EmbedQuantConfig)
def run(parent: Variant | None, data: Dataset, cfg: EmbedQuantConfig, ctx: StepRun) -> Variant:
    """The parent's model with quantized embedding tables (see the module docstring).

    Returns:
        A `torchrec_quant` or `onnxruntime` variant; metrics emb_size_ratio, model_size_ratio,
        emb_<table>_bits, emb_<table>_val_auc_drop, emb_val_auc_rel_drop, ...; report embed_quant.json.
    """
    assert parent is not None
    cfg.check()
    require_artifact(parent, "torch", "embed_quant")
    model = parent.load_torch()
    check_tables(model, cfg)
    torch.set_num_threads(ctx.trainer.threads)
    t0 = time.perf_counter()
    sweep = Sweep(model, limit_rows(data.val, cfg.sweep_rows))
    choice = choose(sweep, cfg.precisions, cfg.tables, cfg.table_budget, cfg.budget)
    if choice.mix_drop > cfg.budget:
        raise StepError(
            f"embed_quant: no precision mix meets embed_quant.budget={cfg.budget:.4%}: with "
            f"{choice.mix[-1].precisions} the relative val-AUC drop is {choice.mix_drop:.4%}; add a higher "
            f"precision to embed_quant.precisions ({[p.value for p in cfg.precisions]}), pin sensitive "
            "tables in embed_quant.tables, or raise embed_quant.budget"
        )
    sweep_s = time.perf_counter() - t0
    tables = {f: sweep.table(f, p) for f, p in choice.precision.items()}
    ref = dequantized_copy(model, tables)

    v = child_variant(parent, data, cfg, ctx, "embed_quant", cfg.runtime.backend)
    v.params, v.flops_per_candidate = count_params(model), model.cfg.flops_per_candidate()
    v.runtime["embed_quant"] = {"precision": {f: p.value for f, p in choice.precision.items()}}
    batches = {
        "random": random_batch(model, cfg.parity_rows, data.val.ids.shape[2], seed=0),
        "real": real_batch(data.val, cfg.parity_rows),
    }
    report: dict = {"runtime": cfg.runtime.value, "sweep_seconds": sweep_s}
    if cfg.runtime is Runtime.torch:
        qmodel.save(v.path / qmodel.FILE, model, tables)
        v.add_artifact(qmodel.ROLE, qmodel.FILE)
        report["parity_max_abs"] = check_parity(
            load_scorer(v, ctx.trainer.threads), ref, batches, cfg, "torch"
        )
    else:
        report.update(build_onnx(v, model, ref, tables, data, cfg, batches))
    final_auc = evaluate(load_scorer(v, ctx.trainer.threads, batch=True), sweep.split)["auc"]
    final_drop = (choice.parent_auc - final_auc) / choice.parent_auc
    report.update(summary(parent, v, model, tables, choice, len(sweep.split), final_auc, final_drop))
    v.metrics.update(metrics(report, choice, cfg))
    (v.path / REPORT).write_text(json.dumps(report, indent=2))
    v.add_artifact("report", REPORT)
    if final_drop > cfg.budget:
        raise StepError(
            f"embed_quant: the built variant loses {final_drop:.4%} val AUC (relative) > embed_quant.budget="
            f"{cfg.budget:.4%}; its tables alone lose {choice.mix_drop:.4%}"
            + (" (dense INT8 costs the rest: try embed_quant.dense_int8=false)" if cfg.dense_int8 else "")
        )
    v.save()
    return v


def check_tables(model: RankingModel, cfg: EmbedQuantConfig) -> None:
    """Every fixed table exists and every precision it may get is one FBGEMM's kernels can hold."""
    dim = model.cfg.embedding_dim
    for f, p in cfg.tables.items():
        if f not in model.features:
            raise StepError(
                f"embed_quant: embed_quant.tables.{f}: the parent has no table {f!r} (tables: {model.features})"
            )
        if why := unsupported(p, dim):
            raise StepError(
                f"embed_quant: embed_quant.tables.{f}={p.value}: FBGEMM's row-wise kernels cannot hold table "
                f"{f!r} at {p.value}: {why}"
            )
    free = [f for f in model.features if f not in cfg.tables]
    for p in cfg.precisions:
        if free and (why := unsupported(p, dim)):
            raise StepError(
                f"embed_quant: embed_quant.precisions lists {p.value}, which FBGEMM's row-wise kernels cannot "
                f"hold for tables {free}: {why}; remove it from embed_quant.precisions"
            )


def dequantized_copy(model: RankingModel, tables: dict[str, QTable]) -> RankingModel:
    """A float copy of `model` whose tables hold the dequantized values: what every runtime must compute."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for f, w in ref.tables().items():
            w.copy_(tables[f].dequantize())
    return ref.eval()


def check_parity(
    scorer, ref: RankingModel, batches: dict, cfg: EmbedQuantConfig, what: str
) -> dict[str, float]:
    """max |p_runtime - p_reference| per batch; raises if any exceeds embed_quant.parity_tol."""
    diffs = {k: max_abs_diff(scorer, ref, b) for k, b in batches.items()}
    if max(diffs.values()) > cfg.parity_tol:
        raise StepError(
            f"embed_quant: the {what} runtime does not compute what its quantized tables hold: max |p_runtime "
            f"- p_reference| per batch {diffs} > embed_quant.parity_tol={cfg.parity_tol}"
        )
    return diffs


def build_onnx(
    v: Variant,
    model: RankingModel,
    ref: RankingModel,
    tables: dict[str, QTable],
    data: Dataset,
    cfg: EmbedQuantConfig,
    batches,
) -> dict:
    """Writes model.onnx (quantized tables [+ dense INT8]) into the variant dir; returns the report part."""
    work = v.path / "_work"
    work.mkdir(exist_ok=True)
    floats = {f: w.detach().numpy() for f, w in model.tables().items()}
    final = v.path / "model.onnx"
    try:
        fp32 = work / "fp32.onnx"
        export_onnx(model, fp32, data.val.take(slice(0, 8)), cfg.opset, cfg.exporter.value)
        emb = onnx.load(str(fp32))
        gathers = replace_tables(emb, floats, tables)
        onnx.checker.check_model(emb)
        onnx.save(emb, str(work / "emb.onnx"))
        parity = check_parity(ort_scorer(work / "emb.onnx", {}), ref, batches, cfg, "onnxruntime")
        report: dict = {"gathers_rewritten": gathers, "parity_max_abs": parity}
        calib = data.val if cfg.quantize is not None and cfg.quantize.static else None  # as accelerate
        if cfg.dense_int8:
            assert cfg.quantize is not None  # check()
            q = quantize(fp32, work / "int8.onnx", cfg.quantize, calib, work)
            proto = onnx.load(str(work / "int8.onnx"))
            replace_tables(proto, floats, tables)
            onnx.checker.check_model(proto)
            onnx.save(proto, str(final))
            report["quantization"] = q
            report["int8_max_abs"] = {
                k: max_abs_diff(ort_scorer(final, {}), ref, b) for k, b in batches.items()
            }
        else:
            shutil.copyfile(work / "emb.onnx", final)
        if shared := data.schema.shared_columns:

            def transform(src: Path, out: Path) -> None:  # what made model.onnx, on the request graph
                if cfg.dense_int8:
                    assert cfg.quantize is not None  # check()
                    quantize(src, work / "request_int8.onnx", cfg.quantize, calib, work)
                    src = work / "request_int8.onnx"
                proto = onnx.load(str(src))
                replace_tables(proto, floats, tables)
                onnx.checker.check_model(proto)
                onnx.save(proto, str(out))

            report["request_parity_max_abs"] = build_request_graph(
                v, model, data, cfg.opset, cfg.exporter.value, batches, cfg.parity_tol, transform, shared
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    v.add_artifact("onnx", "model.onnx")
    tuning = tune_into(v, final, data.val, cfg.tune)
    if tuning is not None:
        report["tuning"] = tuning
    return report


def summary(
    parent: Variant,
    v: Variant,
    model: RankingModel,
    tables: dict[str, QTable],
    choice: Choice,
    val_rows: int,
    final_auc: float,
    final_drop: float,
) -> dict:
    """Sizes, the sweep and the validation result, as written to embed_quant.json."""
    fp32 = {t.feature: t.num_rows * model.cfg.embedding_dim * 4 for t in model.cfg.tables}
    return {
        "precision": {f: q.precision.value for f, q in tables.items()},
        "tables": {
            f: {"rows": q.rows, "bits": q.precision.bits, "fp32_bytes": fp32[f], "bytes": q.nbytes}
            for f, q in tables.items()
        },
        "emb_fp32_bytes": sum(fp32.values()),
        "emb_bytes": sum(q.nbytes for q in tables.values()),
        "emb_size_ratio": sum(fp32.values()) / sum(q.nbytes for q in tables.values()),
        "model_file_mb": {"parent": parent.size_mb, "variant": v.size_mb},
        "model_size_ratio": parent.size_mb / v.size_mb,
        "val": {
            "rows": val_rows,
            "parent_auc": choice.parent_auc,
            "auc": final_auc,
            "rel_drop": final_drop,
            "tables_only_rel_drop": choice.mix_drop,
        },
        "solo": {f: {p: vars(pt) for p, pt in by_p.items()} for f, by_p in choice.solo.items()},
        "mix": [vars(pt) for pt in choice.mix],
    }


def metrics(report: dict, choice: Choice, cfg: EmbedQuantConfig) -> dict[str, float]:
    """The variant's metrics (README's metric names, `emb_*`)."""
    lowest = min(cfg.precisions, key=lambda p: p.bits).value
    m = {
        "emb_size_ratio": report["emb_size_ratio"],
        "model_size_ratio": report["model_size_ratio"],
        "emb_mb": report["emb_bytes"] / 2**20,
        "emb_fp32_mb": report["emb_fp32_bytes"] / 2**20,
        "emb_val_auc_parent": choice.parent_auc,
        "emb_val_auc": report["val"]["auc"],
        "emb_val_auc_rel_drop": report["val"]["rel_drop"],
        "emb_tables_val_auc_rel_drop": choice.mix_drop,
        "emb_sweep_points": float(sum(len(s) for s in choice.solo.values()) + len(choice.mix)),
        "emb_sweep_seconds": report["sweep_seconds"],
    }
    for f, p in choice.precision.items():
        m[f"emb_{f}_bits"] = float(p.bits)
        m[f"emb_{f}_val_auc_drop"] = choice.solo[f][p.value].rel_drop
        if lowest in choice.solo[f]:
            m[f"emb_{f}_sens_drop"] = choice.solo[f][lowest].rel_drop
    for k, d in report["parity_max_abs"].items():
        m[f"emb_parity_max_abs_{k}"] = d
    if "quantization" in report:
        q = report["quantization"]
        m.update(quantized_matmuls=float(q["quantized_matmuls"]), float_matmuls=float(q["float_matmuls"]))
    return m
