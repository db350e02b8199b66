"""The `batching` step: the parent's model unchanged, served with dynamic batching switched on.

A separate variant so the report can attribute what request coalescing buys on its own.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

from reco.variant import Variant


def run(parent: Variant, cfg: dict, out_dir: Path, name: str) -> Variant:
    out_dir.mkdir(parents=True, exist_ok=True)
    child = replace(
        parent,
        name=name,
        step="batching",
        parent=parent.name,
        dir=str(out_dir),
        step_config=dict(cfg),
        artifacts={},
        sha256={},
        metrics={},
        mlflow_run_id="",
        runtime={**parent.runtime, "batching": {"enabled": True, **cfg}},
    )
    for role in parent.artifacts:
        src = parent.verify(role)
        shutil.copy2(src, out_dir / src.name)
        child.add_artifact(role, src.name)
    child.save()
    return child
