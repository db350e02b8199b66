"""Accuracy-budget search (`python run.py -m experiment=search`): Hydra's Optuna sweeper proposes step
settings, each trial is one pipeline execution, and this module turns a trial's variants into the value
Optuna maximises and, at the end of the sweep, into a summary naming the winner.

Objective (what a trial returns to Optuna): the in-process rank throughput, 1000 / rank_p50_ms (ranking
calls of serve.n_candidates candidates per second, one scorer, no server), of the trial's fastest variant
whose relative validation AUC drop against the baseline is within `search.max_auc_drop_pct`. It screens;
the full load test (max QPS at the SLO) of the front's candidates is not run by the search yet.

Penalty convention: a trial with no variant within the budget returns minus how far its best variant is
over the budget, in percentage points (always < 0 < any feasible throughput, and larger the nearer it came,
so the sampler is steered toward the budget); a trial with no variant built returns NO_VARIANT. Its MLflow
parent run carries the tag `search.within_budget=false`.

ΔAUC is paired (DeLong) on the validation split: the test split stays the report's.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from hydra.experimental.callback import Callback
from omegaconf import MISSING, DictConfig, OmegaConf

from reco.config import ConfigError, typed

TRIAL_FILE = "search_trial.json"  # one per trial, in the trial's Hydra output directory
SUMMARY_FILE = "search_summary.md"  # in the sweep directory
PARETO_FILE = "search_pareto.png"
NO_VARIANT = -1e6  # objective of a trial where no candidate variant was built at all


@dataclass
class SearchConfig:
    """`search` (conf/search/default.yaml): the accuracy budget of `experiment=search`."""

    max_auc_drop_pct: float = MISSING  # relative validation AUC drop allowed against the baseline, in %


@dataclass
class Candidate:
    """One non-baseline variant of a trial, as the objective sees it."""

    name: str
    rank_p50_ms: float  # in-process rank latency (reco.measure.rank_latency)
    val_delta_rel: float  # (val AUC - baseline val AUC) / baseline val AUC
    val_delta_lo: float | None = None  # its 95 % CI (DeLong, paired on the validation rows)
    val_delta_hi: float | None = None
    params: int = 0

    @property
    def drop_pct(self) -> float:
        return -self.val_delta_rel * 100

    @property
    def throughput(self) -> float:
        """Ranking calls per second, in process."""
        return 1000.0 / self.rank_p50_ms


@dataclass
class TrialScore:
    """What objective() decided for one trial."""

    objective: float
    within_budget: bool
    best: str | None  # the fastest variant within the budget, or the one nearest to it


def objective(cands: list[Candidate], max_auc_drop_pct: float) -> TrialScore:
    """The value a trial returns to Optuna (see the module docstring for the penalty convention).

    Args:
        cands: the trial's built non-baseline variants.
        max_auc_drop_pct: the budget, relative validation AUC drop in %.
    Returns:
        The objective, whether any variant met the budget, and which variant decided it.
    """
    ok = [c for c in cands if c.drop_pct <= max_auc_drop_pct]
    if ok:
        best = max(ok, key=lambda c: c.throughput)
        return TrialScore(best.throughput, True, best.name)
    if not cands:
        return TrialScore(NO_VARIANT, False, None)
    nearest = min(cands, key=lambda c: c.drop_pct)
    return TrialScore(-(nearest.drop_pct - max_auc_drop_pct), False, nearest.name)


def finish_trial(cfg: DictConfig, built: list) -> float:
    """Score a finished pipeline execution as a search trial: validation ΔAUC of every built variant,
    the objective, MLflow metrics/tags on the trial's runs and `search_trial.json` in its output dir.

    Args:
        cfg: the trial's composed config (with a `search` block).
        built: reco.pipeline.run's result, parents first.
    Returns:
        The objective (float), what run.py's main hands to the sweeper.
    """
    from hydra.core.hydra_config import HydraConfig

    from reco.data import load_dataset
    from reco.stats import auc_delta
    from reco.tracking import Tracker

    sc = typed(cfg.search, SearchConfig, "search")
    tracker = Tracker(cfg.tracking.uri, cfg.experiment_name, cfg.tracking.artifact_root)
    base = next(b for b in built if b.node.spec.root)
    parent_run = tracker.client.get_run(base.run_id).data.tags.get("mlflow.parentRunId", "")
    cands: list[Candidate] = []
    if base.variant is not None:
        data, _ = load_dataset(OmegaConf.to_container(cfg.data, resolve=True), Path(cfg.cache_dir) / "data")
        labels = data.val.labels.numpy()
        base_scores = _val_scores(base.variant, data, cfg)
        for b in built:
            if b is base or b.variant is None:
                continue
            _, rel = auc_delta(labels, base_scores, _val_scores(b.variant, data, cfg))
            c = Candidate(
                b.name, b.variant.metrics["rank_p50_ms"], rel.value, rel.lo, rel.hi, b.variant.params
            )
            cands.append(c)
            within = c.drop_pct <= sc.max_auc_drop_pct
            tracker.log(
                b.run_id,
                metrics={"val_auc_delta_rel": c.val_delta_rel, "rank_calls_per_s": c.throughput},
                tags={"search.within_budget": str(within).lower()},
            )
    score = objective(cands, sc.max_auc_drop_pct)
    hc = HydraConfig.get()
    space = set(hc.sweeper.get("params") or {})
    record = {
        "trial": OmegaConf.select(hc, "job.num", default=0),  # a single run (no -m) has none
        # the sampled settings only (the sweep's fixed overrides are the same in every trial)
        "overrides": [o for o in hc.overrides.task if o.split("=", 1)[0] in space],
        "max_auc_drop_pct": sc.max_auc_drop_pct,
        "objective": score.objective,
        "within_budget": score.within_budget,
        "best": score.best,
        "parent_run": parent_run,
        "candidates": [asdict(c) for c in cands],
    }
    out = Path(hc.runtime.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / TRIAL_FILE).write_text(json.dumps(record, indent=1))
    if parent_run:
        tracker.log(
            parent_run,
            metrics={"search_objective": score.objective},
            tags={"search.within_budget": str(score.within_budget).lower(), "search.best": score.best or ""},
        )
    print(
        f"[search] trial {record['trial']}: objective {score.objective:.4g} "
        f"({'within' if score.within_budget else 'NOT within'} the {sc.max_auc_drop_pct}% budget; {score.best})",
        flush=True,
    )
    return float(score.objective)


def _val_scores(v: Any, data: Any, cfg: DictConfig) -> np.ndarray:
    """[N val rows] float32 scores of a finished variant, cached beside the variant cache by the variant's
    directory name (name + content hash), so the shared baseline is scored once per sweep."""
    from reco.measure import predict
    from reco.runtime import load_scorer
    from reco.variant import atomic_write

    path = Path(cfg.cache_dir) / "val_scores" / f"{v.path.name}.npy"
    if path.exists():
        return np.load(path, allow_pickle=False)
    scores = predict(load_scorer(v, threads=cfg.trainer.threads), data.val).astype(np.float32)
    buf = io.BytesIO()
    np.save(buf, scores)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, buf.getvalue())
    return scores


def check_space(cfg: DictConfig) -> None:
    """Every key of hydra.sweeper.params must exist in the config; raises ConfigError naming it."""
    params = OmegaConf.select(cfg, "hydra.sweeper.params") or {}
    for key in params:
        if OmegaConf.select(cfg, str(key), default=_ABSENT) is _ABSENT:
            raise ConfigError(
                f"hydra.sweeper.params.{key}: the search space names {key!r}, which is not a key of the "
                "composed config (expected an existing setting such as prune.amount)"
            )


_ABSENT = object()


def summarize(trials: list[dict], out_dir: Path) -> tuple[str, dict | None, list[Path]]:
    """The sweep's summary: a markdown table of every trial's variants and the winner.

    Args:
        trials: the trials' `search_trial.json` records.
        out_dir: where search_summary.md (and the Pareto plot) go.
    Returns:
        (markdown, the winning trial's record or None, the files written).
    """
    trials = sorted(trials, key=lambda t: t["trial"])
    budget = trials[0]["max_auc_drop_pct"] if trials else float("nan")
    ok = [t for t in trials if t["within_budget"]]
    winner = max(ok, key=lambda t: t["objective"]) if ok else None
    cands = [(t, c) for t in trials for c in t["candidates"]]
    front = _pareto([(c["rank_p50_ms"], c["val_delta_rel"]) for _, c in cands])
    lines = [
        "# Accuracy-budget search",
        "",
        f"Budget: relative validation AUC drop ≤ {budget}% against the baseline. Objective: in-process rank "
        "throughput (1000 / rank_p50_ms, ranking calls/s) of a trial's fastest variant within the budget; "
        "a trial with none returns minus its nearest variant's excess over the budget (% points). "
        "The full load test (max QPS at the SLO) of the front is not run by the search yet.",
        "",
    ]
    if winner is not None:
        best = next(c for c in winner["candidates"] if c["name"] == winner["best"])
        lines.append(
            f"**Winner: trial {winner['trial']}** ({' '.join(winner['overrides'])}), variant `{winner['best']}`: "
            f"{winner['objective']:.1f} ranking calls/s (rank p50 {best['rank_p50_ms']:.2f} ms), "
            f"val ΔAUC {_pct(best)}."
        )
    else:
        seen = [c for _, c in cands]
        nearest = max(seen, key=lambda c: c["val_delta_rel"]) if seen else None
        lines.append(
            f"**No trial met the budget** of {budget}%: no winner. "
            + (
                f"Best val ΔAUC seen: {_pct(nearest)} (`{nearest['name']}`)."
                if nearest
                else "No variant was built."
            )
        )
    lines += [
        "",
        "| trial | overrides | variant | params | val ΔAUC [95% CI] | rank p50 ms | calls/s | within budget "
        "| Pareto | trial objective |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t, c in cands:
        within = -c["val_delta_rel"] * 100 <= t["max_auc_drop_pct"]
        on_front = (c["rank_p50_ms"], c["val_delta_rel"]) in front
        lines.append(
            f"| {t['trial']} | {' '.join(t['overrides'])} | {c['name']} | {c['params']:,} | {_pct(c)} "
            f"| {c['rank_p50_ms']:.2f} | {1000 / c['rank_p50_ms']:.1f} | {'yes' if within else 'no'} "
            f"| {'yes' if on_front else ''} | {t['objective']:.4g} |"
        )
    for t in trials:
        if not t["candidates"]:
            lines.append(
                f"| {t['trial']} | {' '.join(t['overrides'])} | (none built) | | | | | no | | "
                f"{t['objective']:.4g} |"
            )
    out_dir.mkdir(parents=True, exist_ok=True)
    md = "\n".join(lines) + "\n"
    files = [out_dir / SUMMARY_FILE]
    files[0].write_text(md)
    plot = _plot(cands, front, budget, out_dir / PARETO_FILE)
    if plot is not None:
        files.append(plot)
    return md, winner, files


def _pct(c: dict) -> str:
    lo, hi = c.get("val_delta_lo"), c.get("val_delta_hi")
    ci = f" [{lo * 100:+.3f}, {hi * 100:+.3f}]" if lo is not None and hi is not None else ""
    return f"{c['val_delta_rel'] * 100:+.3f}%{ci}"


def _pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    from reco.report.plots import pareto_front

    return pareto_front([p for p in points if math.isfinite(p[0]) and math.isfinite(p[1])])


def _plot(cands: list[tuple[dict, dict]], front: list, budget: float, path: Path) -> Path | None:
    """Val ΔAUC vs in-process rank p50 of every trial's variants, the front and the budget line."""
    if not cands:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter([c["rank_p50_ms"] for _, c in cands], [c["val_delta_rel"] * 100 for _, c in cands], s=18)
    for t, c in cands:
        ax.annotate(f"{t['trial']}:{c['name']}", (c["rank_p50_ms"], c["val_delta_rel"] * 100), fontsize=6)
    if front:
        ax.step(
            [x for x, _ in front], [y * 100 for _, y in front], where="post", color="C1", label="Pareto front"
        )
    ax.axhline(-budget, color="C3", ls="--", label=f"budget −{budget}%")
    ax.set_xlabel("in-process rank p50 (ms)")
    ax.set_ylabel("val ΔAUC vs baseline (%)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


class SearchSummary(Callback):
    """Hydra callback of `experiment=search` (hydra.callbacks): checks the search space before the first
    trial and writes the summary when the sweep ends (markdown in the sweep dir + an MLflow run)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            check_space(config)
        except ConfigError as e:
            # Hydra turns a callback's Exception into a warning and sweeps on; SystemExit stops the sweep.
            raise SystemExit(f"ConfigError: {e}") from None

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from reco.tracking import Tracker

        sweep = Path(config.hydra.sweep.dir)
        trials = [json.loads(p.read_text()) for p in sorted(sweep.glob(f"*/{TRIAL_FILE}"))]
        md, winner, files = summarize(trials, sweep)
        tracker = Tracker(config.tracking.uri, config.experiment_name, config.tracking.artifact_root)
        run = tracker.start_run(
            f"{config.experiment_name} summary",
            tags={
                "search.summary": "true",
                "multirun.sweep_dir": str(sweep),
                "search.winner_trial": str(winner["trial"]) if winner else "none",
                "search.winner_variant": winner["best"] if winner else "none",
            },
        )
        tracker.log(run, metrics={"search_best_objective": winner["objective"]} if winner else {})
        tracker.log_artifacts(run, files, "search")
        tracker.end(run)
        print(f"\n{md}\nSearch summary: {sweep / SUMMARY_FILE}", flush=True)
