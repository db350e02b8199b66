"""The step registry: name -> (function, config schema, what its cache key covers)."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib
import inspect
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from reco.data.schema import Dataset
from reco.train.loop import TrainConfig
from reco.variant import Backend, Variant


class StepError(ValueError):
    """A step cannot run with this parent/config; the message names the step, the override key and why."""


@dataclass
class StepRun:
    """Where and how one step runs.

    name:      the child variant's name (its key in the variant graph)
    out_dir:   the child's own directory (created by child_variant)
    trainer:   the experiment's trainer settings (steps that train derive their budget from them)
    on_epoch:  called as on_epoch(epoch, {"train_loss", "val_auc", ...}) by steps that train
    """

    name: str
    out_dir: Path
    trainer: TrainConfig
    on_epoch: Callable[[int, dict[str, float]], None] | None = None


StepFn = Callable[[Variant | None, Dataset, Any, StepRun], Variant]


@dataclass(frozen=True)
class StepSpec:
    """A registered step.

    config_key: the top-level config section holding its defaults (`prune`, `distill`, ...; `model` for
                the train step, whose settings are the model's).
    root:       True for a step that starts a graph (no parent).
    trains:     True when the trainer settings shape the result (they enter the cache key).
    code:       SHA-256 of the step's module source, in the cache key: changed code rebuilds its variants.
    """

    name: str
    fn: StepFn
    config: type
    config_key: str
    root: bool
    trains: bool
    code: str


_REGISTRY: dict[str, StepSpec] = {}


def register(
    name: str, config: type, *, config_key: str | None = None, root: bool = False, trains: bool = False
) -> Callable[[StepFn], StepFn]:
    """Decorator registering a step function under `name` (see the package docstring)."""

    def deco(fn: StepFn) -> StepFn:
        _REGISTRY[name] = StepSpec(name, fn, config, config_key or name, root, trains, _code_hash(fn, trains))
        return fn

    return deco


def _code_hash(fn: StepFn, trains: bool) -> str:
    """The step's source (its whole package when it is one), the model code every model shares, and for a
    step that trains the trainer (reco/train: a fix there, e.g. to distributed training, must rebuild what
    it trained). The chosen model's own module enters the root variant's key (reco.graph.cache_key), hence
    every key."""
    src = Path(inspect.getsourcefile(fn) or "")
    files = sorted(src.parent.glob("*.py")) if src.name == "__init__.py" else [src]
    reco = Path(__file__).resolve().parents[1]
    files += [reco / "models" / "protocol.py", reco / "models" / "embedding.py"]
    if trains:
        files += sorted((reco / "train").glob("*.py"))
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def plain(cfg: Any) -> Any:
    """A typed step config as JSON-able data (Enums by name), as recorded in variant.json."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, Enum):
        return cfg.name
    if isinstance(cfg, dict):
        return {k: plain(v) for k, v in cfg.items()}
    if isinstance(cfg, list | tuple):
        return [plain(v) for v in cfg]
    return cfg


def steps() -> dict[str, StepSpec]:
    """Every step of the reco.steps package (importing each module registers it)."""
    for mod in pkgutil.iter_modules([str(Path(__file__).parent)]):  # by path: no import of the package
        importlib.import_module(f"{__package__}.{mod.name}")
    return dict(_REGISTRY)


def get_step(name: str) -> StepSpec:
    known = steps()
    if name not in known:
        raise StepError(f"step {name!r} is not registered (known steps: {sorted(known)})")
    return known[name]


def require_artifact(parent: Variant, role: str, step: str) -> None:
    if role not in parent.artifacts:
        raise StepError(
            f"{step}: parent variant {parent.name!r} (backend {parent.backend}) has no {role!r} artifact "
            f"(has {sorted(parent.artifacts)}); {step} needs the parent's {role} model"
        )


def child_variant(
    parent: Variant | None, data: Dataset, cfg: Any, ctx: StepRun, step: str, backend: Backend
) -> Variant:
    """An empty child record in `ctx.out_dir` with lineage filled in.

    Args:
        parent: the variant the step starts from (None for a root step such as train).
        cfg: the step's typed config (recorded as plain data in the child's step_config).
    """
    out_dir = Path(ctx.out_dir)
    if parent is not None and parent.dir and out_dir.resolve() == Path(parent.dir).resolve():
        raise StepError(f"{step}: out_dir {out_dir} is the parent's directory; a step never writes there")
    out_dir.mkdir(parents=True, exist_ok=True)
    v = Variant(
        name=ctx.name,
        step=step,
        parent=parent.name if parent else None,
        backend=backend,
        model_config=copy.deepcopy(parent.model_config) if parent else {},
        dir=str(out_dir),
        step_config=plain(cfg),
        data_fingerprint=data.fingerprint,
    )
    if parent is not None:
        v.model_target = parent.model_target
    return v
