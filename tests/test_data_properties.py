"""Property tests: random small tables written in every supported format, read back by the loaders.

Each example writes real files (CSV, TSV and Parquet tables; Criteo TSV, gzipped or not; MovieLens
100k / 1m / 20m layouts) with missing values, short lines, blank lines and quoted fields, and checks
what the loader returns against what was written: row counts, labels in order, which ids are
"unknown", and the skipped / padded counts.
"""

from __future__ import annotations

import csv
import gzip
import io
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_data_loaders import (
    CRITEO,
    ML_PARAMS,
    Movies,
    all_rows,
    check_invariants,
    column,
    make_movies,
    reference_hash,
    write_1m,
    write_20m,
    write_100k,
)

from reco.data.criteo import load_criteo
from reco.data.movielens import load_movielens
from reco.data.schema import MIN_ROWS
from reco.data.table import load_table

SETTINGS = settings(
    max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)

# ------------------------------------------------------------------------------------------------
# Bring-your-own table: CSV, TSV and Parquet of the same rows give the same dataset

TABLE_COLUMNS = ["label", "user", "item", "price", "device"]  # short lines lose price / device
words = st.sampled_from(["", "a", "b", "c", "d, e", 'q"t', "ü", "007", "7"])  # "" = missing
table_row = st.fixed_dictionaries(
    {
        "label": st.sampled_from(["0", "1", "1", ""]),
        "user": words,
        "item": words,
        "price": st.one_of(st.just(""), st.floats(-1e3, 1e3, allow_nan=False).map(lambda x: f"{x:.3f}")),
        "device": words,
        "short": st.sampled_from([0, 0, 0, 1, 2]),  # trailing fields left off this line
        "blank_before": st.booleans(),
    }
)


def table_params(path: Path, **over: object) -> dict:
    return {
        "path": str(path),
        "format": "auto",
        "csv_separator": ",",
        "encoding": "utf-8",
        "short_rows": "error",
        "name": "t",
        "label": "label",
        "label_threshold": None,
        "time": None,
        "min_count": 1,
        "user_key": "user",
        "item_key": "item",
        "dense": [{"column": "price", "side": "item"}],
        "sparse": [
            {"column": "user", "side": "user"},
            {"column": "item", "side": "item"},
            {"column": "device", "side": "context"},
        ],
        **over,
    }


def write_text_table(path: Path, rows: list[dict], sep: str) -> None:
    out = io.StringIO()
    writer = csv.writer(out, delimiter=sep, lineterminator="\n")
    writer.writerow(TABLE_COLUMNS)
    for r in rows:
        if r["blank_before"]:
            out.write("\n")
        writer.writerow([r[c] for c in TABLE_COLUMNS][: len(TABLE_COLUMNS) - r["short"]])
    path.write_text(out.getvalue(), encoding="utf-8")


