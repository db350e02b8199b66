"""End to end: `run.py experiment=smoke` in a subprocess, then the MLflow store and the report are read."""

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient

from reco.config import register
from reco.pipeline import ConfigError, plan

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))


def run_py(tmp_path: Path, *overrides: str, timeout: int = 300) -> subprocess.CompletedProcess:
    args = [
        f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
        f"tracking.artifact_root={tmp_path}/artifacts",
        f"cache_dir={tmp_path}/cache",
        f"report_dir={tmp_path}/report",
        f"hydra.run.dir={tmp_path}/out",
        *overrides,
    ]
    return subprocess.run(
        [sys.executable, "run.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_composes_and_plans(preset):
    register()  # the config groups' schemas, as run.py does
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"experiment={preset}"], return_hydra_config=False)
    from omegaconf import OmegaConf

    c = OmegaConf.to_container(cfg, resolve=False)
    nodes = plan(c)
    assert nodes[0].step == "train"
    names = [n.name for n in nodes]
    for n in nodes:  # parents first
        assert n.parent is None or names.index(n.parent) < names.index(n.name)


def test_bad_variant_graph_names_the_field():
    base = {"prune": {}, "distill": {}, "accelerate": {}, "batching": {}}
    with pytest.raises(ConfigError, match=r"variants\.p\.parent: 'nope' is not a variant"):
        plan({**base, "variants": {"b": {"step": "train"}, "p": {"step": "prune", "parent": "nope"}}})
    with pytest.raises(ConfigError, match=r"variants\.b\.step: expected one of"):
        plan({**base, "variants": {"b": {"step": "fly"}}})


@pytest.mark.timeout(600)
def test_smoke_experiment_end_to_end(tmp_path):
    proc = run_py(tmp_path, "experiment=smoke")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("smoke")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = {r.data.tags["variant"]: r for r in runs if "mlflow.parentRunId" in r.data.tags}
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert set(children) == {
        "baseline",
        "pruned",
        "distilled",
        "distilled_onnx_int8",
        "distilled_onnx_int8_batched",
    }
    base = children["baseline"].data.metrics
    assert base["auc"] > 0.6, base  # planted signal: clearly above chance
    assert base["oracle_auc"] >= base["auc"] - 0.02
    for name, run in children.items():
        m = run.data.metrics
        assert run.info.status == "FINISHED", (name, run.data.tags.get("error"))
        for key in (
            "auc",
            "logloss",
            "params",
            "size_mb",
            "rank_p50_ms",
            "e2e_p50_ms",
            "e2e_p99_ms",
            "qps",
            "max_qps_at_slo",
        ):
            assert key in m, (name, key)
        assert m["e2e_p99_ms"] >= m["e2e_p50_ms"] > 0
        assert run.data.tags["parent_variant"] == (
            "" if name == "baseline" else run.data.tags["parent_variant"]
        )
    assert children["pruned"].data.metrics["params"] < 0.75 * base["params"]
    assert children["distilled_onnx_int8"].data.params["backend"] == "onnxruntime"
    report = (tmp_path / "report" / "report.md").read_text()
    assert "distilled_onnx_int8" in report and "SLO" in report

    # A re-run reuses every finished variant (content hash) instead of training again.
    again = run_py(tmp_path, "experiment=smoke", "loadtest.enabled=false")
    assert again.returncode == 0, again.stderr[-4000:]
    assert again.stdout.count("reusing finished variant") == 5


def test_unreachable_tracking_server_fails_before_training(tmp_path):
    proc = run_py(tmp_path, "experiment=smoke", "tracking.uri=http://127.0.0.1:9", timeout=120)
    assert proc.returncode != 0
    assert "cannot reach MLflow tracking server" in proc.stderr + proc.stdout
    assert "[variant" not in proc.stdout
