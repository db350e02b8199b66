"""The schema of the `data` config group (conf/data/*.yaml).

Only the loader's name and a mapping of its parameters are checked at compose time; each loader types
its own `params` with its dataclass (SyntheticConfig, MovieLensConfig, CriteoConfig, TableConfig) when
the dataset is built, so an unknown or mistyped key fails naming `data.params.<key>`.
"""

from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING


@dataclass
class DataConfig:
    # synthetic_ecommerce | movielens | criteo | table (reco.data.LOADERS)
    loader: str = MISSING
    # the loader's parameters, typed by the loader's own dataclass
    params: dict[str, Any] = MISSING