@SETTINGS
@given(rows=st.lists(table_row, min_size=12, max_size=40), policy=st.sampled_from(["pad", "skip"]))
def test_table_formats_agree_with_what_was_written(rows: list[dict], policy: str) -> None:
    # What the loader should see: skip drops the short lines, pad reads their missing fields as empty.
    seen = []
    for r in rows:
        if r["short"] and policy == "skip":
            continue
        r = dict(r)
        for c in TABLE_COLUMNS[len(TABLE_COLUMNS) - r["short"] :]:
            r[c] = ""
        seen.append(r)
    n_short = sum(1 for r in rows if r["short"])
    kept = [r for r in seen if r["label"] != ""]
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        write_text_table(d / "t.csv", rows, ",")
        write_text_table(d / "t.tsv", rows, "\t")
        none = {c: [r[c] or None for r in seen] for c in TABLE_COLUMNS}
        pd.DataFrame(
            {
                "label": [float(v) if v else np.nan for v in none["label"]],
                "user": none["user"],
                "item": none["item"],
                "price": [float(v) if v else np.nan for v in none["price"]],
                "device": none["device"],
            }
        ).to_parquet(d / "t.parquet")

        if n_short:
            with pytest.raises(ValueError, match=r"t\.csv: line \d+: expected 5 fields .*short_rows=pad"):
                load_table(**table_params(d / "t.csv"))
        event("too few rows" if len(kept) < MIN_ROWS else "read back")
        if len(kept) < MIN_ROWS:
            with pytest.raises(ValueError, match=rf"t\.csv: {len(kept)} usable rows"):
                load_table(**table_params(d / "t.csv", short_rows=policy))
            return
        csv_ds = load_table(**table_params(d / "t.csv", short_rows=policy))
        tsv_ds = load_table(**table_params(d / "t.tsv", short_rows=policy, csv_separator="\t"))
        pq_ds = load_table(**table_params(d / "t.parquet"))

    check_invariants(csv_ds)
    assert csv_ds.fingerprint == tsv_ds.fingerprint == pq_ds.fingerprint
    counts = {"label_missing": len(seen) - len(kept)}
    if n_short:
        counts["short_rows"] = n_short
    assert {**csv_ds.skipped, **csv_ds.padded} == {k: v for k, v in counts.items() if v}
    assert ("short_rows" in csv_ds.padded) == (policy == "pad" and n_short > 0)
    assert pq_ds.skipped == {k: v for k, v in counts.items() if v and k != "short_rows"}

    assert all_rows(csv_ds, "labels").tolist() == [float(r["label"]) for r in kept]
    n_train = len(csv_ds.train)
    for name in ("user", "item", "device"):
        values = [r[name] for r in kept]
        ids = column(csv_ds, name).tolist()
        train = set(values[:n_train]) - {""}
        assert [i > 0 for i in ids] == [v in train for v in values], name  # unknown: missing or unseen
        by_value = {}
        for v, i in zip(values, ids, strict=True):
            assert by_value.setdefault(v, i) == i, name  # one value, one id
        assert len({by_value[v] for v in train}) == len(train), name  # distinct values, distinct ids
    missing_price = [r["price"] == "" for r in kept]
    dense = all_rows(csv_ds, "dense")[:, 0]
    assert all(dense[k] == 0 for k, m in enumerate(missing_price) if m)  # missing -> the train mean


# ------------------------------------------------------------------------------------------------
# Criteo TSV

cats = st.sampled_from(["", "68fd1e64", "80e26c9b", "fb936136", "7b4723c4", "25c83c98", "0b153874"])
ints = st.one_of(st.just(""), st.integers(-5, 10**6).map(str))
criteo_row = st.tuples(
    st.sampled_from(["0", "1"]),
    st.lists(ints, min_size=13, max_size=13),
    st.lists(cats, min_size=26, max_size=26),
    st.booleans(),  # strip trailing empty fields from this line
)


@SETTINGS
@given(
    rows=st.lists(criteo_row, min_size=8, max_size=30),
    policy=st.sampled_from(["error", "pad", "skip"]),
    chunk_rows=st.integers(1, 8),
    max_rows=st.one_of(st.none(), st.integers(8, 30)),
    gz=st.booleans(),
)
def test_criteo_reads_back_what_was_written(
    rows: list[tuple], policy: str, chunk_rows: int, max_rows: int | None, gz: bool
) -> None:
    fields = [[label, *i, *c] for label, i, c, _ in rows]
    lines = []
    for f, (*_, strip) in zip(fields, rows, strict=True):
        f = list(f)
        while strip and f[-1] == "":
            f.pop()
        lines.append(f)
    read = lines if max_rows is None else lines[:max_rows]
    short = [k for k, f in enumerate(read) if len(f) < 40]
    kept = [k for k in range(len(read)) if policy != "skip" or k not in short]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / ("train.txt.gz" if gz else "train.txt")
        text = "".join("\t".join(f) + "\n" for f in lines).encode()
        path.write_bytes(gzip.compress(text) if gz else text)
        params = {**CRITEO, "short_rows": policy, "chunk_rows": chunk_rows, "max_rows": max_rows}
        # The row count is checked before any line is parsed (a cheap pass over the file), so a file too
        # short for the split says so even when one of its lines is short too.
        event(
            "too few rows"
            if len(kept) < MIN_ROWS
            else "short-line error"
            if policy == "error" and short
            else "read back"
        )
        if len(kept) < MIN_ROWS:
            with pytest.raises(ValueError, match=rf"{len(kept)} usable rows"):
                load_criteo(str(path), **params)
            return
        if policy == "error" and short:
            with pytest.raises(ValueError, match=rf"line {short[0] + 1}: expected 40 fields"):
                load_criteo(str(path), **params)
            return
        ds = load_criteo(str(path), **params)

    check_invariants(ds)
    want_skipped = {
        "short_rows": len(short) if policy == "skip" else 0,
        "after_max_rows": len(lines) - len(read),
    }
    assert ds.skipped == {k: v for k, v in want_skipped.items() if v}
    assert ds.padded == ({"short_rows": len(short)} if policy == "pad" and short else {})
    assert all_rows(ds, "labels").tolist() == [float(fields[k][0]) for k in kept]
    ids = all_rows(ds, "ids")[:, :, 0].tolist()
    for row, k in zip(ids, kept, strict=True):
        # a value the short line left off is empty (id 0), like a value written empty
        cells = lines[k][14:] + [""] * (40 - len(lines[k]))
        assert row == [0 if v == "" else 1 + reference_hash(v) % 999 for v in cells]
    dense = all_rows(ds, "dense").numpy()
    for r, k in enumerate(kept):
        vals = lines[k][1:14] + [""] * max(0, 14 - len(lines[k]))
        want = [np.log1p(max(int(v), 0)) if v else 0.0 for v in vals]
        np.testing.assert_allclose(dense[r], want, rtol=1e-6)


