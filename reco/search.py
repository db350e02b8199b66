"""Accuracy-budget search (`python run.py -m experiment=search`): Hydra's Optuna sweeper proposes step
settings, each trial is one pipeline execution, and this module turns a trial's variants into the value
Optuna maximises and, at the end of the sweep, into a summary naming the winner.

What a trial optimises (`search.objective`): `throughput` (default), the in-process rank throughput,
1000 / rank_p50_ms (ranking calls of serve.n_candidates candidates per second, one scorer, no server);
or `size`, the model file's compression against the baseline's (baseline size_mb / size_mb: what a
memory-bound deployment buys from embedding and dense quantization). Either way, of the trial's best
variant whose relative validation AUC drop against the baseline is within `search.max_auc_drop_pct`.

Two fidelities. (1) Every trial, the screen: the objective above, measured in process. (2) Once, when the
sweep ends (`search.load_test_front`): the variants within the budget on the Pareto front (the objective's
cost, rank p50 or size_mb, vs val ΔAUC, over all trials) are served beside the baseline and load-tested.
With `throughput` the winner is the one with the highest median max QPS at the SLO; with `size` it is the
smallest within the budget, and the load test shows what serving it costs.

A variant of the `batching` step is its parent's model served with dynamic batching: the screen cannot
tell it from its parent (same scores, same call, same file), so it takes no part in the objective or the
front; it is load-tested, at its trial's sampled window, whenever its parent is on the front.

Within the budget (`search.budget_test`): `point`, the ΔAUC's point estimate is within it; or `ci`, its
whole 95% CI is (the CI's worst end is what is held against the budget). Either way the summary labels
every variant with the CI's verdict: PASS (whole CI within), INCONCLUSIVE (the CI straddles the budget),
FAIL (whole CI beyond).

Penalty convention: a trial with no variant within the budget returns minus how far its best variant is
over the budget, in percentage points (always < 0 < any feasible objective, and larger the nearer it came,
so the sampler is steered toward the budget); a trial with no variant built returns NO_VARIANT. Its MLflow
parent run carries the tag `search.within_budget=false`.

ΔAUC is paired (DeLong) on the validation split: the test split stays the report's.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from hydra.experimental.callback import Callback
from omegaconf import MISSING, DictConfig, OmegaConf

from reco.config import ConfigError, typed

TRIAL_FILE = "search_trial.json"  # one per trial, in the trial's Hydra output directory
SUMMARY_FILE = "search_summary.md"  # in the sweep directory
PARETO_FILE = "search_pareto.png"
FRONT_PLOT = "search_front_load.png"  # val ΔAUC vs max QPS @ SLO and vs e2e p99 of the load-tested front
FRONT_FILE = "front_load.json"  # the front's load-test figures (FrontLoad), in the sweep directory
NO_VARIANT = -1e6  # objective of a trial where no candidate variant was built at all
# search.objective -> (what a trial returns, the candidate field the Pareto front minimises)
OBJECTIVES = {
    "throughput": ("in-process rank throughput (1000 / rank_p50_ms, ranking calls/s)", "rank_p50_ms"),
    "size": ("model-file compression against the baseline (baseline size_mb / size_mb)", "size_mb"),
}
BUDGET_TESTS = ("point", "ci")


def charged_drop_pct(c: dict, test: str) -> float:
    """The relative val AUC drop (%) of candidate record `c` held against the budget: its point estimate,
    or with test `ci` its 95% CI's worst end (the point estimate when the CI is unknown)."""
    lo = c.get("val_delta_lo")
    return -(lo if test == "ci" and lo is not None else c["val_delta_rel"]) * 100


def within_budget(c: dict, budget_pct: float, test: str) -> bool:
    """Candidate record `c` is within the budget by `test` (the one rule the objective, the MLflow tags, the
    front and the summary share)."""
    return charged_drop_pct(c, test) <= budget_pct


