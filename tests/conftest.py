import atexit
import dataclasses
import functools
import os
import shutil
import tempfile
import time
from pathlib import Path

# Before torch loads libgomp, which reads it once (inherited by every process a test starts). Two xdist
# workers each running torch on 2 threads oversubscribe 2 cores, and OpenMP's default busy-wait makes the
# waiting threads spin on the cores the working ones need: the smoke preset's training took 54 s against
# 7 s with passive waiting (AVX2 EPYC, next to another 2-thread torch process; same AUCs to 4 digits).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import psutil
import pytest
import torch

from reco.cli.compose import compose
from reco.config import typed
from reco.data.schema import Dataset
from reco.data.synthetic import SyntheticConfig, generate
from reco.measure import evaluate
from reco.models.dlrm import DLRM, DLRMConfig
from reco.runtime import load_scorer
from reco.train.loop import TrainConfig, train
from reco.variant import Variant

# ~1 s to generate: 20k rows with the same feature layout as the default synthetic e-commerce data.
TINY = SyntheticConfig(
    n_rows=20_000,
    n_users=2_000,
    n_items=1_000,
    n_categories=50,
    n_brands=100,
    latent_dim=8,
    max_recent=4,
    seed=0,
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules holding an end-to-end (`slow`) test run first: `make test` hands whole modules to its
    xdist workers in this order (--dist loadfile --no-loadscope-reorder), so the ~1-2 min modules start
    at once instead of leaving one worker alone with them at the end."""
    heavy = {item.module.__name__ for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module.__name__ not in heavy)


def trainer_config(**overrides) -> TrainConfig:
    """conf/trainer/default.yaml as the pipeline types it, with `overrides` (no defaults repeated here)."""
    return dataclasses.replace(typed(compose().trainer, TrainConfig, "trainer"), **overrides)


@pytest.fixture(scope="session")
def tiny_data() -> Dataset:
    return generate(TINY)


def make_variant(data: Dataset, root: Path, onnx: bool = False) -> tuple[Path, Path]:
    """Dataset file + an untrained tiny DLRM variant (fixed seed) under root; onnx: that model exported to
    ONNX fp32 (one export per test process and dataset, copied), for tests of what a server does over HTTP
    whatever its runtime: such a server starts without importing torch, ~1 s of CPU less per start."""
    data_path = root / "data.pt"
    data.save(str(data_path))
    if onnx:
        return Path(shutil.copytree(_onnx_variant(data), root / "variant")), data_path
    return _torch_variant(data, root), data_path


def _torch_variant(data: Dataset, root: Path) -> Path:
    torch.manual_seed(0)
    model = DLRM(DLRMConfig.from_schema(data.schema, embedding_dim=16, bottom=[32, 16], top=[64, 32]))
    v = Variant("tiny", "train", None, "torch", {}, dir=str(root / "variant"))
    v.save_torch(model)
    v.save()
    return Path(v.dir)


_ONNX_VARIANTS: dict[str, Path] = {}  # dataset fingerprint -> its ONNX variant (this test process's)


def _onnx_variant(data: Dataset) -> Path:
    """make_variant's model as an ONNX fp32 variant, built once per test process and dataset (removed when
    the process exits)."""
    from reco.graph import step_config
    from reco.steps import StepRun, accelerate, get_step

    if data.fingerprint in _ONNX_VARIANTS:
        return _ONNX_VARIANTS[data.fingerprint]
    root = Path(tempfile.mkdtemp(prefix="reco-onnx-variant-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    parent = Variant.load(_torch_variant(data, root))
    cfg = step_config(compose(), get_step("accelerate"), {"mode": "onnx_fp32", "tune": None}, "variants.onnx")
    trainer = trainer_config(threads=2, progress=False)
    _ONNX_VARIANTS[data.fingerprint] = Path(
        accelerate.run(parent, data, cfg, StepRun("tiny", root / "onnx", trainer)).dir
    )
    return _ONNX_VARIANTS[data.fingerprint]


# Step tests: a small trainer budget and a trained parent, shared across test modules.
@pytest.fixture(scope="session")
def data(tiny_data):
    return tiny_data


@pytest.fixture(scope="session")
def trainer():
    return trainer_config(
        epochs=1,
        batch_size=512,
        lr=5e-3,
        threads=2,
        progress=False,
        max_rows_per_epoch=12_000,
        eval_rows=2_000,
    )


@pytest.fixture(scope="session")
def parent(data, trainer, tmp_path_factory) -> Variant:
    """A tiny DLRM (embedding_dim 16) trained on part of one epoch, saved as a baseline variant with its
    test AUC: the parent the step tests start from (steps never write into it; tests check that)."""
    torch.manual_seed(0)
    model = DLRM(DLRMConfig.from_schema(data.schema, embedding_dim=16, bottom=[32, 16], top=[64, 32]))
    train(model, data, trainer)
    v = Variant("base", "train", None, "torch", {}, dir=str(tmp_path_factory.mktemp("base")))
    v.save_torch(model)
    v.metrics.update(evaluate(load_scorer(v), data.test))
    v.save()
    return v


@pytest.fixture(scope="session")
def untuned_int8(parent, data, trainer, tmp_path_factory) -> Variant:
    """The parent as a dynamic-INT8 ONNX variant, its session left untuned (test_steps tunes its own): one build
    per test process for every module that only reads it (the served-once graph, the batched correctness
    check, which needs scores that move with their batch-mates)."""
    from reco.graph import step_config
    from reco.steps import StepRun, accelerate, get_step

    cfg = step_config(
        compose(),
        get_step("accelerate"),
        {"mode": "onnx_int8", "tune": None, "quantize": {"static": False}},
        "variants.int8",
    )
    return accelerate.run(parent, data, cfg, StepRun("int8", tmp_path_factory.mktemp("int8"), trainer))


@functools.cache
def _store_template() -> Path:
    """An empty MLflow sqlite store, made once per test process (removed when it exits)."""
    from mlflow.tracking import MlflowClient

    root = Path(tempfile.mkdtemp(prefix="reco-mlflow-template-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db").search_experiments()
    return root / "mlflow.db"


def premade_store(directory: Path) -> Path:
    """directory/mlflow.db as an empty MLflow store whose tables already exist. MLflow makes a new sqlite
    store's tables by running its alembic migrations, 3-5 s of CPU in every process that opens one (more on
    a busy machine); a test that needs a store, not the making of one, copies one made once per test process.
    The making itself stays tested where it matters: tests/test_tracking.py and the parallel jobs of
    tests/test_sweeps.py and the submitit multirun open fresh stores."""
    directory.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copyfile(_store_template(), directory / "mlflow.db"))


# Processes a test started, found by an environment variable every descendant inherits: unlike a list of
# children taken while the parent lived, this also finds one reparented to init before it was ever seen.
MARK = "RECO_TEST_PROCESS_MARK"


def marked_env(mark: str) -> dict[str, str]:
    """os.environ + PYTHONPATH of this checkout + the mark every descendant will carry."""
    return {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), MARK: mark}


def marked_alive(mark: str, within_s: float) -> list[str]:
    """Command lines of processes carrying `mark` still running (not zombies) after up to `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        alive = []
        for p in psutil.process_iter():
            try:
                if p.environ().get(MARK) == mark and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    out = []
    for p in alive:  # never leave one behind, even when the test fails
        try:
            out.append(f"{p.pid}: {' '.join(p.cmdline())[:120]}")
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return out