# ------------------------------------------------------------------------------------------------
# MovieLens layouts

rating_row = st.tuples(
    st.integers(1, 6),  # user
    st.integers(1, 6),  # item
    st.integers(1, 5),  # rating
    st.sampled_from([None] * 12 + [0, 1, 2, 3]),  # the field left empty, if any
)
WRITERS = {"100k": (write_100k, "u.data", "\t", 0), "1m": (write_1m, "ratings.dat", "::", 0)}
WRITERS["20m"] = (write_20m, "ratings.csv", ",", 1)
FIELDS = ["user_id", "item_id", "rating", "timestamp"]


@SETTINGS
@given(
    rows=st.lists(rating_row, min_size=11, max_size=40),
    ts=st.lists(st.integers(800_000_000, 900_000_000), min_size=40, max_size=40, unique=True),
    layout=st.sampled_from(sorted(WRITERS)),
)
def test_movielens_layouts_read_back_what_was_written(rows: list[tuple], ts: list[int], layout: str) -> None:
    base = make_movies(n=10, n_users=6, n_items=6, seed=0)
    ratings = pd.DataFrame(
        {
            "user": [r[0] for r in rows],
            "item": [r[1] for r in rows],
            "rating": [r[2] for r in rows],
            "ts": ts[: len(rows)],
        },
        dtype=np.int64,
    )
    writer, file, sep, header = WRITERS[layout]
    with tempfile.TemporaryDirectory() as d:
        root = writer(Path(d) / "ml", Movies(ratings, base.genres, base.year, base.users))
        lines = (root / file).read_text().splitlines()
        for k, r in enumerate(rows):
            if r[3] is not None:  # blank one field of this line
                f = lines[header + k].split(sep)
                f[r[3]] = ""
                lines[header + k] = sep.join(f)
        (root / file).write_text("\n".join(lines) + "\n")
        kept = [k for k, r in enumerate(rows) if r[3] is None]
        event("too few rows" if len(kept) < MIN_ROWS else "read back")
        if len(kept) < MIN_ROWS:
            with pytest.raises(ValueError, match=rf"{len(kept)} usable rows"):
                load_movielens(str(root), **ML_PARAMS)
            return
        ds = load_movielens(str(root), **ML_PARAMS)

    check_invariants(ds)
    missing: dict[str, int] = {}
    for r in rows:
        if r[3] is not None:
            missing[f"{FIELDS[r[3]]}_missing"] = missing.get(f"{FIELDS[r[3]]}_missing", 0) + 1
    assert {k: v for k, v in ds.skipped.items() if k != "genres_values_over_max_len"} == missing
    by_time = sorted(kept, key=lambda k: ts[k])
    assert all_rows(ds, "labels").tolist() == [float(rows[k][2] >= 4) for k in by_time]
    users = [rows[k][0] for k in by_time]
    n_train = len(ds.train)
    ids = column(ds, "user_id").tolist()
    assert [i > 0 for i in ids] == [u in users[:n_train] for u in users]