def budget_verdict(c: dict, budget_pct: float) -> str:
    """The CI's verdict on the budget: PASS (whole CI within), FAIL (whole CI beyond), else INCONCLUSIVE."""
    lo, hi = c.get("val_delta_lo"), c.get("val_delta_hi")
    if lo is None or hi is None:
        return "PASS" if within_budget(c, budget_pct, "point") else "FAIL"
    if -lo * 100 <= budget_pct:
        return "PASS"
    return "FAIL" if -hi * 100 > budget_pct else "INCONCLUSIVE"


@dataclass
class SearchConfig:
    """`search` (conf/search/default.yaml): the accuracy budget of `experiment=search`."""

    max_auc_drop_pct: float = MISSING  # relative validation AUC drop allowed against the baseline, in %
    objective: str = MISSING  # one of OBJECTIVES: what a trial maximises within the budget
    budget_test: str = MISSING  # one of BUDGET_TESTS: point estimate or whole CI within the budget
    load_test_front: bool = MISSING  # at the sweep's end, load-test the budget-meeting Pareto-front variants

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ConfigError(
                f"search.objective: expected one of {sorted(OBJECTIVES)}, got {self.objective!r}"
            )
        if self.budget_test not in BUDGET_TESTS:
            raise ConfigError(f"search.budget_test: expected one of {BUDGET_TESTS}, got {self.budget_test!r}")


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


