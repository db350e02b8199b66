"""Where the rank time goes: one ranking call per variant profiled and split into model stages.

Stages (per call, ms): `embedding` (id mapping, table gathers, pooling), `interaction` (what the model's
head does besides its MLPs: DLRM's pairwise dots, DCN's cross net), `mlp` (the protocol's `mlps()`:
bottom and top), `other` (the sigmoid and the runtime's own overhead). The trace is the runtime's own:
a PyTorch profiler Chrome trace (torch) or an ONNX Runtime profile (onnxruntime), both open in
chrome://tracing or Perfetto.

How stages are found, without changing the model:
- torch: profiler ranges around `embed_plain`, `head` and each MLP (instance-level wrappers and module
  hooks); embedding = embed_plain, interaction = head - MLPs, other = call - embed_plain - head (in the
  request form: broadcasting the request's embeddings to its candidates, the sigmoid).
- onnxruntime: the session's optimized graph (the one whose nodes the profile names): a node whose inputs
  do not depend on `dense` is embedding; a node inside an MLP's module scope (`/bottom/`, `/top/`, as
  torch.onnx names nodes) is mlp; the final Sigmoid and nodes the profile names but the graph lacks are
  other; the rest is interaction.
Backends whose graph is not the protocol's (torch_compile, torch_bf16, torchrec_quant) get the trace and
the total only.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import MISSING

from reco.runtime import ort_session_options
from reco.variant import Variant

STAGES = ("embedding", "interaction", "mlp", "other")


@dataclass
class ProfileConfig:
    """`profile` (conf/config.yaml): per-variant rank-call profile."""

    enabled: bool = MISSING
    calls: int = MISSING  # ranking calls profiled after `warmup` unprofiled ones; stages are per-call means
    warmup: int = MISSING


@dataclass
class RankProfile:
    total_ms: float  # mean wall time of one ranking call while profiled (profiling adds overhead)
    stages_ms: dict[str, float]  # STAGES -> mean ms per call; empty when the backend has no stage split
    trace: Path

    def metrics(self) -> dict[str, float]:
        return {"profile_rank_ms": self.total_ms} | {f"profile_{k}_ms": v for k, v in self.stages_ms.items()}


Block = tuple[np.ndarray, np.ndarray, np.ndarray]  # dense [B, D] f32, ids [B, F, L] i64, mask [B, F, L] f32


def profile_rank(
    v: Variant,
    block: Block,
    out_dir: Path,
    c: ProfileConfig,
    threads: int = 1,
    shared: list[int] | None = None,
) -> RankProfile:
    """Profile `c.calls` ranking calls of `v` on `block` (one request's candidates); write the trace to out_dir.
    With the schema's `shared` columns the call is the request form the service runs (user and context
    embedded once: reco.runtime), else per candidate.

    Returns:
        the per-call total and stage split, and the trace file.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    if v.backend == "onnxruntime":
        return _ort(v, block, out_dir, c, threads, shared)
    if v.backend == "torch":
        return _torch(v, block, out_dir, c, threads, shared)
    from reco.runtime import load_scorer

    scorer = load_scorer(v, threads, shared)
    return _torch_opaque(lambda *b: scorer(*b, [len(b[0])]), block, out_dir, c)


def _torch(
    v: Variant, block: Block, out_dir: Path, c: ProfileConfig, threads: int, shared: list[int] | None
) -> RankProfile:
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    from reco.models.protocol import PlainScorer, RequestScorer, request_groups

    torch.set_num_threads(threads)
    model = v.load_torch().eval()
    open_ranges: list[record_function] = []

    def enter(name: str) -> None:
        r = record_function(name)
        r.__enter__()
        open_ranges.append(r)

    def leave(*_: object) -> None:
        open_ranges.pop().__exit__(None, None, None)

    def ranged(name: str, fn):
        def wrapped(*args, **kwargs):
            with record_function(name):
                return fn(*args, **kwargs)

        return wrapped

    # Instance attributes shadow the class's methods; both scorers call self.embed_plain and self.head.
    model.embed_plain = ranged("reco::embed_plain", model.embed_plain)
    model.head = ranged("reco::head", model.head)
    mlp_names = list(model.mlps())
    for name, m in model.mlps().items():
        m.register_forward_pre_hook(lambda _m, _i, n=name: enter(f"reco::mlp.{n}"))
        m.register_forward_hook(leave)
    args = tuple(torch.from_numpy(a) for a in block)
    if shared:
        scorer = RequestScorer(model, shared).eval()
        args += tuple(torch.from_numpy(a) for a in request_groups([len(block[0])]))
    else:
        scorer = PlainScorer(model).eval()
    with torch.inference_mode():
        for _ in range(c.warmup):
            scorer(*args)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(c.calls):
                with record_function("reco::rank"):
                    scorer(*args)
            total = (time.perf_counter() - t0) * 1000 / c.calls
    ms: dict[str, float] = {}
    for e in prof.events():
        if e.name.startswith("reco::"):
            ms[e.name] = ms.get(e.name, 0.0) + e.cpu_time_total / 1000 / c.calls
    mlp = sum(ms.get(f"reco::mlp.{n}", 0.0) for n in mlp_names)
    head, emb, call = ms["reco::head"], ms["reco::embed_plain"], ms["reco::rank"]
    stages = {"embedding": emb, "interaction": head - mlp, "mlp": mlp, "other": call - emb - head}
    trace = out_dir / "rank_trace.json"
    prof.export_chrome_trace(str(trace))
    return RankProfile(total, stages, trace)


