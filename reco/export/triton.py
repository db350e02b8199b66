"""Write an ONNX Runtime variant as a Triton Inference Server model repository.

    python -m reco.cli.export_triton --variant DIR --out DIR [--name NAME] [key=value ...]

writes OUT/NAME/config.pbtxt and OUT/NAME/1/model.onnx, which a Triton deployment with the ONNX
Runtime backend (`platform: "onnxruntime_onnx"`) loads as is. The config says what reco measured:
- inputs/outputs: names, data types and per-row dims read from the graph (Triton owns axis 0, the
  batch, which reco's export leaves dynamic). A tensor the batch fully describes (`probs` [B]) is
  `dims: [ 1 ]` + `reshape: { shape: [ ] }`, Triton's documented form for it.
- dynamic_batching: max_batch_size and the queue delay follow serve.batching (a batching variant's own
  runtime.batching first, as reco's server does). A batch row is one candidate; Triton rejects a request
  of more rows than max_batch_size (reco's batcher runs it alone), so it must hold serve.max_candidates.
- instance_group: serve.workers CPU instances (each reco worker holds its own copy of the model).
- the ORT session reco's runtime builds for this variant (the accelerate step's tuned runtime["ort"],
  else serve.intra_op_threads), as the ORT backend's model-config keys `intra_op_thread_count`,
  `inter_op_thread_count`, `execution_mode` and `optimization.graph.level` (onnxruntime_backend README
  and src/onnxruntime.cc). reco also turns ORT's thread spinning off; the backend has no key for that.
model.onnx is copied only when its SHA-256 matches the variant's record, and the copy is checked again.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import onnx
from omegaconf import MISSING
from onnx import TensorProto

from reco.config import ConfigError
from reco.runtime import ort_session_options
from reco.variant import ArtifactError, Variant, atomic_write, sha256_file

PLATFORM = "onnxruntime_onnx"
VERSION = "1"  # Triton's version directory; one version per export
READABLE = 0o644  # temp files are made 0600; Triton's container runs as a non-root user
# ONNX element type -> Triton data type (Triton's model_config.proto DataType; its datatypes table).
TRITON_TYPES = {
    TensorProto.BOOL: "TYPE_BOOL",
    TensorProto.UINT8: "TYPE_UINT8",
    TensorProto.UINT16: "TYPE_UINT16",
    TensorProto.UINT32: "TYPE_UINT32",
    TensorProto.UINT64: "TYPE_UINT64",
    TensorProto.INT8: "TYPE_INT8",
    TensorProto.INT16: "TYPE_INT16",
    TensorProto.INT32: "TYPE_INT32",
    TensorProto.INT64: "TYPE_INT64",
    TensorProto.FLOAT16: "TYPE_FP16",
    TensorProto.FLOAT: "TYPE_FP32",
    TensorProto.DOUBLE: "TYPE_FP64",
    TensorProto.STRING: "TYPE_STRING",
    TensorProto.BFLOAT16: "TYPE_BF16",
}
# ORT graph optimisation level -> the backend's optimization.graph.level (src/onnxruntime.cc reads
# -1 BASIC, 1 EXTENDED, 2 DISABLE_ALL; anything else, or no entry, is ENABLE_ALL: None = write none).
GRAPH_LEVELS = {
    "ORT_ENABLE_ALL": None,
    "ORT_ENABLE_EXTENDED": 1,
    "ORT_ENABLE_BASIC": -1,
    "ORT_DISABLE_ALL": 2,
}
EXECUTION_MODES = {"ORT_SEQUENTIAL": "0", "ORT_PARALLEL": "1"}


class TritonExportError(ValueError):
    """The variant cannot be written as a Triton model; the message names the variant and the reason."""


@dataclass
class TritonExportConfig:
    """conf/export/triton.yaml (override as export.triton.<key>; the CLI takes <key>=value)."""

    max_batch_size: int = MISSING  # rows (candidates) per model call; also the largest request Triton accepts
    max_queue_delay_ms: float = MISSING  # longest a request waits for company (written in microseconds)
    preferred_batch_sizes: list[int] = MISSING  # empty: batches as large as possible, no preferred size
    instance_count: int = MISSING  # KIND_CPU model instances, as reco's worker processes
    intra_op_threads: int = MISSING  # ORT intra-op threads per instance when the variant's tuning set none
    max_request_rows: int = MISSING  # the largest request clients send (candidate rows)

    def check(self, where: str = "export.triton") -> None:
        """Raises ConfigError naming export.triton.<key> for a value Triton would refuse or misapply."""
        w = where
        if self.max_batch_size < 1:
            raise ConfigError(
                f"{w}.max_batch_size must be >= 1 (rows per model call), got {self.max_batch_size}"
            )
        if self.max_request_rows > self.max_batch_size:
            raise ConfigError(
                f"{w}.max_batch_size={self.max_batch_size} is below {w}.max_request_rows={self.max_request_rows}: "
                "Triton rejects a request of more rows than max_batch_size"
            )
        bad = [b for b in self.preferred_batch_sizes if not 1 <= b <= self.max_batch_size]
        if bad:
            raise ConfigError(
                f"{w}.preferred_batch_sizes {bad} must lie in [1, max_batch_size={self.max_batch_size}]"
            )
        if self.max_queue_delay_ms < 0:
            raise ConfigError(f"{w}.max_queue_delay_ms must be >= 0, got {self.max_queue_delay_ms}")
        if self.instance_count < 1 or self.intra_op_threads < 0:
            raise ConfigError(
                f"{w}.instance_count must be >= 1 and {w}.intra_op_threads >= 0 (0: ORT's default), got "
                f"{self.instance_count} and {self.intra_op_threads}"
            )


@dataclass
class TensorSpec:
    """One input or output as Triton sees it: per-row dims, the batch axis left out."""

    name: str
    data_type: str  # Triton's TYPE_*
    dims: list[int]  # -1 for a dynamic axis
    reshape: bool = False  # the model's tensor is [B]: dims [1] reshaped to [] (Triton needs non-empty dims)


def graph_tensors(proto: onnx.ModelProto, where: str) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The graph's inputs (initializers excluded) and outputs as Triton tensors.

    Args:
        proto: the ONNX model.
        where: what to name in errors (the variant and its file).
    Returns:
        (inputs, outputs) in graph order.
    """
    weights = {t.name for t in proto.graph.initializer}
    inputs = [_spec(i, where) for i in proto.graph.input if i.name not in weights]
    return inputs, [_spec(o, where) for o in proto.graph.output]


