"""`search` (conf/search/default.yaml), the accuracy budget of `experiment=search`, and the check of the
sweep's search space against the composed config."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING, DictConfig, OmegaConf

from reco.config import ConfigError

# search.objective -> (what a trial returns, the Candidate field the Pareto front minimises)
OBJECTIVES = {
    "throughput": ("in-process rank throughput (1000 / rank_p50_ms, ranking calls/s)", "rank_p50_ms"),
    "size": ("model-file compression against the baseline (baseline size_mb / size_mb)", "size_mb"),
}
BUDGET_TESTS = ("point", "ci")


@dataclass
class SearchConfig:
    """`search` (conf/search/default.yaml): the accuracy budget of `experiment=search`."""

    max_auc_drop_pct: float = MISSING  # relative validation AUC drop allowed against the baseline, in %
    objective: str = MISSING  # one of OBJECTIVES: what a trial maximises within the budget
    budget_test: str = MISSING  # one of BUDGET_TESTS: point estimate or whole CI within the budget
    load_test_front: bool = MISSING  # at the sweep's end, load-test the budget-meeting Pareto-front variants

    def check(self, where: str) -> None:
        """The values the types cannot restrict (reco.config.typed calls it)."""
        if self.objective not in OBJECTIVES:
            raise ConfigError(
                f"{where}.objective: expected one of {sorted(OBJECTIVES)}, got {self.objective!r}"
            )
        if self.budget_test not in BUDGET_TESTS:
            raise ConfigError(
                f"{where}.budget_test: expected one of {BUDGET_TESTS}, got {self.budget_test!r}"
            )


_ABSENT = object()


def check_space(cfg: DictConfig) -> None:
    """Every key of hydra.sweeper.params must exist in the config; raises ConfigError naming it."""
    params = OmegaConf.select(cfg, "hydra.sweeper.params") or {}
    for key in params:
        if OmegaConf.select(cfg, str(key), default=_ABSENT) is _ABSENT:
            raise ConfigError(
                f"hydra.sweeper.params.{key}: the search space names {key!r}, which is not a key of the "
                "composed config (expected an existing setting such as prune.amount)"
            )
