"""The `triton` step: the parent's model unchanged, served by Triton Inference Server instead of reco's server.

A separate variant, like `batching`, so one study (and one report) sets the same model side by side on
both servers: the seed's claim that an inference server's concurrency features (instances, dynamic
batching) lift throughput, measured against reco's own server. The study starts this variant's server
with serve.backend=triton and these settings (reco.serve.config.for_variant); everything else in `serve`
applies as for any variant. Serving it needs `.venv-triton` (`make triton-venv`).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

from omegaconf import MISSING

from reco.data.schema import Dataset
from reco.steps.registry import StepError, StepRun, child_variant, register
from reco.variant import Variant


@dataclass
class TritonStepConfig:
    instances: int = MISSING  # Triton model instances (instance_group count): executions at once
    batching: bool = MISSING  # Triton's dynamic batcher on
    max_queue_delay_ms: float = MISSING  # with batching: longest a request waits for company


@register("triton", TritonStepConfig)
def run(parent: Variant | None, data: Dataset, cfg: TritonStepConfig, ctx: StepRun) -> Variant:
    """A copy of the parent's artifacts whose runtime asks for Triton.

    Returns:
        The child; runtime["server"] = {"backend": "triton", "instances"}, runtime["batching"] = the batcher.
    """
    assert parent is not None
    if cfg.instances < 1:
        raise StepError(f"triton: instances: expected >= 1, got {cfg.instances}")
    child = child_variant(parent, data, cfg, ctx, "triton", parent.backend)
    child.model_config = dict(parent.model_config)
    child.params, child.flops_per_candidate = parent.params, parent.flops_per_candidate
    batching = {"enabled": cfg.batching, "max_queue_delay_ms": cfg.max_queue_delay_ms}
    child.runtime = {
        **parent.runtime,
        "server": {"backend": "triton", "instances": cfg.instances},
        "batching": {**parent.runtime.get("batching", {}), **batching},
    }
    for role in parent.artifacts:
        src = parent.verify(role)
        shutil.copy2(src, child.path / src.name)
        child.add_artifact(role, src.name)
    return child
