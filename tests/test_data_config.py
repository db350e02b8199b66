"""A user's table data YAML states only what differs from the documented base (conf/data/table.yaml),
composed by Hydra exactly as `python run.py data=<name>` does; and bad table input stops naming the file
or the `data.params.<key>` and what was expected. Every file is real (tests/data, or written here)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf
from test_data_loaders import check_invariants, write_example_table

from reco.cli.compose import compose
from reco.config import ConfigError
from reco.data import build_dataset, load_dataset
from reco.data.config import DataConfig, data_config
from reco.experiment import experiment_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_CSV = ROOT / "tests/data/table_example.csv"
EXAMPLE_PARQUET = ROOT / "tests/data/table_example.parquet"

# What a user writes: the keys the base leaves ??? and nothing else.
MINIMAL = """
defaults: [table, _self_]
params:
  path: {path}
  label: clicked
  dense: [{{column: price, side: item}}]
  sparse: [{{column: user, side: user}}, {{column: item, side: item}},
           {{column: tags, side: item, multi_valued: true, max_len: 3}}]
"""

# conf/data/table.yaml as a user copied it before `encoding` existed (every other key of that day).
BEFORE_ENCODING = """
defaults: [{base}, _self_]
loader: table
params:
  path: {path}
  format: auto
  csv_separator: ","
  short_rows: error
  name: table_example
  label: clicked
  label_threshold: null
  time: ts
  min_count: 2
  user_key: user
  item_key: item
  dense:
    - {{column: price, side: item, log: true}}
    - {{column: user_age_days, side: user}}
  sparse:
    - {{column: user, side: user}}
    - {{column: country, side: user}}
    - {{column: item, side: item}}
    - {{column: category, side: item}}
    - {{column: tags, side: item, multi_valued: true, separator: "|", max_len: 4}}
    - {{column: device, side: context}}
"""


def user_data(tmp_path: Path, name: str, text: str) -> list[str]:
    """conf/data/<name>.yaml in a config dir of its own, searched beside the project's conf/ (as
    `python run.py hydra.searchpath=[file://...]` would) -> the overrides selecting it."""
    group = tmp_path / "conf" / "data"
    group.mkdir(parents=True, exist_ok=True)
    (group / f"{name}.yaml").write_text(text)
    return [f"hydra.searchpath=[file://{tmp_path / 'conf'}]", f"data={name}"]


def data_of(overrides: list[str]) -> dict:
    return OmegaConf.to_container(compose(overrides).data, resolve=True)


# ------------------------------------------------------------------------------------------------
# The base and what a user states


@pytest.mark.parametrize("file", [EXAMPLE_CSV, EXAMPLE_PARQUET], ids=["csv", "parquet"])
def test_minimal_user_yaml_composes_and_loads(tmp_path: Path, file: Path) -> None:
    cfg = data_of(user_data(tmp_path, "mine", MINIMAL.format(path=file)))
    base = data_of(["data=table"])["params"]
    stated = {"path", "label", "dense", "sparse"}
    assert set(cfg["params"]) == set(base)
    assert {k: v for k, v in cfg["params"].items() if k not in stated} == {
        k: v for k, v in base.items() if k not in stated
    }
    ds = build_dataset(data_config(cfg))
    check_invariants(ds)
    assert ds.name == "table_example" and sum(len(s) for s in ds.splits().values()) == 2000
    assert ds.schema.dense_names == ["price"] and ds.schema.user_key is None
    assert ds.schema.sparse[ds.schema.index("tags")].max_len == 3


def test_csv_and_parquet_examples_hold_the_same_rows() -> None:
    """tests/data/table_example.parquet is the CSV with typed columns (a timestamp, a list of tags)."""
    csv = pd.read_csv(EXAMPLE_CSV)
    pq = pd.read_parquet(EXAMPLE_PARQUET)
    assert pd.api.types.is_datetime64_any_dtype(pq["ts"]) and isinstance(pq["tags"].iloc[0], np.ndarray)
    assert (pq["ts"].dt.strftime("%Y-%m-%dT%H:%M:%S") == csv["ts"]).all()
    assert (pq["tags"].map("|".join) == csv["tags"]).all()
    rest = [c for c in csv.columns if c not in ("ts", "tags")]
    pd.testing.assert_frame_equal(pq[rest], csv[rest], check_dtype=False)
    example = data_of(["data=table_example"])
    from_pq = {**example, "params": {**example["params"], "path": str(EXAMPLE_PARQUET)}}
    assert build_dataset(data_config(from_pq)).fingerprint == build_dataset(data_config(example)).fingerprint


def test_yaml_written_before_a_key_existed_still_loads(tmp_path: Path) -> None:
    old = data_of(user_data(tmp_path, "old", BEFORE_ENCODING.format(base="table", path=EXAMPLE_CSV)))
    assert old["params"]["encoding"] == data_of(["data=table"])["params"]["encoding"]
    shipped = data_of(["data=table_example"])
    shipped["params"]["path"] = str(EXAMPLE_CSV)
    assert build_dataset(data_config(old)).fingerprint == build_dataset(data_config(shipped)).fingerprint


def test_a_copy_not_listing_the_base_names_the_key_and_the_fix(tmp_path: Path) -> None:
    old = data_of(user_data(tmp_path, "old", BEFORE_ENCODING.format(base="schema", path=EXAMPLE_CSV)))
    with pytest.raises(
        ConfigError,
        match=r"^data\.params\.encoding: not set\. .*conf/data/table\.yaml: start your "
        r"conf/data/<name>\.yaml with `defaults: \[table, _self_\]`",
    ):
        load_dataset(data_config(old), tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*.pt"))  # nothing cached


def test_the_base_alone_says_what_to_state(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError,
        match=r"^data\.params\.path, data\.params\.label, data\.params\.dense, data\.params\.sparse: "
        r"not set \(\?\?\? in conf/data/table\.yaml.*conf/data/table_example\.yaml is one",
    ):
        data_config(data_of(["data=table"]))
    cfg = compose(["data=table", f"data.params.path={EXAMPLE_CSV}"])
    with pytest.raises(
        ConfigError, match=r"^data\.params\.label, data\.params\.dense, data\.params\.sparse: "
    ):
        experiment_config(cfg)  # the run's entry point types `data` the same way


def test_derived_data_yamls_state_only_what_differs() -> None:
    """Every shipped data YAML lists `schema` or another data YAML as its base, and a key it states has
    a value other than its base's (a repeated value would hide a later change of the base)."""
    for f in sorted((ROOT / "conf/data").glob("*.yaml")):
        base, self_ = OmegaConf.load(f).defaults
        assert self_ == "_self_", f.name
        if base == "schema":
            continue
        mine = OmegaConf.to_container(OmegaConf.load(f))
        theirs = data_of([f"data={base}"])
        assert set(mine) <= {"defaults", "loader", "params"}, f.name
        assert mine.get("loader", theirs["loader"]) == theirs["loader"], f.name
        same = [k for k, v in mine["params"].items() if theirs["params"].get(k) == v]
        assert not same, f"{f.name} repeats {same} from {base}.yaml"