def _spec(vi: onnx.ValueInfoProto, where: str) -> TensorSpec:
    t = vi.type.tensor_type
    if not vi.type.HasField("tensor_type") or not t.HasField("shape"):
        raise TritonExportError(f"{where}: graph tensor {vi.name!r} is not a tensor of known rank")
    if t.elem_type not in TRITON_TYPES:
        kind = TensorProto.DataType.Name(t.elem_type)
        raise TritonExportError(
            f"{where}: graph tensor {vi.name!r} has type {kind}, which Triton has no type for"
        )
    shape = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
    if not shape or shape[0] != -1:
        raise TritonExportError(
            f"{where}: graph tensor {vi.name!r} has shape {shape}; Triton's batching needs a dynamic axis 0"
        )
    rows = shape[1:]
    return TensorSpec(vi.name, TRITON_TYPES[t.elem_type], rows or [1], not rows)


def ort_parameters(settings: dict, threads: int, where: str) -> tuple[int | None, dict[str, str]]:
    """The ORT session reco builds for a variant (reco.runtime.ort_session_options) in the backend's terms.

    Args:
        settings: the variant's runtime["ort"] (the accelerate step's tuned choice; {} = defaults).
        threads: intra-op threads when `settings` sets none (as serve.intra_op_threads does for reco).
        where: what to name in errors.
    Returns:
        (optimization.graph.level, None for ORT's ENABLE_ALL default; model-config parameters).
    """
    try:
        so = ort_session_options(settings, threads)
    except AttributeError as e:  # a misspelled enum name in the recorded settings
        raise TritonExportError(f"{where}: runtime.ort {settings} is not a valid ORT setting ({e})") from None
    level = so.graph_optimization_level.name
    if level not in GRAPH_LEVELS:
        raise TritonExportError(
            f"{where}: runtime.ort graph_optimization_level {level} has no Triton equivalent "
            f"(optimization.graph.level knows {sorted(GRAPH_LEVELS)})"
        )
    params = {
        "intra_op_thread_count": str(so.intra_op_num_threads),
        "inter_op_thread_count": str(so.inter_op_num_threads),
        "execution_mode": EXECUTION_MODES[so.execution_mode.name],
    }
    return GRAPH_LEVELS[level], params


