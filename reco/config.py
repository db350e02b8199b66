"""The bottom of reco's layers: configuration errors and `typed`, the one way a config section becomes
its schema dataclass. Nothing here imports another reco module (import-linter checks it).

Composition (Hydra, the schema index) lives on the top floor, in reco.cli.compose: library code receives
its typed section and never composes a config itself.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range; the message names the override key."""


def resolve_config(cfg: DictConfig) -> dict[str, Any]:
    """The composed config as plain data, every interpolation resolved, `hydra` left out: resolved once
    at the entry point; each section is typed from it (reco.experiment.experiment_config)."""
    out = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(out, dict)
    out.pop("hydra", None)
    return out


def typed(node: Any, cls: type[T], where: str) -> T:
    """`node` (a DictConfig / dict section, or already a `cls`) as a checked instance of its schema `cls`.

    Unknown keys, missing values and wrong types raise ConfigError naming `where.<key>`. The one
    validation hook: every dataclass in the result (nested ones and dict values included, innermost
    first) that defines `check(self, where)` gets it called with its own key, for the range checks the
    types cannot express; it raises ConfigError naming `where.<key>`.
    """
    if not isinstance(node, cls):
        try:
            if isinstance(node, DictConfig):  # resolve against its own root before it is detached
                node = OmegaConf.to_container(node, resolve=True)
            merged = OmegaConf.merge(OmegaConf.structured(cls), node)
            node = OmegaConf.to_object(merged)
        except OmegaConfBaseException as e:
            raise ConfigError(f"{where}: {describe(e)}") from None
    _check_tree(node, where)
    return node  # type: ignore[return-value]


def _check_tree(obj: Any, where: str) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _check_tree(v, f"{where}.{k}")
        return
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        return
    for f in dataclasses.fields(obj):
        _check_tree(getattr(obj, f.name), f"{where}.{f.name}")
    check = getattr(obj, "check", None)
    if callable(check):
        check(where)


def describe(e: OmegaConfBaseException) -> str:
    """An OmegaConf error as `<full key>: <first line of its message>`."""
    key = getattr(e, "full_key", None)
    msg = str(e).splitlines()[0]
    return f"{key}: {msg}" if key else msg