@dataclass
class FrontLoad:
    """What the front's load test measured, per load_key() and for the reference under its own name
    (None: not measured, e.g. its server failed)."""

    note: str  # how the front was load-tested (SLO, repeats, raw files), or why not
    reference: str = ""
    max_qps: dict[str, float | None] = field(default_factory=dict)  # median max QPS at the SLO, repeats
    p99_ms: dict[str, float | None] = field(default_factory=dict)  # median e2e p99 at the common load


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
    """The value a trial returns to Optuna (see the module docstring for the penalty convention).

    Args:
        cands: the trial's built non-baseline variants.
        max_auc_drop_pct: the budget, relative validation AUC drop in %.
        kind: search.objective, a key of OBJECTIVES.
        base_size_mb: the baseline's model file (what `size` compares against).
        test: search.budget_test, a member of BUDGET_TESTS.
    Returns:
        The objective, whether any variant met the budget, and which variant decided it.
    """
    recs = {c.name: asdict(c) for c in cands if not c.batched_from}
    cands = [c for c in cands if c.name in recs]
    ok = [c for c in cands if within_budget(recs[c.name], max_auc_drop_pct, test)]
    if ok:
        best = max(ok, key=lambda c: c.score(kind, base_size_mb))
        return TrialScore(best.score(kind, base_size_mb), True, best.name)
    if not cands:
        return TrialScore(NO_VARIANT, False, None)
    drop = {name: charged_drop_pct(r, test) for name, r in recs.items()}
    nearest = min(cands, key=lambda c: drop[c.name])
    return TrialScore(-(drop[nearest.name] - max_auc_drop_pct), False, nearest.name)


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
            m, path = b.variant.metrics, str(b.variant.path)
            batched = b.node.parent if b.node.step == "batching" else ""
            c = Candidate(
                b.name, m["rank_p50_ms"], rel.value, rel.lo, rel.hi, b.variant.params, b.variant.size_mb,
                path, batched,
            )  # fmt: skip
            cands.append(c)
            within = within_budget(asdict(c), sc.max_auc_drop_pct, sc.budget_test)
            tracker.log(
                b.run_id,
                metrics={"val_auc_delta_rel": c.val_delta_rel, "rank_calls_per_s": c.throughput},
                tags={"search.within_budget": str(within).lower()},
            )
    base_mb = base.variant.size_mb if base.variant is not None else 0.0
    score = objective(cands, sc.max_auc_drop_pct, sc.objective, base_mb, sc.budget_test)
    hc = HydraConfig.get()
    space = set(hc.sweeper.get("params") or {})
    record = {
        "trial": OmegaConf.select(hc, "job.num", default=0),  # a single run (no -m) has none
        # the sampled settings only (the sweep's fixed overrides are the same in every trial)
        "overrides": [o for o in hc.overrides.task if o.split("=", 1)[0] in space],
        "max_auc_drop_pct": sc.max_auc_drop_pct,
        "objective_kind": sc.objective,
        "budget_test": sc.budget_test,
        "baseline_size_mb": base_mb,
        "objective": score.objective,
        "within_budget": score.within_budget,
        "best": score.best,
        "parent_run": parent_run,
        "baseline_path": str(base.variant.path) if base.variant is not None else "",
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


def front(trials: list[dict]) -> list[tuple[dict, dict]]:
    """(trial, candidate) pairs worth a full load test: those within the budget and on the Pareto front of
    the objective's cost (rank p50 or size_mb) vs val ΔAUC over every trial's screened variants, then the
    batched copies of those (same trial)."""
    cands, cost = _screened(trials), _cost(trials)
    pts = _pareto([(c[cost], c["val_delta_rel"]) for _, c in cands])
    chosen = [(t, c) for t, c in cands if (c[cost], c["val_delta_rel"]) in pts and _within(t, c)]
    keys = {load_key(t, c) for t, c in chosen}
    return chosen + [
        (t, c)
        for t in trials
        for c in t["candidates"]
        if c.get("batched_from") and load_key(t, {"name": c["batched_from"]}) in keys
    ]


def _within(t: dict, c: dict) -> bool:
    """Candidate `c` of trial record `t` is within the trial's budget, by the trial's budget test."""
    return within_budget(c, t["max_auc_drop_pct"], t.get("budget_test", "point"))


def _kind(trials: list[dict]) -> str:
    """The sweep's search.objective (records written before it existed optimised throughput)."""
    return trials[0].get("objective_kind", "throughput") if trials else "throughput"


def _cost(trials: list[dict]) -> str:
    """The candidate field the sweep's Pareto front minimises."""
    return OBJECTIVES[_kind(trials)][1]


def _screened(trials: list[dict]) -> list[tuple[dict, dict]]:
    """Every trial's variants that the in-process screen can tell apart (batched copies are not)."""
    return [(t, c) for t in trials for c in t["candidates"] if not c.get("batched_from")]


def load_key(t: dict, c: dict) -> str:
    """The name a front variant is served and load-tested under (unique across trials)."""
    return f"t{t['trial']}_{c['name']}"


def summarize(
    trials: list[dict], out_dir: Path, load: FrontLoad | None = None
) -> tuple[str, dict | None, list[Path]]:
    """The sweep's summary: a markdown table of every trial's variants and the winner.

    Args:
        trials: the trials' `search_trial.json` records.
        out_dir: where search_summary.md (and the plots) go.
        load: the front's load test, if it ran. With the throughput objective and any front variant's max
            QPS at the SLO measured, the winner is the one with the highest; otherwise (or with the size
            objective) it is the trial with the best objective.
    Returns:
        (markdown, the winner {trial, variant, overrides, objective, max_qps, cand, baseline_size_mb} or
        None, the files written).
    """
    trials = sorted(trials, key=lambda t: t["trial"])
    load = load or FrontLoad("not run")
    qps, p99 = load.max_qps, load.p99_ms
    budget = trials[0]["max_auc_drop_pct"] if trials else float("nan")
    test = trials[0].get("budget_test", "point") if trials else "point"
    ok = [t for t in trials if t["within_budget"]]
    kind, cost = _kind(trials), _cost(trials)
    tested = front(trials)
    measured = [(t, c) for t, c in tested if qps.get(load_key(t, c)) is not None]
    pick = None
    if kind == "throughput" and measured:
        pick = max(measured, key=lambda tc: qps[load_key(*tc)])
    elif ok:
        t = max(ok, key=lambda t: t["objective"])
        pick = t, next(c for c in t["candidates"] if c["name"] == t["best"])
    winner = None
    if pick is not None:
        t, c = pick
        winner = {"trial": t["trial"], "variant": c["name"], "overrides": t["overrides"],
                  "objective": t["objective"], "max_qps": qps.get(load_key(t, c)), "cand": c,
                  "baseline_size_mb": t.get("baseline_size_mb")}  # fmt: skip
    cands = [(t, c) for t in trials for c in t["candidates"]]
    pts = _pareto([(c[cost], c["val_delta_rel"]) for _, c in _screened(trials)])
    tested_keys = {load_key(t, c) for t, c in tested}
    lines = [
        "# Accuracy-budget search",
        "",
        f"Budget: relative validation AUC drop ≤ {budget}% against the baseline, held against "
        + (
            "the 95% CI's worst end (`search.budget_test=ci`)"
            if test == "ci"
            else "the point estimate (`search.budget_test=point`; the CI verdict is shown beside it)"
        )
        + ". Objective "
        f"(`search.objective={kind}`, what each trial returned to Optuna): {OBJECTIVES[kind][0]} of the "
        "trial's best variant within the budget; a trial with none returns minus its nearest variant's excess "
        "over the budget (% points). The Pareto front: "
        f"{cost} vs val ΔAUC. The winner is "
        + (
            "the budget-meeting Pareto-front variant with the highest max QPS at the SLO when the front was "
            "load-tested, else the trial with the best objective."
            if kind == "throughput"
            else "the trial with the best objective (the smallest model file within the budget); the front's "
            "load test shows what serving it costs."
        )
        + " A batched variant (its parent's model behind the dynamic batcher, at the trial's window) is not "
        "screened: it is load-tested when its parent is on the front.",
        "",
        f"Full load test of the front: {load.note}.",
        "",
    ]
    if winner is not None:
        c = winner["cand"]
        by = f"max QPS at the SLO {winner['max_qps']:g} req/s, " if winner["max_qps"] is not None else ""
        base_mb = winner["baseline_size_mb"]
        small = (
            f"model file {c['size_mb']:.2f} MB ({base_mb / c['size_mb']:.2f}x smaller than the baseline's), "
            if c.get("size_mb") and base_mb
            else ""
        )
        lines.append(
            f"**Winner: trial {winner['trial']}** ({_shown(winner['overrides'])}), variant `{c['name']}`: "
            f"{by}{small}{1000 / c['rank_p50_ms']:.1f} ranking calls/s in process "
            f"(rank p50 {c['rank_p50_ms']:.2f} ms), val ΔAUC {_pct(c)}: within the {budget}% budget by "
            f"{'its whole CI' if test == 'ci' else 'its point estimate'}, "
            f"CI verdict {budget_verdict(c, budget)}."
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
        "| trial | overrides | variant | params | size MB | val ΔAUC [95% CI] | rank p50 ms | calls/s "
        "| within budget (CI verdict) | Pareto | max QPS @ SLO | e2e p99 ms @ common load | trial objective |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t, c in cands:
        key = load_key(t, c)
        within = f"{'yes' if _within(t, c) else 'no'} ({budget_verdict(c, t['max_auc_drop_pct'])})"
        on_front = "yes" if (c[cost], c["val_delta_rel"]) in pts else ""
        if c.get("batched_from"):
            on_front = f"with {c['batched_from']}" if key in tested_keys else "not screened"
        lines.append(
            f"| {t['trial']} | {_shown(t['overrides'])} | {c['name']} | {c['params']:,} "
            f"| {_cell(c, 'size_mb', '.2f')} | {_pct(c)} "
            f"| {c['rank_p50_ms']:.2f} | {1000 / c['rank_p50_ms']:.1f} | {within} "
            f"| {on_front} | {_cell(qps, key, 'g')} | {_cell(p99, key, '.1f')} | {t['objective']:.4g} |"
        )
    if load.reference in qps:
        ref = load.reference
        lines.append(
            f"| | | {ref} (reference) | | | 0 | | | | | {_cell(qps, ref, 'g')} | {_cell(p99, ref, '.1f')} | |"
        )
    for t in trials:
        if not t["candidates"]:
            lines.append(
                f"| {t['trial']} | {_shown(t['overrides'])} | (none built) | | | | | | no | | | | "
                f"{t['objective']:.4g} |"
            )
    out_dir.mkdir(parents=True, exist_ok=True)
    md = "\n".join(lines) + "\n"
    files = [out_dir / SUMMARY_FILE]
    files[0].write_text(md)
    for plot in (
        _plot(_screened(trials), pts, cost, budget, out_dir / PARETO_FILE),
        _plot_load(tested, load, budget, out_dir / FRONT_PLOT),
    ):
        if plot is not None:
            files.append(plot)
    return md, winner, files


def _cell(figures: dict[str, float | None], key: str, fmt: str) -> str:
    """A load-test figure for the table: blank when not tested, n/a when tested but not measured."""
    if key not in figures:
        return ""
    v = figures[key]
    return "n/a" if v is None else format(v, fmt)


def _shown(overrides: list[str]) -> str:
    """A trial's sampled settings for a table, floats to 4 significant digits (Optuna samples 17)."""

    def short(o: str) -> str:
        key, _, value = o.partition("=")
        try:
            return f"{key}={float(value):.4g}" if "." in value else o
        except ValueError:
            return o

    return " ".join(short(o) for o in overrides)


def _pct(c: dict) -> str:
    lo, hi = c.get("val_delta_lo"), c.get("val_delta_hi")
    ci = f" [{lo * 100:+.3f}, {hi * 100:+.3f}]" if lo is not None and hi is not None else ""
    return f"{c['val_delta_rel'] * 100:+.3f}%{ci}"


def _pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    from reco.report.plots import pareto_front

    return pareto_front([p for p in points if math.isfinite(p[0]) and math.isfinite(p[1])])


def _plot(cands: list[tuple[dict, dict]], front: list, cost: str, budget: float, path: Path) -> Path | None:
    """Val ΔAUC vs the front's cost (in-process rank p50 or model size) of every trial's variants, the
    front and the budget line."""
    if not cands:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter([c[cost] for _, c in cands], [c["val_delta_rel"] * 100 for _, c in cands], s=18)
    for t, c in cands:
        ax.annotate(f"{t['trial']}:{c['name']}", (c[cost], c["val_delta_rel"] * 100), fontsize=6)
    if front:
        ax.step(
            [x for x, _ in front], [y * 100 for _, y in front], where="post", color="C1", label="Pareto front"
        )
    ax.axhline(-budget, color="C3", ls="--", label=f"budget −{budget}%")
    ax.set_xlabel({"rank_p50_ms": "in-process rank p50 (ms)", "size_mb": "model file (MB)"}[cost])
    ax.set_ylabel("val ΔAUC vs baseline (%)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _plot_load(tested: list[tuple[dict, dict]], load: FrontLoad, budget: float, path: Path) -> Path | None:
    """Val ΔAUC of the load-tested front (and the reference at 0) against its max QPS at the SLO and its
    e2e p99 at the common load: the front as a user of the served variants sees it."""
    pts = [(load_key(t, c), c["val_delta_rel"] * 100) for t, c in tested]
    pts += [(load.reference, 0.0)] if load.reference in load.max_qps else []
    if not any(load.max_qps.get(k) is not None or load.p99_ms.get(k) is not None for k, _ in pts):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, figures, label in (
        (axes[0], load.max_qps, "max QPS at the SLO (req/s)"),
        (axes[1], load.p99_ms, "e2e p99 at the common load (ms)"),
    ):
        shown = [(k, figures[k], y) for k, y in pts if figures.get(k) is not None]
        off = [k for k, x, _ in shown if not math.isfinite(x)]  # e.g. p99 = inf: > 1% of requests failed
        shown = [p for p in shown if p[0] not in off]
        ax.scatter([x for _, x, _ in shown], [y for _, _, y in shown], s=18)
        for k, x, y in shown:
            ax.annotate(k, (x, y), fontsize=6)
        ax.axhline(-budget, color="C3", ls="--", label=f"budget −{budget}%")
        ax.set_xlabel(label + (f"\nnot finite, not drawn: {', '.join(off)}" if off else ""))
    axes[0].set_ylabel("val ΔAUC vs baseline (%)")
    axes[0].legend(fontsize=7)
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

        sweep = Path(config.hydra.sweep.dir).resolve()  # the trials' runs are tagged with it
        trials = [json.loads(p.read_text()) for p in sorted(sweep.glob(f"*/{TRIAL_FILE}"))]
        load = FrontLoad("off (search.load_test_front=false)")
        if typed(config.search, SearchConfig, "search").load_test_front:
            try:
                load = load_test_front(config, trials, sweep / "front_load")
            except Exception as e:  # the in-process results and the summary must survive a failed load test
                load = FrontLoad(f"failed: {type(e).__name__}: {e}")
                print(f"[search] front load test {load.note}", flush=True)
        (sweep / FRONT_FILE).write_text(json.dumps(asdict(load), indent=1))
        md, winner, files = summarize(trials, sweep, load)
        tracker = Tracker(config.tracking.uri, config.experiment_name, config.tracking.artifact_root)
        run = tracker.start_run(
            f"{config.experiment_name} summary",
            tags={
                "search.summary": "true",
                "multirun.sweep_dir": str(sweep),
                "search.winner_trial": str(winner["trial"]) if winner else "none",
                "search.winner_variant": winner["variant"] if winner else "none",
            },
        )
        metrics = {f"front_max_qps_{k}": v for k, v in load.max_qps.items() if v is not None}
        metrics |= {f"front_e2e_p99_ms_{k}": v for k, v in load.p99_ms.items() if v is not None}
        if winner:
            metrics["search_best_objective"] = winner["objective"]
            if winner["max_qps"] is not None:
                metrics["search_winner_max_qps"] = winner["max_qps"]
        tracker.log(run, metrics=metrics)
        tracker.log_artifacts(run, files, "search")
        tracker.end(run)
        print(f"\n{md}\nSearch summary: {sweep / SUMMARY_FILE}", flush=True)


def load_test_front(config: DictConfig, trials: list[dict], out_dir: Path) -> FrontLoad:
    """The second fidelity: serve the budget-meeting Pareto-front variants and the baseline side by side and
    load-test them (reco.loadtest.study with the config's `loadtest` and `serve` settings).

    Returns:
        Per load_key() and for the baseline: median max QPS at the SLO and median e2e p99 at the common
        load over the repeats (None when not measured), and a note: what was tested at which SLO, or why
        nothing was.
    """
    from reco.data import load_dataset
    from reco.loadtest.study import run_study
    from reco.variant import Variant

    chosen = front(trials)
    if not chosen:
        return FrontLoad("nothing to test (no budget-meeting variant on the front)")
    base = next(t["baseline_path"] for t in trials if t.get("baseline_path"))
    data, data_path = load_dataset(
        OmegaConf.to_container(config.data, resolve=True), Path(config.cache_dir) / "data"
    )
    lt = OmegaConf.to_container(config.loadtest, resolve=True)
    lt["study"]["variants"] = None  # every variant handed over
    ref = lt["study"]["reference"]
    variants = [(ref, Variant.load(base))] + [(load_key(t, c), Variant.load(c["path"])) for t, c in chosen]
    print(f"\n[search] load-testing the front: {', '.join(n for n, _ in variants[1:])} (+ {ref})", flush=True)
    cfg = {"loadtest": lt, "serve": OmegaConf.to_container(config.serve, resolve=True)}
    study = run_study(variants, data, data_path, cfg, out_dir)
    slo = f"{study.slo_p99_ms:.1f} ms" if study.slo_p99_ms is not None else "none"
    load = FrontLoad(
        f"{len(chosen)} variant(s) and the baseline served side by side, capacity at p99 ≤ {slo} "
        f"({study.slo_source}), common load {study.common_rate_qps or 'n/a'} req/s, "
        f"{lt['study']['repeats']} repeat(s); raw files {out_dir}",
        ref,
    )
    for name, o in study.outcomes.items():
        caps = [c.highest_pass for c in o.capacity]
        p99s = [p for r in o.common if r.valid and (p := r.quantiles["p99"].value) is not None]
        # figures a variant finished stand even when a later run of it failed (o.error): a reference with
        # no capacity at the SLO leaves every variant without a common load, not without its capacity
        load.max_qps[name] = float(np.median(caps)) if caps else None
        load.p99_ms[name] = float(np.median(p99s)) if p99s else None
    return load
