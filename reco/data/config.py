"""The schema of the `data` config group (conf/data/*.yaml).

A data YAML states only what differs from its base: `defaults: [table, _self_]` takes every key of
conf/data/table.yaml (which lists `schema` itself), so a key added to a loader later keeps its
documented value in files written before it. A base leaves `???` where every dataset differs (the
table's path, label and columns); `check_set` names those a config left unset.

Only the loader's name and a mapping of its parameters are checked at compose time; each loader types
its own `params` with its dataclass (SyntheticConfig, MovieLensConfig, CriteoConfig, TableConfig) when
the dataset is built, so an unknown or mistyped key fails naming `data.params.<key>`.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from reco.config import ConfigError, typed


@dataclass
class DataConfig:
    # synthetic_ecommerce | movielens | criteo | table (reco.data.LOADERS)
    loader: str = MISSING
    # the loader's parameters, typed by the loader's own dataclass
    params: dict[str, Any] = MISSING


def data_config(node: Any) -> DataConfig:
    """`node` (the `data` group as composed: a DictConfig, resolved against its whole config, or a dict) as
    a DataConfig whose params are a plain dict; for entry points, once. Every `???` is named at once
    (typing would name only the first)."""
    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=True)
    if isinstance(node, Mapping) and isinstance(node.get("params"), Mapping):
        check_set(str(node.get("loader")), node["params"])
    return typed(node, DataConfig, "data")


def check_set(loader: str, params: Mapping[str, Any]) -> None:
    """Raise ConfigError naming every `data.params.<key>` still `???` (a base's value to be stated)."""
    unset = [k for k, v in params.items() if isinstance(v, str) and v == "???"]
    if not unset:
        return
    keys = ", ".join(f"data.params.{k}" for k in unset)
    if loader == "table":
        raise ConfigError(
            f"{keys}: not set (??? in conf/data/table.yaml, the base of a table data config, not a dataset): "
            "write conf/data/<name>.yaml with `defaults: [table, _self_]` and your file's path, label, dense "
            "and sparse columns (conf/data/table_example.yaml is one), or set them on the command line "
            "(data.params.path=...)"
        )
    raise ConfigError(f"{keys}: not set (???): state each in your data YAML or on the command line")
