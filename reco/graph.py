"""The experiment's variant graph: which step builds which variant from which parent, in build order.

`variants` (a conf/variants/ group chosen by the preset) maps a name to `{step, parent, ...overrides}`;
each node's typed step config is the step's defaults (`cfg[<config_key>]`, schema-checked by Hydra)
merged with those overrides. Finished variants are cached under a content hash of everything that
shapes them (see `cache_key`).
"""

from __future__ import annotations

import hashlib
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from reco.config import ConfigError, typed
from reco.models.protocol import resolve
from reco.steps import StepSpec, steps
from reco.steps.registry import plain

# Bump when the layout of a cached variant changes in a way old caches cannot serve.
CACHE_VERSION = 2


@dataclass
class Node:
    """One entry of the variant graph (immutable plan; what became of it is the pipeline's business)."""

    name: str
    spec: StepSpec
    parent: str | None
    config: Any  # the step's typed config (spec.config instance)

    @property
    def step(self) -> str:
        return self.spec.name


def plan(cfg: dict[str, Any]) -> list[Node]:
    """Validate `variants` of the resolved config (reco.config.resolved) and order it parents-first.

    Raises:
        ConfigError naming `variants.<name>.<field>` for an unknown step, a missing parent, a cycle or
        a step setting the step's schema rejects.
    """
    specs = cfg.get("variants") or {}
    if not specs:
        raise ConfigError(
            "variants: the experiment defines no variants (expected at least {baseline: {step: train}})"
        )
    known = steps()
    nodes: dict[str, Node] = {}
    for name, raw in specs.items():
        raw = dict(raw or {})
        step, parent = raw.pop("step", None), raw.pop("parent", None)
        if step not in known:
            raise ConfigError(f"variants.{name}.step: expected one of {sorted(known)}, got {step!r}")
        spec = known[step]
        if spec.root and parent:
            raise ConfigError(
                f"variants.{name}.parent: a {step} step starts the graph (got parent {parent!r})"
            )
        if not spec.root and parent not in specs:
            raise ConfigError(
                f"variants.{name}.parent: {parent!r} is not a variant of this experiment (have {sorted(specs)})"
            )
        nodes[name] = Node(name, spec, parent, step_config(cfg, spec, raw, f"variants.{name}"))
    order: list[Node] = []
    state: dict[str, int] = {}

    def visit(n: str, path: tuple[str, ...]) -> None:
        if state.get(n) == 2:
            return
        if state.get(n) == 1:
            raise ConfigError(f"variants: cycle through {' -> '.join((*path, n))}")
        state[n] = 1
        if nodes[n].parent:
            visit(nodes[n].parent, (*path, n))
        state[n] = 2
        order.append(nodes[n])

    for n in nodes:
        visit(n, ())
    return order


def step_config(cfg: dict[str, Any], spec: StepSpec, overrides: dict, where: str) -> Any:
    """The step's defaults (`cfg[spec.config_key]` of the resolved config) merged with `overrides`, as its
    typed config.

    Raises:
        ConfigError naming `where.<key>` for an unknown key or a value of the wrong type.
    """
    merged = OmegaConf.merge(OmegaConf.create(cfg[spec.config_key]), OmegaConf.create(overrides))
    schema = spec.config
    if hasattr(schema, "schema_for"):  # the train step: the schema of the model `_target_` names
        schema = schema.schema_for(merged, where)
    try:  # typed runs the schema's range checks (check) before anything slow runs
        return typed(merged, schema, where)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None


def model_code(target: str) -> str:
    """SHA-256 (12 hex) of the source file of the model class `target` (resolved: allow-listed)."""
    path = inspect.getsourcefile(resolve(target, "model._target_"))
    return hashlib.sha256(Path(path or "").read_bytes()).hexdigest()[:12]


def cache_key(node: Node, parent_key: str | None, data_fingerprint: str, trainer: Any) -> str:
    """Content hash of what shapes the variant: step + its code, step config, parent, data, and the
    trainer settings for steps that train (minus settings that only change how progress is shown)."""
    src: dict = {
        "v": CACHE_VERSION,
        "step": node.step,
        "code": node.spec.code,
        "cfg": plain(node.config),
        "parent": parent_key,
        "data": data_fingerprint,
    }
    if target := getattr(node.config, "_target_", None):  # the model's own code (reco/models/<name>.py)
        src["model_code"] = model_code(target)
    if node.spec.trains:
        t = {k: v for k, v in plain(trainer).items() if k not in ("progress", "checkpoint_dir")}
        # One process trains as before whatever the distributed block says; over several, where the
        # ranks meet, how long they wait and which host this is do not change the model.
        dist = t.pop("distributed", None) or {}
        if dist.get("nproc", 1) * dist.get("nnodes", 1) > 1:
            meeting = ("timeout_s", "master_addr", "master_port", "join_timeout_s", "node_rank")
            t["distributed"] = {k: v for k, v in dist.items() if k not in meeting}
        src["trainer"] = t
    return hashlib.sha256(json.dumps(src, sort_keys=True, default=str).encode()).hexdigest()[:16]
