"""`experiment=quick` runs on any data group; `experiment=smoke` is quick on the small synthetic data.

The presets set budgets (model size, epochs, row caps, load-test windows), never the data, so every
shipped conf/data/*.yaml composes with them and keeps its own settings. The end-to-end test runs
run.py as a user would on their own table: a data YAML of their own (found through
hydra.searchpath) on the Parquet example in tests/data.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import premade_store
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf
from test_pipeline import run_py

from reco.cli.compose import compose
from reco.config import resolve_config
from reco.graph import plan

ROOT = Path(__file__).resolve().parents[1]
DATA_GROUPS = sorted(p.stem for p in (ROOT / "conf" / "data").glob("*.yaml"))
CHAIN = ["baseline", "pruned", "distilled", "distilled_onnx_int8"]


def plain(overrides: list[str]) -> dict:
    return OmegaConf.to_container(compose(overrides), resolve=True)


@pytest.mark.parametrize("data", DATA_GROUPS)
@pytest.mark.parametrize("preset", ["quick", "smoke"])
def test_preset_composes_and_plans_with_every_data_group(preset: str, data: str) -> None:
    cfg = compose([f"experiment={preset}", f"data={data}"])
    assert [n.name for n in plan(resolve_config(cfg))] == CHAIN
    # the preset leaves the data as the group states it
    assert OmegaConf.to_container(cfg.data, resolve=True) == plain([f"data={data}"])["data"]


def test_smoke_is_quick_on_the_small_synthetic_data() -> None:
    smoke = plain(["experiment=smoke"])
    quick = plain(["experiment=quick", "data=synthetic_small"])
    assert (smoke.pop("experiment_name"), quick.pop("experiment_name")) == ("smoke", "quick")
    assert (smoke.pop("report_dir"), quick.pop("report_dir")) == ("experiments/smoke", "experiments/quick")
    assert smoke == quick


def test_quick_caps_what_grows_with_the_data() -> None:
    """Per-epoch training and evaluation rows are capped, so a large table costs no more epochs' time
    than the cap (the file itself is still read whole)."""
    cfg = plain(["experiment=quick"])
    default = plain([])
    assert cfg["trainer"]["epochs"] <= 2 and cfg["distill"]["epochs"] <= 1
    for key, value in (
        ("max_rows_per_epoch", cfg["trainer"]["max_rows_per_epoch"]),
        ("distill.rows_per_epoch", cfg["distill"]["rows_per_epoch"]),
        ("eval_rows", cfg["trainer"]["eval_rows"]),
    ):
        assert value is not None and value <= 100_000, key
    assert cfg["loadtest"]["study"]["repeats"] == 1
    assert cfg["loadtest"]["study"]["load_requests"] < default["loadtest"]["study"]["load_requests"]


USER_YAML = """
defaults: [table, _self_]
params:
  path: {path}
  label: clicked
  time: ts
  user_key: user
  item_key: item
  dense: [{{column: price, side: item, log: true}}, {{column: user_age_days, side: user}}]
  sparse: [{{column: user, side: user}}, {{column: item, side: item}}, {{column: category, side: item}},
           {{column: tags, side: item, multi_valued: true, max_len: 4}}, {{column: device, side: context}}]
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_preset_end_to_end_on_a_users_parquet_table(tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    (conf / "data").mkdir(parents=True)
    (conf / "data" / "clicks.yaml").write_text(
        USER_YAML.format(path=ROOT / "tests/data/table_example.parquet")
    )
    # The load study reads the dataset's cache file, whatever its source format, so it stays out of this
    # subprocess (test_pipeline's end-to-end test serves and load-tests the preset): ~70 s of make test.
    premade_store(tmp_path)
    proc = run_py(
        tmp_path,
        "experiment=quick",
        "data=clicks",
        f"hydra.searchpath=[file://{conf}]",
        "loadtest.enabled=false",
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "[data] table_example: train 1,600 val 200 test 200 rows" in proc.stdout

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("quick").experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = {r.data.tags["variant"]: r for r in runs if "mlflow.parentRunId" in r.data.tags}
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert sorted(children) == sorted(CHAIN)  # no load study: no serving rows
    for name, run in children.items():
        m = run.data.metrics
        assert run.info.status == "FINISHED", (name, run.data.tags.get("error"))
        assert 0.0 <= m["auc"] <= 1.0 and m["rank_p50_ms"] > 0, (name, m)
    assert "distilled_onnx_int8" in (tmp_path / "report" / "report.md").read_text()