def _torch_opaque(scorer, block: Block, out_dir: Path, c: ProfileConfig) -> RankProfile:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(c.warmup):
        scorer(*block)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(c.calls):
            scorer(*block)
        total = (time.perf_counter() - t0) * 1000 / c.calls
    trace = out_dir / "rank_trace.json"
    prof.export_chrome_trace(str(trace))
    return RankProfile(total, {}, trace)


def _ort(
    v: Variant, block: Block, out_dir: Path, c: ProfileConfig, threads: int, shared: list[int] | None
) -> RankProfile:
    import onnxruntime as ort

    from reco.models.protocol import request_groups
    from reco.runtime import REQUEST_ROLE

    so = ort_session_options(v.runtime.get("ort", {}), threads)
    optimized = out_dir / "optimized.onnx"
    so.optimized_model_filepath = str(optimized)
    so.enable_profiling = True
    so.profile_file_prefix = str(out_dir / "ort_profile")
    request = bool(shared) and REQUEST_ROLE in v.artifacts
    graph = v.verify(REQUEST_ROLE if request else "onnx")
    sess = ort.InferenceSession(str(graph), so, providers=["CPUExecutionProvider"])
    feeds = dict(zip(("dense", "ids", "mask"), block, strict=True))
    if request:
        feeds["first"], feeds["owner"] = request_groups([len(block[0])])
    for _ in range(c.warmup):
        sess.run(None, feeds)
    t0 = time.perf_counter()
    for _ in range(c.calls):
        sess.run(None, feeds)
    total = (time.perf_counter() - t0) * 1000 / c.calls
    trace = Path(sess.end_profiling())
    stage_of = _ort_node_stages(optimized, _mlp_scopes(v))
    events = json.loads(trace.read_text())
    # The trace covers the warm-up calls too: count only the timed ones, as `total` does.
    starts = sorted(e["ts"] for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")
    timed_from = starts[c.warmup] if len(starts) > c.warmup else float("-inf")
    n_calls = c.calls if len(starts) > c.warmup else c.warmup + c.calls
    stages = dict.fromkeys(STAGES, 0.0)
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time") or e["ts"] < timed_from:
            continue
        node = e["name"].removesuffix("_kernel_time")
        stages[stage_of.get(node, "other")] += e["dur"] / 1000
    stages = {k: v_ / n_calls for k, v_ in stages.items()}
    stages["other"] = max(total - sum(stages[s] for s in STAGES if s != "other"), 0.0)
    optimized.unlink(missing_ok=True)
    return RankProfile(total, stages, trace)


def _mlp_scopes(v: Variant) -> list[str]:
    model = v.model_class()(v.model_cfg())
    return [f"/{name}/" for name in model.mlps()]


def _ort_node_stages(path: Path, mlp_scopes: list[str]) -> dict[str, str]:
    """Node name -> stage for the graph at `path` (see the module docstring)."""
    import onnx

    g = onnx.load(str(path), load_external_data=False).graph
    from_dense = {"dense"}
    stage: dict[str, str] = {}
    for n in g.node:  # ONNX nodes are stored in topological order
        dense_dep = any(i in from_dense for i in n.input)
        if dense_dep:
            from_dense.update(n.output)
        if any(s in n.name for s in mlp_scopes):
            stage[n.name] = "mlp"
        elif not dense_dep:
            stage[n.name] = "embedding"
        elif n.op_type == "Sigmoid":
            stage[n.name] = "other"
        else:
            stage[n.name] = "interaction"
    return stage
