"""One search trial: its variants as the objective sees them (Candidate, with the budget tests), the value
it returns to Optuna (objective), and its record `search_trial.json` (Trial), written by finish_trial
after the trial's pipeline execution."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf

from reco.experiment import ExperimentConfig
from reco.loadtest.servings import DEFAULT, cross
from reco.search.config import OBJECTIVES, SearchConfig

TRIAL_FILE = "search_trial.json"  # one per trial, in the trial's Hydra output directory
NO_VARIANT = -1e6  # objective of a trial where no candidate variant was built at all


@dataclass
class Candidate:
    """One non-baseline variant of a trial, as the objective sees it."""

    name: str
    rank_p50_ms: float  # in-process rank latency (reco.measure.rank_latency)
    val_delta_rel: float  # (val AUC - baseline val AUC) / baseline val AUC
    val_delta_lo: float | None = None  # its 95 % CI (DeLong, paired on the validation rows)
    val_delta_hi: float | None = None
    params: int = 0
    size_mb: float = 0.0  # the model file the runtime loads
    path: str = ""  # the finished variant's cache directory (what the front's load test serves)
    batched_from: str = ""  # a batching-step variant: the variant whose model it serves (not screened)

    @property
    def throughput(self) -> float:
        """Ranking calls per second, in process."""
        return 1000.0 / self.rank_p50_ms

    def score(self, kind: str, base_size_mb: float) -> float:
        """What this variant is worth to objective `kind` (higher is better)."""
        return self.throughput if kind == "throughput" else base_size_mb / self.size_mb

    def cost(self, kind: str) -> float:
        """What the Pareto front of objective `kind` minimises: rank p50 or size_mb."""
        return float(getattr(self, OBJECTIVES[kind][1]))

    def charged_drop_pct(self, test: str) -> float:
        """The relative val AUC drop (%) held against the budget: its point estimate, or with test `ci` its
        95% CI's worst end (the point estimate when the CI is unknown)."""
        lo = self.val_delta_lo
        return -(lo if test == "ci" and lo is not None else self.val_delta_rel) * 100

    def within_budget(self, budget_pct: float, test: str) -> bool:
        """Within the budget by `test` (the one rule the objective, the MLflow tags, the front and the
        summary share)."""
        return self.charged_drop_pct(test) <= budget_pct

    def verdict(self, budget_pct: float) -> str:
        """The CI's verdict on the budget: PASS (whole CI within), FAIL (whole CI beyond), else
        INCONCLUSIVE."""
        lo, hi = self.val_delta_lo, self.val_delta_hi
        if lo is None or hi is None:
            return "PASS" if self.within_budget(budget_pct, "point") else "FAIL"
        if -lo * 100 <= budget_pct:
            return "PASS"
        return "FAIL" if -hi * 100 > budget_pct else "INCONCLUSIVE"


@dataclass
class Trial:
    """A trial's record, `search_trial.json` (fields in the file's order; the defaults read records
    written before a field existed)."""

    trial: int  # Hydra's job number
    overrides: list[str]  # the sampled settings only (the sweep's fixed overrides are in every trial)
    max_auc_drop_pct: float
    objective_kind: str = "throughput"  # search.objective
    budget_test: str = "point"  # search.budget_test
    baseline_size_mb: float = 0.0
    objective: float = NO_VARIANT  # what the trial returned to Optuna
    within_budget: bool = False
    best: str | None = None  # TrialScore.best
    parent_run: str = ""  # the trial's MLflow parent run
    baseline_path: str = ""  # the baseline's cache directory (the front's load-test reference)
    candidates: list[Candidate] = field(default_factory=list)

    def within(self, c: Candidate) -> bool:
        """Candidate `c` of this trial is within the trial's budget, by the trial's budget test."""
        return c.within_budget(self.max_auc_drop_pct, self.budget_test)

    def candidate(self, name: str) -> Candidate:
        return next(c for c in self.candidates if c.name == name)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Trial:
        return Trial(**{**d, "candidates": [Candidate(**c) for c in d.get("candidates", [])]})

    @staticmethod
    def load(path: Path) -> Trial:
        return Trial.from_dict(json.loads(path.read_text()))


@dataclass
class TrialScore:
    """What objective() decided for one trial."""

    objective: float
    within_budget: bool
    best: str | None  # the fastest variant within the budget, or the one nearest to it


def objective(
    cands: list[Candidate],
    max_auc_drop_pct: float,
    kind: str = "throughput",
    base_size_mb: float = 0.0,
    test: str = "point",
) -> TrialScore:
    """The value a trial returns to Optuna (see reco.search for the penalty convention).

    Args:
        cands: the trial's built non-baseline variants.
        max_auc_drop_pct: the budget, relative validation AUC drop in %.
        kind: search.objective, a key of OBJECTIVES.
        base_size_mb: the baseline's model file (what `size` compares against).
        test: search.budget_test, a member of BUDGET_TESTS.
    Returns:
        The objective, whether any variant met the budget, and which variant decided it.
    """
    cands = [c for c in cands if not c.batched_from]
    ok = [c for c in cands if c.within_budget(max_auc_drop_pct, test)]
    if ok:
        best = max(ok, key=lambda c: c.score(kind, base_size_mb))
        return TrialScore(best.score(kind, base_size_mb), True, best.name)
    if not cands:
        return TrialScore(NO_VARIANT, False, None)
    nearest = min(cands, key=lambda c: c.charged_drop_pct(test))
    return TrialScore(-(nearest.charged_drop_pct(test) - max_auc_drop_pct), False, nearest.name)


