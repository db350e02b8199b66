"""Loader holes, each on real files in the real format: tiny Criteo files, bad bytes, short rows, blank
lines, off-scale ratings, oversized hash tables, memory (no all-ones lengths, no copying fingerprint,
no ratings held as strings), and the typed `data` config."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf
from test_data_loaders import (
    CRITEO,
    ML_PARAMS,
    all_rows,
    check_invariants,
    make_movies,
    reference_hash,
    table_params,
    write_1m,
    write_20m,
    write_100k,
    write_criteo,
    write_example_table,
)

from reco.cli.compose import compose
from reco.config import ConfigError
from reco.data import build_dataset, load_dataset
from reco.data.config import DataConfig, data_config
from reco.data.criteo import CAT_COLS, load_criteo
from reco.data.movielens import load_movielens
from reco.data.schema import Dataset
from reco.data.table import load_table

ROOT = Path(__file__).resolve().parents[1]


def criteo_cfg(path: Path, **over: object) -> DataConfig:
    cfg = data_config(compose(["data=criteo"]).data)
    cfg.params |= {"path": str(path), **over}
    return cfg


def write_lines(path: Path, rows: list[list[str]]) -> None:
    path.write_text("".join("\t".join(r) + "\n" for r in rows))


def same_tensors(a: Dataset, b: Dataset) -> bool:
    return a.schema == b.schema and all(
        torch.equal(getattr(sa, k), getattr(sb, k))
        for sa, sb in zip(a.splits().values(), b.splits().values(), strict=True)
        for k in ("dense", "ids", "lengths", "labels")
    )


# ------------------------------------------------------------------------------------------------
# Criteo: too few rows, short rows, bad bytes, bucket cap


@pytest.mark.parametrize("n", [0, 1, 9])
def test_criteo_too_few_rows_refused_and_not_cached(tmp_path: Path, n: int) -> None:
    path = tmp_path / "tiny.txt"
    write_criteo(path, n)
    with pytest.raises(ValueError, match=rf"tiny\.txt: {n} usable rows .*needs at least 10 rows \(8 train"):
        load_dataset(criteo_cfg(path), tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*.pt"))  # nothing cached: the next run fails the same way
    write_criteo(path, 10)
    ds, cached = load_dataset(criteo_cfg(path), tmp_path / "cache")
    assert (len(ds.train), len(ds.val), len(ds.test)) == (8, 1, 1) and cached.exists()


def test_criteo_max_rows_below_minimum_says_so(tmp_path: Path) -> None:
    write_criteo(tmp_path / "train.txt", 50)
    with pytest.raises(ValueError, match=r"5 usable rows \(5 lines read of 50 \(data.params.max_rows\)\)"):
        load_criteo(str(tmp_path / "train.txt"), **{**CRITEO, "max_rows": 5})


def stripped(rows: list[list[str]], every: int = 2) -> tuple[list[list[str]], list[int]]:
    """Every `every`-th row loses its trailing empty fields (as public Criteo samples do)."""
    out, short = [], []
    for k, r in enumerate(rows):
        r = list(r)
        if k % every == 0:
            r[-3:] = ["", "", ""]
            while r and r[-1] == "":
                r.pop()
            short.append(k)
        out.append(r)
    return out, short


def test_criteo_short_rows_error_pad_skip(tmp_path: Path) -> None:
    rows = write_criteo(tmp_path / "full.txt", 120, seed=5)
    cut, short = stripped(rows)
    write_lines(tmp_path / "cut.txt", cut)
    assert {len(r) for r in cut} >= {37, 40}
    with pytest.raises(
        ValueError,
        match=r"cut\.txt: line 1: expected 40 fields .* found 3[0-9]; set data.params.short_rows=pad",
    ):
        load_criteo(str(tmp_path / "cut.txt"), **CRITEO)

    # pad: the same dataset as the file with the empty fields written out
    full = [r[:-3] + ["", "", ""] if k in short else r for k, r in enumerate(rows)]
    write_lines(tmp_path / "full.txt", full)
    for mode in ("hash", "vocab"):
        p = {**CRITEO, "categorical": mode, "chunk_rows": 17}
        padded = load_criteo(str(tmp_path / "cut.txt"), **{**p, "short_rows": "pad"})
        assert padded.padded == {"short_rows": len(short)} and padded.skipped == {}
        assert same_tensors(padded, load_criteo(str(tmp_path / "full.txt"), **p))

        # skip: the same dataset as the file without those lines (train split and vocabulary included)
        write_lines(tmp_path / "kept.txt", [r for k, r in enumerate(rows) if k not in short])
        skipped = load_criteo(str(tmp_path / "cut.txt"), **{**p, "short_rows": "skip"})
        assert skipped.skipped == {"short_rows": len(short)} and skipped.padded == {}
        assert same_tensors(skipped, load_criteo(str(tmp_path / "kept.txt"), **p))
        check_invariants(skipped)

    # max_rows counts lines: the short lines among the first 30 are skipped, the rest not read
    first = load_criteo(str(tmp_path / "cut.txt"), **{**CRITEO, "short_rows": "skip", "max_rows": 30})
    assert first.skipped == {"short_rows": 15, "after_max_rows": 90}
    assert sum(len(s) for s in first.splits().values()) == 15


def test_criteo_short_row_error_after_skipped_lines_names_the_right_line(tmp_path: Path) -> None:
    rows = write_criteo(tmp_path / "t.txt", 30)
    rows[4] = rows[4][:20]  # short: skipped
    rows[9] = [*rows[9], "extra"]  # long: always an error
    write_lines(tmp_path / "t.txt", rows)
    with pytest.raises(ValueError, match=r"t\.txt: line 10: expected 40 fields .*found 41$"):
        load_criteo(str(tmp_path / "t.txt"), **{**CRITEO, "short_rows": "skip", "chunk_rows": 4})
    rows[9] = rows[9][:40]
    rows[12][0] = "7"
    write_lines(tmp_path / "t.txt", rows)
    with pytest.raises(ValueError, match=r"t\.txt: line 13: label '7'"):
        load_criteo(str(tmp_path / "t.txt"), **{**CRITEO, "short_rows": "skip", "chunk_rows": 4})


def test_criteo_invalid_utf8_names_file_and_line(tmp_path: Path) -> None:
    rows = write_criteo(tmp_path / "train.txt", 40)
    lines = ["\t".join(r).encode() for r in rows]
    lines[26] = lines[26].replace(b"\t", b"\t\xff", 1)  # a stray byte at the start of I1
    (tmp_path / "train.txt").write_bytes(b"\n".join(lines) + b"\n")
    for chunk_rows in (1000, 7):
        with pytest.raises(ValueError, match=r"train\.txt: line 27: byte 3 \(0xff\) is not valid utf-8 text"):
            load_criteo(str(tmp_path / "train.txt"), **{**CRITEO, "chunk_rows": chunk_rows})


def test_criteo_hash_tables_capped_by_train_values(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rows = write_criteo(tmp_path / "train.txt", 1000)
    cfg = criteo_cfg(tmp_path / "train.txt")
    assert cfg.params["hash_buckets"] == 100_000 and cfg.params["max_buckets_per_value"] == 2
    ds = build_dataset(cfg)
    check_invariants(ds)
    out = capsys.readouterr().out
    assert "26 of 26 hash tables capped below hash_buckets=100,000" in out and "C1 " in out
    for j, (feat, name) in enumerate(zip(ds.schema.sparse, CAT_COLS, strict=True)):
        distinct = len({r[14 + j] for r in rows[:800]} - {""})
        assert feat.cardinality == 2 * distinct + 1, name
        want = [
            0 if r[14 + j] == "" else 1 + (reference_hash(r[14 + j]) % 99_999) % (2 * distinct) for r in rows
        ]
        assert all_rows(ds, "ids")[:, j, 0].tolist() == want, name
    rows_total = sum(f.cardinality for f in ds.schema.sparse)
    assert rows_total <= 26 * 81  # 40 distinct values per column at most: ~0.5 MB of embeddings at dim 64

    uncapped = build_dataset(criteo_cfg(tmp_path / "train.txt", max_buckets_per_value=None))
    assert all(f.cardinality == 100_000 for f in uncapped.schema.sparse)
    assert "capped" not in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------
# Bring-your-own table: short rows, blank lines, encodings, quoting


def csv_lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def test_table_short_row_is_an_error_naming_file_and_line(tmp_path: Path) -> None:
    write_example_table(tmp_path / "t.csv", n=60)
    lines = csv_lines(tmp_path / "t.csv")
    lines[7] = lines[7].rsplit(",", 2)[0]  # the last two fields missing: pandas read them as NaN
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    with pytest.raises(
        ValueError, match=r"t\.csv: line 8: expected 10 fields separated by ',' .*found 8; set data.params"
    ):
        load_table(**table_params(tmp_path / "t.csv"))
    skip = load_table(**table_params(tmp_path / "t.csv", short_rows="skip", min_count=1))
    assert skip.skipped.get("short_rows") == 1 and sum(len(s) for s in skip.splits().values()) == 59
    pad = load_table(**table_params(tmp_path / "t.csv", short_rows="pad", min_count=1))
    # padded: device and the label are empty, so the row is skipped for its missing label
    assert pad.padded == {"short_rows": 1} and pad.skipped.get("label_missing") == 1


def test_table_line_numbers_count_blank_lines(tmp_path: Path) -> None:
    frame = write_example_table(tmp_path / "t.csv", n=60)
    lines = csv_lines(tmp_path / "t.csv")
    col = list(frame.columns).index("clicked")
    fields = lines[20].split(",")
    fields[col] = "3"
    lines[20] = ",".join(fields)  # physical line 21 before the blank lines go in, 24 after
    lines[5:5] = ["", ""]
    lines[1:1] = [""]
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n\n")
    with pytest.raises(
        ValueError,
        match=r"t\.csv column 'clicked' \(data\.params\.label\): line 24: label 3, expected 0 or 1",
    ):
        load_table(**table_params(tmp_path / "t.csv"))
    fields[col] = "1"
    lines[23] = ",".join(fields)
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n\n")
    ds = load_table(**table_params(tmp_path / "t.csv"))  # blank lines are not rows and not counted
    assert sum(len(s) for s in ds.splits().values()) == 60 and "short_rows" not in ds.skipped


def test_table_encoding_errors_name_file_and_line(tmp_path: Path) -> None:
    frame = write_example_table(tmp_path / "t.csv", n=40)
    frame["country"] = frame["country"].where(frame.index != frame.index[11], "Café")
    frame.to_csv(tmp_path / "latin.csv", index=False, encoding="latin-1")
    with pytest.raises(
        ValueError,
        match=r"latin\.csv: line 13: byte \d+ \(0xe9\) is not valid utf-8 text; set data.params.encoding",
    ):
        load_table(**table_params(tmp_path / "latin.csv"))
    ds = load_table(**table_params(tmp_path / "latin.csv", encoding="latin-1", min_count=1))
    utf = load_table(**table_params(tmp_path / "t.csv", min_count=1))
    frame.to_csv(tmp_path / "utf.csv", index=False)
    assert ds.fingerprint == load_table(**table_params(tmp_path / "utf.csv", min_count=1)).fingerprint
    assert ds.fingerprint != utf.fingerprint  # "Café" is a country of its own


def test_table_quoted_fields_tsv_and_numeric_time(tmp_path: Path) -> None:
    frame = write_example_table(tmp_path / "t.csv", n=80)
    base = load_table(**table_params(tmp_path / "t.csv"))
    quoted = frame.assign(category=frame["category"] + ", x")  # pandas quotes these: "cat3, x"
    quoted.to_csv(tmp_path / "q.csv", index=False)
    assert '"cat' in (tmp_path / "q.csv").read_text()
    q = load_table(**table_params(tmp_path / "q.csv"))
    assert torch.equal(all_rows(q, "ids"), all_rows(base, "ids"))
    frame.to_csv(tmp_path / "t.tsv", index=False, sep="\t")
    assert load_table(**table_params(tmp_path / "t.tsv", csv_separator="\t")).fingerprint == base.fingerprint
    epoch = frame.assign(ts=(pd.to_datetime(frame["ts"]) - pd.Timestamp("1970-01-01")) // pd.Timedelta("1s"))
    epoch.to_csv(tmp_path / "e.csv", index=False)
    assert load_table(**table_params(tmp_path / "e.csv")).fingerprint == base.fingerprint


# ------------------------------------------------------------------------------------------------
# MovieLens: rating scale, memory


@pytest.mark.parametrize(
    "writer, file, value, scale",
    [
        (write_100k, "u.data", "6", "1, 2, 3, 4, 5"),
        (write_1m, "ratings.dat", "3.5", "1, 2, 3, 4, 5"),
        (write_20m, "ratings.csv", "5.5", "0.5, 1, 1.5"),
        (write_20m, "ratings.csv", "0", "0.5, 1, 1.5"),
    ],
)
def test_movielens_rating_off_scale(tmp_path: Path, writer, file: str, value: str, scale: str) -> None:
    m = make_movies(seed=7)
    d = writer(tmp_path / "ml", m)
    lines = (d / file).read_text().splitlines()
    sep = {"u.data": "\t", "ratings.dat": "::", "ratings.csv": ","}[file]
    k = 12  # 0-based data line; the csv layout has a header line before it
    fields = lines[k].split(sep)
    fields[2] = value
    lines[k] = sep.join(fields)
    (d / file).write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"{file}: line 13: rating {value} is off the MovieLens .*{scale}"):
        load_movielens(str(d), **ML_PARAMS)


def test_movielens_half_stars_accepted_in_20m(tmp_path: Path) -> None:
    m = make_movies(seed=8)
    d = write_20m(tmp_path / "ml", m)
    lines = (d / "ratings.csv").read_text().splitlines()
    half = [lines[0]]
    for k, line in enumerate(lines[1:]):
        u, i, r, t = line.split(",")
        half.append(f"{u},{i},{float(r) - 0.5 * (k % 2)},{t}")  # 0.5 .. 5 in half stars
    (d / "ratings.csv").write_text("\n".join(half) + "\n")
    ds = load_movielens(str(d), **ML_PARAMS)
    want = (m.ratings["rating"] - 0.5 * (np.arange(len(m.ratings)) % 2) >= 4).sum()
    assert int(all_rows(ds, "labels").sum()) == want


def test_movielens_ratings_read_chunk_by_chunk(tmp_path: Path) -> None:
    """Arrow's peak memory while reading 200k ratings in chunks of 4,000 lines stays below half the
    file's size: each chunk becomes numbers before the next is read (concatenating every chunk's
    strings first peaked at ~2.6x the file)."""
    n = 200_000
    rng = np.random.default_rng(0)
    cols = [rng.integers(1, 10**6, n) for _ in range(4)]
    cols[2] = rng.integers(1, 6, n)
    path = tmp_path / "u.data"
    path.write_text("".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in zip(*cols, strict=True)))
    script = (
        "import sys, pyarrow as pa; from pathlib import Path; import reco.data.movielens_files as ml\n"
        "ml.CHUNK_ROWS = 4000\n"
        "r = ml._read_ratings(Path(sys.argv[1]), '\\t', ml.RATING_FIELDS)\n"
        "print(len(r), int(r['rating'].sum()), pa.default_memory_pool().max_memory())\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", script, str(path)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    rows, total, peak = map(int, out.stdout.split())
    assert (rows, total) == (n, int(cols[2].sum()))
    assert peak < path.stat().st_size / 2, (
        f"Arrow peak {peak:,} bytes for a {path.stat().st_size:,}-byte file"
    )


# ------------------------------------------------------------------------------------------------
# Memory of the Dataset itself


def test_criteo_lengths_are_a_view_and_fingerprint_is_unchanged(tmp_path: Path) -> None:
    write_criteo(tmp_path / "train.txt", 300)
    ds = load_criteo(str(tmp_path / "train.txt"), **CRITEO)
    for s in ds.splits().values():
        assert s.lengths.untyped_storage().nbytes() == 8 and s.lengths.shape == (len(s), 26)
        assert (s.lengths == 1).all()
    # The fingerprint is the SHA-256 of the values, as before the view (so cached variants stay valid).
    h = hashlib.sha256(repr(ds.schema.to_dict()).encode())
    for name, s in ds.splits().items():
        h.update(name.encode())
        for t in (s.dense, s.ids, s.lengths, s.labels):
            h.update(t.contiguous().numpy().tobytes())
    assert ds.fingerprint == h.hexdigest()[:16]
    ds.save(str(tmp_path / "d.pt"))
    back = Dataset.load(str(tmp_path / "d.pt"))
    assert back.compute_fingerprint() == ds.fingerprint and same_tensors(back, ds)
    stored = sum(
        t.numel() * t.element_size() for s in ds.splits().values() for t in (s.dense, s.ids, s.labels)
    )
    assert (tmp_path / "d.pt").stat().st_size < stored + 300 * 26 * 8 / 4  # no 300 x 26 int64 lengths


def test_fingerprint_does_not_copy_tensors(tiny_data: Dataset) -> None:
    big = sum(t.numel() * t.element_size() for s in tiny_data.splits().values() for t in (s.dense, s.ids))
    assert big > 4 << 20
    tracemalloc.start()
    try:
        tiny_data.compute_fingerprint()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak:,} bytes allocated while hashing {big:,}"


# ------------------------------------------------------------------------------------------------
# Typed `data` config


def test_data_config_types_a_dict_or_a_data_config_alike(tmp_path: Path) -> None:
    write_example_table(tmp_path / "t.csv", n=100)
    plain = OmegaConf.to_container(compose(["data=table_example"]).data, resolve=True)
    plain["params"]["path"] = str(tmp_path / "t.csv")
    ds, path = load_dataset(data_config(plain), tmp_path / "cache")
    again, path2 = load_dataset(DataConfig(loader="table", params=dict(plain["params"])), tmp_path / "cache")
    assert path2 == path and again.fingerprint == ds.fingerprint  # the same cache entry
    typo = {**plain, "params": {**plain["params"], "min_cout": 2}}
    with pytest.raises(
        ConfigError, match=r"data.params.min_cout: not a setting of the table loader \(did you"
    ):
        load_dataset(data_config(typo), tmp_path / "cache")
    with pytest.raises(ConfigError, match="data: loadr: Key 'loadr' not in 'DataConfig'"):
        data_config({**plain, "loadr": "table"})
    with pytest.raises(ValueError, match=r"data.loader: expected one of .*got 'tabel'"):
        build_dataset(data_config({**plain, "loader": "tabel"}))


def test_data_config_resolves_the_composed_node(tmp_path: Path) -> None:
    cfg = compose(["experiment=smoke", "data.params.n_rows=2000", "seed=3"])
    from_node = data_config(cfg.data)  # ${seed} resolved against the whole config
    plain = OmegaConf.to_container(cfg.data, resolve=True)
    assert plain["params"]["seed"] == 3 and from_node == data_config(plain)
    assert isinstance(from_node.params, dict)  # plain data: what the cache key hashes


@pytest.mark.parametrize(
    "module, config, fn",
    [
        ("reco.data.criteo", "CriteoConfig", "load_criteo"),
        ("reco.data.movielens", "MovieLensConfig", "load_movielens"),
        ("reco.data.table", "TableConfig", "load_table"),
    ],
)
def test_loader_configs_match_their_functions(module: str, config: str, fn: str) -> None:
    mod = importlib.import_module(module)
    fields = [f.name for f in dataclasses.fields(getattr(mod, config))]
    assert sorted(fields) == sorted(inspect.signature(getattr(mod, fn)).parameters)


def test_data_yamls_list_the_schema_and_compose_checks_keys() -> None:
    for f in sorted((ROOT / "conf/data").glob("*.yaml")):  # directly, or through the base it lists
        defaults = OmegaConf.load(f).defaults
        while defaults[0] != "schema":  # `defaults: [table, _self_]`: conf/data/table.yaml lists it
            assert defaults[1:] == ["_self_"], f.name
            defaults = OmegaConf.load(ROOT / "conf/data" / f"{defaults[0]}.yaml").defaults
        assert defaults == ["schema", "_self_"], f.name
    assert compose(["experiment=smoke"]).data.loader == "synthetic_ecommerce"
    with pytest.raises(Exception, match="Could not override 'data.loadr'"):
        compose(["data=criteo", "data.loadr=x"])
    appended = compose(["data=table_example", "+data.loadr=x"]).data
    with pytest.raises(ConfigError, match="data: loadr: Key 'loadr' not in 'DataConfig'"):
        data_config(appended)  # `+key=` gets past compose, not past typing
    with pytest.raises(ConfigError, match="data.params: short_row: Key 'short_row' not in 'CriteoConfig'"):
        build_dataset(criteo_cfg(ROOT / "nothere.txt", short_row="pad"))