def render(
    name: str,
    v: Variant,
    cfg: TritonExportConfig,
    tensors: tuple[list[TensorSpec], list[TensorSpec]],
    ort: tuple[int | None, dict[str, str]],
) -> str:
    """config.pbtxt text (protobuf text format of Triton's ModelConfig)."""

    def block(kind: str, specs: list[TensorSpec]) -> list[str]:
        items = []
        for s in specs:
            lines = [
                "  {",
                f"    name: {_quote(s.name)}",
                f"    data_type: {s.data_type}",
                f"    dims: [ {', '.join(map(str, s.dims))} ]",
            ]
            lines += ["    reshape: { shape: [ ] }"] if s.reshape else []
            items.append("\n".join([*lines, "  }"]))
        return [f"{kind} [", ",\n".join(items), "]"]

    level, params = ort
    batching = ["dynamic_batching {"]
    if cfg.preferred_batch_sizes:
        batching.append(f"  preferred_batch_size: [ {', '.join(map(str, cfg.preferred_batch_sizes))} ]")
    batching += [f"  max_queue_delay_microseconds: {round(cfg.max_queue_delay_ms * 1000)}", "}"]
    lines = [
        f"# reco variant {v.name!r} (step {v.step}, parent {v.parent}); model.onnx SHA-256 {v.sha256['onnx']}",
        "# written by `python -m reco.cli.export_triton`: batching and ORT threads as reco serves this variant",
        f"name: {_quote(name)}",
        f"platform: {_quote(PLATFORM)}",
        f"max_batch_size: {cfg.max_batch_size}",
        *block("input", tensors[0]),
        *block("output", tensors[1]),
        *batching,
        "instance_group [",
        "  {",
        f"    count: {cfg.instance_count}",
        "    kind: KIND_CPU",
        "  }",
        "]",
    ]
    if level is not None:
        lines.append(f"optimization {{ graph: {{ level: {level} }} }}")
    lines += [
        f"parameters {{ key: {_quote(k)} value: {{ string_value: {_quote(val)} }} }}"
        for k, val in params.items()
    ]
    return "\n".join(lines) + "\n"


def _quote(text: str) -> str:
    """A protobuf text-format string literal."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def write_model_repository(
    variant_dir: str | Path, out_dir: str | Path, name: str | None, cfg: TritonExportConfig
) -> Path:
    """Write OUT/NAME/config.pbtxt and OUT/NAME/1/model.onnx for an onnxruntime variant.

    Args:
        variant_dir: the variant directory (holds variant.json).
        out_dir: the model repository (created if missing; other models in it are left alone).
        name: the Triton model name (its directory); None: the variant's name.
        cfg: export settings (`python -m reco.cli.export_triton` gives the ones reco's server would use).
    Returns:
        OUT/NAME.
    Raises:
        TritonExportError for a variant Triton's ONNX Runtime backend cannot serve as it is, ArtifactError
        for a missing or altered model.onnx, ConfigError for settings Triton would refuse.
    """
    cfg.check()
    v = Variant.load(variant_dir)
    if v.backend != "onnxruntime":
        raise TritonExportError(
            f"variant {v.name!r} ({v.dir}) has backend {v.backend!r}; Triton's ONNX Runtime backend needs an "
            "ONNX graph: export it with the accelerate step first (accelerate.mode=onnx_fp32 or onnx_int8, "
            "e.g. a variant-graph node {step: accelerate, parent: <this variant>}) and pass that variant's directory"
        )
    name = name or v.name
    if not name or name != Path(name).name or name in (".", ".."):
        raise TritonExportError(f"--name {name!r}: a Triton model name must be a plain directory name")
    src = v.verify("onnx")
    where = f"variant {v.name!r} {src}"
    proto = onnx.load(str(src), load_external_data=False)
    if any(t.data_location == TensorProto.EXTERNAL for t in proto.graph.initializer):
        raise TritonExportError(
            f"{where}: weights in external data files are not exported; expected one file"
        )
    text = render(
        name,
        v,
        cfg,
        graph_tensors(proto, where),
        ort_parameters(v.runtime.get("ort", {}), cfg.intra_op_threads, where),
    )
    model_dir = Path(out_dir) / name
    _copy_verified(src, model_dir / VERSION / "model.onnx", v.sha256["onnx"], where)
    atomic_write(model_dir / "config.pbtxt", text).chmod(READABLE)
    return model_dir


def _copy_verified(src: Path, dst: Path, digest: str, where: str) -> None:
    """Copy to a temporary file beside `dst`, check its SHA-256, then rename it over `dst`."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".tmp")
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        got = sha256_file(tmp)
        if got != digest:
            raise ArtifactError(f"{where}: the copy at {dst} has SHA-256 {got}, expected {digest}")
        os.chmod(tmp, READABLE)
        os.replace(tmp, dst)
    finally:
        Path(tmp).unlink(missing_ok=True)
