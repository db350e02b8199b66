"""The `batching` step: the parent's model unchanged, served with dynamic batching switched on.

A separate variant so the report can attribute what request coalescing buys on its own. Its settings
default to the serve config's `batching` block (conf/step/batching.yaml interpolates them), so there is
one place to change the batcher; a variant may still override them in the variant graph.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

from omegaconf import MISSING

from reco.data.schema import Dataset
from reco.steps.registry import StepRun, child_variant, register
from reco.variant import Variant


@dataclass
class BatchingStepConfig:
    max_batch: int = MISSING  # candidate rows per coalesced model call
    max_queue_delay_ms: float = MISSING  # longest a block waits for company before its call goes out


@register("batching", BatchingStepConfig)
def run(parent: Variant | None, data: Dataset, cfg: BatchingStepConfig, ctx: StepRun) -> Variant:
    """A copy of the parent's artifacts whose runtime turns the server's dynamic batcher on.

    Returns:
        The child variant; runtime["batching"] = {"enabled": True, "max_batch", "max_queue_delay_ms"}.
    """
    assert parent is not None
    child = child_variant(parent, data, cfg, ctx, "batching", parent.backend)
    child.model_config = dict(parent.model_config)
    child.params, child.flops_per_candidate = parent.params, parent.flops_per_candidate
    child.runtime = {**parent.runtime, "batching": {"enabled": True, **child.step_config}}
    for role in parent.artifacts:
        src = parent.verify(role)
        shutil.copy2(src, child.path / src.name)
        child.add_artifact(role, src.name)
    return child
