"""MovieLens ratings (GroupLens) -> `Dataset`; label = rating >= `positive_rating`.

The files of the 100k / 1m / 20m / 25m layouts are read by reco.data.movielens_files.

Features: user_id, age (the ml-1m buckets 1/18/25/35/45/50/56; ml-100k ages are bucketed the same
way), gender, occupation, zip_prefix (user side, when a user file exists); item_id, genres
(multi-valued, at most `max_genres`) (item side); hour, weekday of the rating in UTC (context).
Dense: release_year (from the item file), item_pop and user_activity = log(1 + ratings in the TRAIN
split), standardised with train statistics (see reco.data.encode for the shared encoding rules).

Rows are ordered by timestamp (ties: file order) and split 80/10/10. A rating line missing its user,
item, rating or timestamp is skipped and counted in `Dataset.skipped` as "<field>_missing".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from reco.data.encode import DenseColumn, SparseColumn, frame_to_dataset
from reco.data.movielens_files import RATING_FIELDS, detect_layout, read_layout
from reco.data.schema import Dataset, time_split


@dataclass
class MovieLensConfig:
    """`data.params` of the movielens loader; values in conf/data/movielens*.yaml (documented there)."""

    path: str  # the extracted GroupLens directory (or the ml-100k Parquet copy)
    layout: str  # auto | 100k | 1m | 20m | 25m
    positive_rating: float  # label = rating >= positive_rating
    min_count: int  # ids seen fewer times in train -> 0
    max_genres: int  # genres kept per movie
    zip_prefix_len: int  # user zip code -> its first digits
    max_rows: int | None  # keep only the latest N ratings; None: all


def load_movielens(
    path: str,
    layout: str,
    positive_rating: float,
    min_count: int,
    max_genres: int,
    zip_prefix_len: int,
    max_rows: int | None,
) -> Dataset:
    """Read a GroupLens directory (rules in the module docstring).

    Args:
        The fields of `MovieLensConfig`; max_rows: keep only the latest `max_rows` ratings (the rest
        counted as skipped "before_max_rows").
    Returns:
        A fingerprinted `Dataset` keyed by user_id / item_id.
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(
            f"data.params.path: MovieLens directory {root} does not exist (cwd {Path.cwd()}). "
            "Run `make movielens-100k` to fetch MovieLens-100k into .cache/data/movielens_100k, or point "
            "data.params.path at an extracted GroupLens ml-100k / ml-1m / ml-20m / ml-25m directory."
        )
    layout = detect_layout(root) if layout == "auto" else layout
    raw = read_layout(root, layout)

    ratings, skipped = _usable(raw.ratings, max_rows)
    n_train = time_split(len(ratings))[0].stop
    user = ratings["user_id"].to_numpy(np.int64)
    item = ratings["item_id"].to_numpy(np.int64)
    ts = ratings["timestamp"].to_numpy(np.int64)
    frame = pd.DataFrame(index=ratings.index)
    frame["user_id"] = user
    sparse = [SparseColumn("user_id", "user")]
    if raw.users is not None:
        users = raw.users.reindex(user)  # users absent from the user file: missing -> id 0
        frame["age"] = users["age"].to_numpy()
        frame["gender"] = users["gender"].to_numpy()
        frame["occupation"] = users["occupation"].to_numpy()
        frame["zip_prefix"] = users["zip"].str.slice(0, zip_prefix_len).to_numpy()
        sparse += [SparseColumn(c, "user") for c in ("age", "gender", "occupation", "zip_prefix")]
    items = raw.items.reindex(item)
    frame["item_id"] = item
    frame["genres"] = items["genres"].to_numpy()
    frame["hour"] = (ts // 3600) % 24
    frame["weekday"] = (ts // 86400 + 3) % 7  # 1970-01-01 was a Thursday; Monday = 0
    sparse += [
        SparseColumn("item_id", "item"),
        SparseColumn("genres", "item", multi_valued=True, separator="|", max_len=max_genres),
        SparseColumn("hour", "context"),
        SparseColumn("weekday", "context"),
    ]
    # Popularity from the train split only: validation/test ratings must not leak into features.
    frame["release_year"] = items["release_year"].to_numpy()
    frame["item_pop"] = pd.Series(item[:n_train]).value_counts().reindex(item, fill_value=0).to_numpy()
    frame["user_activity"] = pd.Series(user[:n_train]).value_counts().reindex(user, fill_value=0).to_numpy()
    dense = [
        DenseColumn("release_year", "item"),
        DenseColumn("item_pop", "item", log=True),
        DenseColumn("user_activity", "user", log=True),
    ]
    labels = (ratings["rating"].to_numpy() >= positive_rating).astype(np.float32)
    return frame_to_dataset(
        frame, labels, dense, sparse, min_count, "user_id", "item_id", f"movielens_{layout}", skipped
    )


def _usable(ratings: pd.DataFrame, max_rows: int | None) -> tuple[pd.DataFrame, dict[str, int]]:
    """Skip rows missing a required field (counted per field), order by time, keep the latest max_rows."""
    skipped: dict[str, int] = {}
    keep = np.ones(len(ratings), dtype=bool)
    for col in RATING_FIELDS:
        missing = keep & ratings[col].isna().to_numpy()
        if missing.any():
            skipped[f"{col}_missing"] = int(missing.sum())
        keep &= ~missing
    ratings = ratings[keep]
    ratings = ratings.iloc[np.argsort(ratings["timestamp"].to_numpy(), kind="stable")]
    if max_rows is not None and len(ratings) > max_rows:
        skipped["before_max_rows"] = len(ratings) - max_rows
        ratings = ratings.iloc[len(ratings) - max_rows :]
    return ratings, skipped
