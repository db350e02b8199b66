"""The experiment as one typed object, composed once (reco.cli.run) and passed down.

    exp = experiment_config(cfg)     # cfg: Hydra's composed DictConfig, on the top floor only
    run(exp, ctx)                    # reco.pipeline: every module below gets its typed section

Each section is its module's schema dataclass (typed and range-checked by reco.config.typed, errors
naming the key); the variant graph is planned here too, so a bad step setting stops before anything
slow. Only `resolved` keeps the composed config as plain data, for the record (MLflow params and
resolved_config.yaml).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig

from reco.config import ConfigError, resolve_config, typed
from reco.data.config import DataConfig, data_config
from reco.graph import Node, plan
from reco.loadtest.config import LoadtestConfig
from reco.loadtest.servings import label, pairs
from reco.measure import RankLatencyConfig
from reco.profile import ProfileConfig
from reco.retrieval.front import FrontConfig
from reco.retrieval.two_tower import TwoTowerConfig
from reco.serve.config import ServeConfig
from reco.serve.quality import QualityConfig
from reco.tracking_server import TrackingConfig
from reco.train.loop import TrainConfig


@dataclass
class GateConfig:
    """`gate` (conf/config.yaml): the report's quality gate."""

    max_auc_drop_pct: float = MISSING  # relative AUC drop against the baseline a variant may have, in %
    # relative drop of the served top-k's expected clicks@k (quality.k), graded by the planted P(click):
    # gates on data with a planted click model
    max_expected_clicks_drop_pct: float = MISSING
    max_gauc_drop_pct: float = MISSING  # relative GAUC drop on the test split: gates on any other data

    def check(self, where: str) -> None:
        for key in ("max_auc_drop_pct", "max_expected_clicks_drop_pct", "max_gauc_drop_pct"):
            v = getattr(self, key)
            if not 0 <= v < 100:
                raise ConfigError(f"{where}.{key}={v}: expected a drop in percent, 0 <= {key} < 100")


@dataclass
class RunContext:
    """Where this execution writes, as the launcher (Hydra) decided it."""

    out_dir: Path  # this job's output directory
    multirun: bool = False  # one job of a sweep: its report goes under out_dir, not report_dir
    overrides: list[str] = field(default_factory=list)  # the user's overrides, experiment= excluded
    sweep_dir: str = ""  # a sweep's directory (multirun only)


@dataclass
class ExperimentConfig:
    experiment_name: str
    seed: int
    cache_dir: Path  # datasets and finished variants, reused by content hash
    report_dir: Path
    data: DataConfig
    trainer: TrainConfig
    serve: ServeConfig
    loadtest: LoadtestConfig
    tracking: TrackingConfig
    rank_latency: RankLatencyConfig
    profile: ProfileConfig
    quality: QualityConfig
    two_tower: TwoTowerConfig  # `retrieval.two_tower`: trained when serve.retrieval.kind=two_tower
    front: FrontConfig  # `retrieval.front`: the indexes measured beside that stage for the report
    gate: GateConfig
    targets: dict[str, Any]  # the preset's goals, checked in the report (reco.report.targets)
    headline: str | None  # the row the headline targets are judged on; None: the best is selected
    variants: list[Node]  # the variant graph, parents first, each node with its typed step config
    resolved: dict[str, Any]  # every key as composed and resolved, `hydra` excluded (for the record)


def experiment_config(cfg: DictConfig) -> ExperimentConfig:
    """Type every section of the composed config and plan the variant graph (ConfigError names the key).
    The config is resolved once; every section, and the graph, is typed from that one resolution."""
    resolved = resolve_config(cfg)
    exp = ExperimentConfig(
        experiment_name=str(resolved["experiment_name"]),
        seed=int(resolved["seed"]),
        cache_dir=Path(resolved["cache_dir"]),
        report_dir=Path(resolved["report_dir"]),
        data=data_config(resolved["data"]),
        trainer=typed(resolved["trainer"], TrainConfig, "trainer"),
        serve=typed(resolved["serve"], ServeConfig, "serve"),
        loadtest=typed(resolved["loadtest"], LoadtestConfig, "loadtest"),
        tracking=typed(resolved["tracking"], TrackingConfig, "tracking"),
        rank_latency=typed(resolved["rank_latency"], RankLatencyConfig, "rank_latency"),
        profile=typed(resolved["profile"], ProfileConfig, "profile"),
        quality=typed(resolved["quality"], QualityConfig, "quality"),
        two_tower=typed(resolved["retrieval"]["two_tower"], TwoTowerConfig, "retrieval.two_tower"),
        front=typed(resolved["retrieval"]["front"], FrontConfig, "retrieval.front"),
        gate=typed(resolved["gate"], GateConfig, "gate"),
        targets=dict(resolved.get("targets") or {}),
        headline=None,
        variants=plan(resolved),
        resolved=resolved,
    )
    exp.headline = check_headline(resolved.get("headline"), exp.variants, exp.loadtest)
    return exp


def study_rows(nodes: list[Node], lt: LoadtestConfig) -> list[str]:
    """The report's rows: every variant of the graph, and each serving row the study adds (reco.loadtest.servings)."""
    return [label(n, s) for n, s, _ in pairs([n.name for n in nodes], lt.study.servings)]


def check_headline(headline: object, nodes: list[Node], lt: LoadtestConfig) -> str | None:
    """`headline` (conf/config.yaml) as a row name, checked before anything slow runs: ConfigError naming
    the key and the rows available when it is not one of them."""
    if headline is None:
        return None
    rows = study_rows(nodes, lt)
    if not isinstance(headline, str) or headline not in rows:
        raise ConfigError(f"headline={headline!r}: expected null or one of the study's variants {rows}")
    return headline