@pytest.mark.parametrize(
    "key, value, message",
    [
        (
            "min_cout",
            3,
            r"data\.params\.min_cout: not a setting of the table loader \(did you mean 'min_count'\?\)",
        ),
        ("min_count", "two", r"data\.params: min_count: Value 'two' .*Integer"),
        ("dense", "price", r"data\.params\.dense: expected a list of column entries .*got 'price'"),
        (
            "dense",
            ["price"],
            r"data\.params\.dense\[0\]: expected a mapping with keys \['column', 'side', 'log'\]",
        ),
        ("dense", [], r"data\.params\.dense: at least one dense column is required"),
        ("sparse", {"column": "user", "side": "user"}, r"data\.params\.sparse: expected a list"),
        ("label_threshold", "high", r"data\.params: label_threshold: Value 'high' .*Float"),
    ],
)
def test_config_mistakes_name_the_key(key: str, value: object, message: str) -> None:
    cfg = data_of(["data=table_example"])
    cfg["params"] |= {"path": str(EXAMPLE_CSV), key: value}
    with pytest.raises(ConfigError, match=message):
        build_dataset(data_config(cfg))


# ------------------------------------------------------------------------------------------------
# Bad input: the file and field, and what was expected


def params(path: Path, **over: object) -> DataConfig:
    cfg = data_of(["data=table_example"])
    return data_config({**cfg, "params": {**cfg["params"], "path": str(path), **over}})


def test_missing_file_or_a_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        FileNotFoundError,
        match=rf"data\.params\.path: file clicks\.csv not found \(a relative path is read from the "
        rf"working directory {tmp_path}\)",
    ):
        build_dataset(params(Path("clicks.csv")))
    with pytest.raises(FileNotFoundError, match=r"data\.params\.path: .* is a directory; expected a \.csv"):
        build_dataset(params(tmp_path))


