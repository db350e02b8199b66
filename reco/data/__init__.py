"""Datasets: every loader returns a `reco.data.schema.Dataset`; `load_dataset` picks one by config.

Imports of the loaders (and of torch) happen on use, so `reco.config` can index `DataConfig` cheaply.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from reco.claim import claim
from reco.data.config import DataConfig

if TYPE_CHECKING:
    from reco.data.schema import Dataset

LOADERS = ("synthetic_ecommerce", "movielens", "criteo", "table")


def build_dataset(cfg: DataConfig) -> Dataset:
    """Build the dataset a `data` config describes.

    Args:
        cfg: the typed `data` group (reco.data.config.data_config types a composed one).
    Returns:
        The loader's `Dataset`. Unknown loader names or params raise naming the `data.*` key.
    """
    from reco.config import typed

    where = "data.params"
    if cfg.loader == "synthetic_ecommerce":
        from reco.data.synthetic import SyntheticConfig, generate

        return generate(typed(cfg.params, SyntheticConfig, where))
    if cfg.loader == "movielens":
        from reco.data.movielens import MovieLensConfig, load_movielens

        return load_movielens(**vars(typed(cfg.params, MovieLensConfig, where)))
    if cfg.loader == "criteo":
        from reco.data.criteo import CriteoConfig, load_criteo

        return load_criteo(**vars(typed(cfg.params, CriteoConfig, where)))
    if cfg.loader == "table":
        from reco.data.table import load_table, table_config

        return load_table(**vars(table_config(cfg.params)))
    raise ValueError(f"data.loader: expected one of {LOADERS}, got {cfg.loader!r}")


def load_dataset(cfg: DataConfig, cache_dir: str | Path) -> tuple[Dataset, Path]:
    """Build the dataset once per distinct data config; later runs (and the server) load the cache.

    Args:
        cfg: the typed `data` group (reco.data.config.data_config types a composed one).
        cache_dir: where `<loader>-<hash>.pt` files live; the hash covers the config and the size and
            mtime of the source files.
    Returns:
        (the dataset, its cache file).
    """
    from reco.data.schema import Dataset

    plain = {"loader": cfg.loader, "params": cfg.params}
    key_src = {"cfg": plain, "sources": _source_stats(cfg.params.get("path"))}
    key = hashlib.sha256(json.dumps(key_src, sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"{cfg.loader}-{key}.pt"
    if path.exists():
        return Dataset.load(str(path)), path
    # Parallel jobs (a multirun sweep) needing the same dataset build it once: the first claims it, the
    # others wait and load its file.
    with claim(path, f"dataset {path}"):
        if path.exists():
            return Dataset.load(str(path)), path
        ds = build_dataset(cfg)
        if not ds.fingerprint:
            ds.compute_fingerprint()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        ds.save(str(tmp))
        tmp.replace(path)  # atomic: a reader sees no file or the whole file
    return ds, path


def _source_stats(path: str | None) -> list:
    """Size and mtime of the source files, so an edited data file is not served from a stale cache."""
    if not path or not Path(path).exists():
        return []
    files = sorted(Path(path).rglob("*")) if Path(path).is_dir() else [Path(path)]
    return [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]
