"""Datasets: every loader returns a `reco.data.schema.Dataset`; `load_dataset` picks one by config."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from reco.data.schema import Dataset

LOADERS = ("synthetic_ecommerce", "movielens", "criteo", "table")


def build_dataset(cfg: dict) -> Dataset:
    """cfg: the resolved `data` config group (a plain dict); `cfg['loader']` names the loader."""
    loader = cfg.get("loader")
    if loader == "synthetic_ecommerce":
        from reco.data.synthetic import SyntheticConfig, generate

        return generate(SyntheticConfig(**cfg["params"]))
    if loader == "movielens":
        from reco.data.movielens import load_movielens

        return load_movielens(**cfg["params"])
    if loader == "criteo":
        from reco.data.criteo import load_criteo

        return load_criteo(**cfg["params"])
    if loader == "table":
        from reco.data.table import load_table

        return load_table(**cfg["params"])
    raise ValueError(f"data.loader: expected one of {LOADERS}, got {loader!r}")


def load_dataset(cfg: dict, cache_dir: str | Path) -> tuple[Dataset, Path]:
    """Build the dataset once per distinct data config; later runs (and the server) load the cache."""
    key_src = {"cfg": cfg, "sources": _source_stats(cfg.get("params", {}).get("path"))}
    key = hashlib.sha256(json.dumps(key_src, sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"{cfg.get('loader')}-{key}.pt"
    if path.exists():
        return Dataset.load(str(path)), path
    ds = build_dataset(cfg)
    if not ds.fingerprint:
        ds.compute_fingerprint()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    ds.save(str(tmp))
    tmp.replace(path)
    return ds, path


def _source_stats(path: str | None) -> list:
    """Size and mtime of the source files, so an edited data file is not served from a stale cache."""
    if not path or not Path(path).exists():
        return []
    files = sorted(Path(path).rglob("*")) if Path(path).is_dir() else [Path(path)]
    return [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]