def test_missing_columns_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError,
        match=r"data\.params\.time: column 'when' not in .*table_example\.csv; its columns: \['ts'",
    ):
        build_dataset(params(EXAMPLE_CSV, time="when"))
    with pytest.raises(
        ValueError, match=r"data\.params\.label: column 'click' not in .*table_example\.parquet"
    ):
        build_dataset(params(EXAMPLE_PARQUET, label="click"))
    with pytest.raises(
        ValueError,
        match=r"data\.params\.label: column 'clicked' not in .*; its columns: \['ts,user,.*'\] \(the header has "
        r"one column: is data\.params\.csv_separator=';' the file's separator\?\)",
    ):
        build_dataset(params(EXAMPLE_CSV, csv_separator=";"))


def test_columns_used_twice_or_as_the_label(tmp_path: Path) -> None:
    user, item = {"column": "user", "side": "user"}, {"column": "item", "side": "item"}
    with pytest.raises(ConfigError, match=r"data\.params\.sparse\[0\]\.column: 'clicked' is the label"):
        build_dataset(params(EXAMPLE_CSV, sparse=[{"column": "clicked", "side": "item"}, user, item]))
    with pytest.raises(
        ConfigError,
        match=r"data\.params\.sparse\[2\]\.column: column 'price' is already data\.params\.dense\[0\]",
    ):
        build_dataset(params(EXAMPLE_CSV, sparse=[user, item, {"column": "price", "side": "item"}]))
    with pytest.raises(ConfigError, match=r"data\.params\.item_key: 'tags' must name a single-valued sparse"):
        build_dataset(params(EXAMPLE_CSV, item_key="tags"))


def test_wrong_types_name_file_column_and_row(tmp_path: Path) -> None:
    frame = write_example_table(tmp_path / "t.csv", n=60)
    yes_no = frame.assign(clicked=np.where(frame["clicked"] == 1, "yes", "no"))
    yes_no.to_parquet(tmp_path / "yes.parquet")
    with pytest.raises(
        ValueError,
        match=r"yes\.parquet column 'clicked' \(data\.params\.label\): row \d+: label '(yes|no)', expected 0 or 1, "
        r"or true/false \(set data\.params\.label_threshold",
    ):
        build_dataset(params(tmp_path / "yes.parquet"))
    frame.assign(user_age_days="old").to_parquet(tmp_path / "age.parquet")
    with pytest.raises(
        ValueError,
        match=r"age\.parquet column 'user_age_days' \(data\.params\.dense\[1\]\): row 0: value 'old', "
        r"expected a number",
    ):
        build_dataset(params(tmp_path / "age.parquet"))
    frame.assign(ts=["soon"] * len(frame)).to_csv(tmp_path / "when.csv", index=False)
    with pytest.raises(
        ValueError,
        match=r"when\.csv column 'ts' \(data\.params\.time\): line 2: 'soon' is not a number or a date/time",
    ):
        build_dataset(params(tmp_path / "when.csv"))
    with pytest.raises(
        ValueError, match=r"label '(yes|no)', expected a number \(data\.params\.label_threshold is set\)"
    ):
        build_dataset(params(tmp_path / "yes.parquet", label_threshold=0.5))


def test_a_list_column_must_be_declared_multi_valued() -> None:
    sparse = [
        {"column": "user", "side": "user"},
        {"column": "item", "side": "item"},
        {"column": "tags", "side": "item"},
    ]
    with pytest.raises(
        ValueError,
        match=r"data\.params\.sparse\[2\]: column 'tags' of .*table_example\.parquet holds lists .*set "
        r"multi_valued: true",
    ):
        build_dataset(params(EXAMPLE_PARQUET, sparse=sparse))


def test_the_wrong_format_is_named(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"data\.params\.format: csv, but .*table_example\.parquet is a Parquet file"
    ):
        build_dataset(params(EXAMPLE_PARQUET, format="csv"))
    with pytest.raises(
        ValueError,
        match=r"data\.params\.path: .*table_example\.csv is not a readable Parquet file .*format=csv",
    ):
        build_dataset(params(EXAMPLE_CSV, format="parquet"))
    (tmp_path / "clicks").write_bytes(EXAMPLE_PARQUET.read_bytes())  # no extension: the content tells
    assert (
        build_dataset(params(tmp_path / "clicks")).fingerprint
        == build_dataset(params(EXAMPLE_PARQUET)).fingerprint
    )


def test_too_few_usable_rows_names_the_file_and_why(tmp_path: Path) -> None:
    frame = write_example_table(tmp_path / "t.csv", n=30)
    frame.loc[frame.index[:25], "clicked"] = np.nan
    frame.to_csv(tmp_path / "few.csv", index=False)
    with pytest.raises(
        ValueError,
        match=r"few\.csv: 5 usable rows \(rows left out: \{'label_missing': 25\}\); a train/val/test split "
        r"needs at least 10",
    ):
        build_dataset(params(tmp_path / "few.csv"))
