"""Optimization steps: each turns a parent Variant into a child Variant.

Every step module exposes the same entry point::

    run(parent: Variant, data: Dataset, cfg: dict, out_dir: Path, trainer: TrainConfig, name: str) -> Variant

`cfg` is the step's resolved config: the defaults in ``conf/step/<step>.yaml`` merged with the
variant's overrides (`load_step_config` does that merge for callers without Hydra, e.g. tests).
A step writes only into `out_dir`; the parent's directory is never touched.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any, TypeVar

import yaml

from reco.data.schema import Dataset
from reco.variant import Backend, Variant

CONF_DIR = Path(__file__).resolve().parents[2] / "conf" / "step"

T = TypeVar("T")


class StepError(ValueError):
    """A step cannot run with this parent/config; the message names the step, the field and why."""


def load_step_config(step: str, overrides: dict | None = None) -> dict:
    """conf/step/<step>.yaml deep-merged with `overrides` (what Hydra composes for the pipeline)."""
    path = CONF_DIR / f"{step}.yaml"
    if not path.exists():
        raise StepError(f"step: no config file {path} for step {step!r}")
    return deep_merge(yaml.safe_load(path.read_text()) or {}, overrides or {})


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_config(cls: type[T], cfg: dict, where: str) -> T:
    """Build the step's config dataclass; unknown or missing keys are user errors, not TypeErrors.

    Nested dataclass fields are parsed recursively (null stays None); `where` is the config path for messages
    (e.g. "step.prune" or "step.accelerate.quantize").
    """
    if not isinstance(cfg, dict):
        raise StepError(f"{where}: expected a mapping, got {type(cfg).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(cfg) - set(fields))
    missing = sorted(set(fields) - set(cfg))
    if unknown or missing:
        raise StepError(
            f"{where}: unknown keys {unknown} / missing keys {missing} (expected {sorted(fields)}; "
            f"defaults live in {CONF_DIR}/)"
        )
    kwargs: dict[str, Any] = {}
    for k, f in fields.items():
        sub = f.metadata.get("cls")
        kwargs[k] = parse_config(sub, cfg[k], f"{where}.{k}") if sub and cfg[k] is not None else cfg[k]
    return cls(**kwargs)


def nested(cls: type) -> Any:
    """Field marker for a nested config dataclass (parsed by `parse_config`)."""
    return dataclasses.field(metadata={"cls": cls})


def require_artifact(parent: Variant, role: str, step: str) -> None:
    if role not in parent.artifacts:
        raise StepError(
            f"{step}: parent variant {parent.name!r} (backend {parent.backend}) has no {role!r} artifact "
            f"(has {sorted(parent.artifacts)}); {step} needs the parent's {role} model"
        )


def child_variant(
    parent: Variant, data: Dataset, cfg: dict, out_dir: Path, name: str, step: str, backend: Backend
) -> Variant:
    """An empty child record in `out_dir` with lineage filled in."""
    out_dir = Path(out_dir)
    if parent.dir and out_dir.resolve() == Path(parent.dir).resolve():
        raise StepError(f"{step}: out_dir {out_dir} is the parent's directory; a step never writes there")
    out_dir.mkdir(parents=True, exist_ok=True)
    return Variant(
        name=name,
        step=step,
        parent=parent.name,
        backend=backend,
        model_config=copy.deepcopy(parent.model_config),
        dir=str(out_dir),
        step_config=copy.deepcopy(cfg),
        data_fingerprint=data.fingerprint,
    )