def finish_trial(exp: ExperimentConfig, sc: SearchConfig, built: list) -> float:
    """Score a finished pipeline execution as a search trial: validation ΔAUC of every built variant,
    the objective, MLflow metrics/tags on the trial's runs and `search_trial.json` in its output dir.

    Args:
        exp: the trial's typed experiment (reco.experiment).
        sc: its `search` section.
        built: reco.pipeline.run's result, parents first.
    Returns:
        The objective (float), what run.py's main hands to the sweeper.
    """
    from hydra.core.hydra_config import HydraConfig

    from reco.tracking import Tracker

    tracker = Tracker(exp.tracking.uri, exp.experiment_name, exp.tracking.artifact_root)
    base = next(b for b in built if b.node.spec.root)
    parent_run = tracker.client.get_run(base.run_id).data.tags.get("mlflow.parentRunId", "")
    cands = _candidates(exp, built, base, sc, tracker) if base.variant is not None else []
    base_mb = base.variant.size_mb if base.variant is not None else 0.0
    score = objective(cands, sc.max_auc_drop_pct, sc.objective, base_mb, sc.budget_test)
    hc = HydraConfig.get()
    space = set(hc.sweeper.get("params") or {})
    record = Trial(
        trial=OmegaConf.select(hc, "job.num", default=0),  # a single run (no -m) has none
        overrides=[o for o in hc.overrides.task if o.split("=", 1)[0] in space],
        max_auc_drop_pct=sc.max_auc_drop_pct,
        objective_kind=sc.objective,
        budget_test=sc.budget_test,
        baseline_size_mb=base_mb,
        objective=score.objective,
        within_budget=score.within_budget,
        best=score.best,
        parent_run=parent_run,
        baseline_path=str(base.variant.path) if base.variant is not None else "",
        candidates=cands,
    )
    out = Path(hc.runtime.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / TRIAL_FILE).write_text(record.to_json())
    if parent_run:
        tracker.log(
            parent_run,
            metrics={"search_objective": score.objective},
            tags={"search.within_budget": str(score.within_budget).lower(), "search.best": score.best or ""},
        )
    print(
        f"[search] trial {record.trial}: objective {score.objective:.4g} "
        f"({'within' if score.within_budget else 'NOT within'} the {sc.max_auc_drop_pct}% budget; {score.best})",
        flush=True,
    )
    return float(score.objective)


def _candidates(
    exp: ExperimentConfig, built: list, base: Any, sc: SearchConfig, tracker: Any
) -> list[Candidate]:
    """Every built non-baseline variant with its paired val ΔAUC against the baseline; each variant's
    MLflow run gets the ΔAUC, its in-process throughput and whether it is within the budget."""
    from reco.data import load_dataset
    from reco.stats import auc_delta

    data, _ = load_dataset(exp.data, exp.cache_dir / "data")
    labels = data.val.labels.numpy()
    base_scores = _val_scores(base.variant, data, exp)
    # the same model served another way (loadtest.study.servings, e.g. the batcher): the screen cannot
    # tell it apart, the front's load test can; its row there is named like this copy
    served = [(b.name, b.variant) for b in built if b.variant is not None]
    otherwise: dict[str, list[str]] = {}
    for p in cross(served, exp.loadtest.study.servings):
        if p.serving_name != DEFAULT:
            otherwise.setdefault(p.variant.name, []).append(p.label)
    cands = []
    for b in built:
        if b is base or b.variant is None:
            continue
        _, rel = auc_delta(labels, base_scores, _val_scores(b.variant, data, exp))
        m, path = b.variant.metrics, str(b.variant.path)
        c = Candidate(
            b.name, m["rank_p50_ms"], rel.value, rel.lo, rel.hi, b.variant.params, b.variant.size_mb, path
        )  # fmt: skip
        cands.append(c)
        cands += [dataclasses.replace(c, name=lab, batched_from=b.name) for lab in otherwise.get(b.name, [])]
        tracker.log(
            b.run_id,
            metrics={"val_auc_delta_rel": c.val_delta_rel, "rank_calls_per_s": c.throughput},
            tags={"search.within_budget": str(c.within_budget(sc.max_auc_drop_pct, sc.budget_test)).lower()},
        )
    return cands


def _val_scores(v: Any, data: Any, exp: ExperimentConfig) -> np.ndarray:
    """[N val rows] float32 scores of a finished variant, cached beside the variant cache by the variant's
    directory name (name + content hash), so the shared baseline is scored once per sweep."""
    from reco.measure import load_scores, predict, save_scores
    from reco.runtime import load_scorer

    path = exp.cache_dir / "val_scores" / f"{v.path.name}.npy"
    if path.exists():
        return load_scores(path)
    scores = predict(load_scorer(v, threads=exp.trainer.threads, batch=True), data.val).astype(np.float32)
    save_scores(path, scores)
    return scores
