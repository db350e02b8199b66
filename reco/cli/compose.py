"""Hydra composition and the schema index: every config group's dataclass registered in the ConfigStore.

The YAML files under conf/ hold the values (the one place defaults live); the dataclasses hold the
types and the documentation. Each group's YAML starts with `defaults: [schema, _self_]`, so Hydra checks
every key and type at compose time and an error names the real override key (`serve.batching.max_batch`).
Each module owns its schema dataclass (as TorchRec's embedding_configs sits beside its modules); this is
only the index, and it sits on the top floor so that no library module depends on all the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from reco.config import CONF_DIR, ConfigError, describe


def compose(overrides: Sequence[str] = (), config_name: str = "config") -> DictConfig:
    """The experiment config as `python run.py <overrides>` would see it (Hydra's compose API).

    Args:
        overrides: Hydra overrides, e.g. ["experiment=smoke", "serve.batching.enabled=true"].
        config_name: the primary config under conf/.
    Returns:
        The composed, schema-checked config.
    """
    register()
    try:
        if GlobalHydra.instance().is_initialized():
            return hydra_compose(config_name, overrides=list(overrides))
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return hydra_compose(config_name, overrides=list(overrides))
    except (ConfigCompositionException, OmegaConfBaseException) as e:
        cause = e.__cause__
        detail = describe(cause) if isinstance(cause, OmegaConfBaseException) else ""
        raise ConfigError(f"{str(e).splitlines()[0]}" + (f": {detail}" if detail else "")) from None


_registered = False


def register() -> None:
    """Store every group's schema (idempotent; run.py calls it before @hydra.main composes)."""
    global _registered
    if _registered:
        return
    from reco.steps import steps

    cs = ConfigStore.instance()
    for (group, name), node in _schemas().items():
        cs.store(group=group, name=name, node=node)
    # Every registered step's defaults at the key its variants read them from (conf/config.yaml lists
    # `step_defaults`), so a new step needs no edit here or in config.yaml.
    step_defaults = [
        {f"step@{s.config_key}": s.name}
        for s in steps().values()
        if s.config_key == s.name and (CONF_DIR / "step" / f"{s.name}.yaml").exists()
    ]
    cs.store(name="step_defaults", node={"defaults": step_defaults})
    _registered = True


def _schemas() -> dict[tuple[str, str], type | dict]:
    """(group, schema name) -> dataclass. A group YAML lists its schema first in its defaults:
    `defaults: [schema, _self_]` (conf/step/*.yaml: `[prune_schema, _self_]` etc.)."""
    # Server and test processes compose too, so these modules (and the steps' and models' they import)
    # keep torchrec, fbgemm_gpu, mlflow and scipy.stats out of their module top, importing them where used
    # (guarded by tests/test_dependencies.py::test_a_server_of_an_onnx_variant_imports_no_training_stack).
    from reco.data.config import DataConfig
    from reco.export.triton import TritonExportConfig
    from reco.loadtest.config import LoadtestConfig
    from reco.search import SearchConfig
    from reco.serve.config import ServeConfig
    from reco.steps import steps
    from reco.tracking_server import TrackingConfig
    from reco.train.loop import TrainConfig

    schemas: dict[tuple[str, str], type | dict] = {
        ("data", "schema"): DataConfig,
        ("export", "triton_schema"): TritonExportConfig,
        ("loadtest", "schema"): LoadtestConfig,
        ("search", "schema"): SearchConfig,
        ("serve", "schema"): ServeConfig,
        ("trainer", "schema"): TrainConfig,
        ("tracking", "schema"): TrackingConfig,
    }
    for s in steps().values():
        if s.config_key == s.name:
            schemas[("step", f"{s.name}_schema")] = s.config
    schemas.update(_model_schemas())
    return schemas


def _model_schemas() -> dict[tuple[str, str], type | dict]:
    """("model", "<name>_schema") -> the Settings of the class conf/model/<name>.yaml's `_target_` names.

    A class that cannot be resolved gets an open schema, so composing still works and the train step's
    plan check (reco.models.protocol.resolve) names model._target_ and what is wrong with it."""
    from reco.models.protocol import allowed_targets, resolve

    out: dict[tuple[str, str], type | dict] = {}
    for target, file in allowed_targets().items():
        try:
            out[("model", f"{Path(file).stem}_schema")] = resolve(target, file).Settings
        except ConfigError:
            out[("model", f"{Path(file).stem}_schema")] = {}
    return out
