"""The Hydra callback of `experiment=search` (hydra.callbacks in conf/experiment/search.yaml): checks the
search space before the first trial; when the sweep ends, load-tests the front (the second fidelity) and
writes the summary (markdown and plots in the sweep dir, an MLflow run)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from reco.config import ConfigError, typed
from reco.loadtest.config import LoadtestConfig
from reco.loadtest.outcome import decided_searches
from reco.search.config import SearchConfig, check_space
from reco.search.front import FrontLoad, front, load_key
from reco.search.trial import TRIAL_FILE, Trial
from reco.serve.config import ServeConfig

FRONT_FILE = "front_load.json"  # the front's load-test figures (FrontLoad), in the sweep directory


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
        from reco.search.summary import SUMMARY_FILE, summarize
        from reco.tracking import Tracker

        sweep = Path(config.hydra.sweep.dir).resolve()  # the trials' runs are tagged with it
        trials = [Trial.load(p) for p in sorted(sweep.glob(f"*/{TRIAL_FILE}"))]
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
                "search.winner_trial": str(winner.trial.trial) if winner else "none",
                "search.winner_variant": winner.cand.name if winner else "none",
            },
        )
        metrics = {f"front_max_qps_{k}": v for k, v in load.max_qps.items() if v is not None}
        metrics |= {f"front_e2e_p99_ms_{k}": v for k, v in load.p99_ms.items() if v is not None}
        if winner:
            metrics["search_best_objective"] = winner.trial.objective
            if winner.max_qps is not None:
                metrics["search_winner_max_qps"] = winner.max_qps
        tracker.log(run, metrics=metrics)
        tracker.log_artifacts(run, files, "search")
        tracker.end(run)
        print(f"\n{md}\nSearch summary: {sweep / SUMMARY_FILE}", flush=True)


def load_test_front(config: DictConfig, trials: list[Trial], out_dir: Path) -> FrontLoad:
    """The second fidelity: serve the budget-meeting Pareto-front variants and the baseline side by side and
    load-test them (reco.loadtest.study with the config's `loadtest` and `serve` settings).

    Returns:
        Per load_key() and for the baseline: median max QPS at the SLO and median e2e p99 at the common
        load over the repeats (None when not measured), and a note: what was tested at which SLO, or why
        nothing was.
    """
    from reco.data import load_dataset
    from reco.data.config import data_config
    from reco.loadtest.study import run_study
    from reco.variant import Variant

    chosen = front(trials)
    if not chosen:
        return FrontLoad("nothing to test (no budget-meeting variant on the front)")
    base = next(t.baseline_path for t in trials if t.baseline_path)
    data, data_path = load_dataset(data_config(config.data), Path(config.cache_dir) / "data")
    lt = typed(config.loadtest, LoadtestConfig, "loadtest")
    lt = dataclasses.replace(
        lt, study=dataclasses.replace(lt.study, variants=None)
    )  # every variant handed over
    ref = lt.study.reference
    variants = [(ref, Variant.load(base))]
    # the models; their copies served otherwise (batched_from) are the study's serving rows
    variants += [(load_key(t, c.name), Variant.load(c.path)) for t, c in chosen if not c.batched_from]
    print(f"\n[search] load-testing the front: {', '.join(n for n, _ in variants[1:])} (+ {ref})", flush=True)
    serve = typed(config.serve, ServeConfig, "serve")
    study = run_study(variants, data, data_path, lt, serve, out_dir)
    slo = f"{study.slo_p99_ms:.1f} ms" if study.slo_p99_ms is not None else "none"
    load = FrontLoad(
        f"{len(chosen)} variant(s) and the baseline served side by side, capacity at p99 ≤ {slo} "
        f"({study.slo_source}), common load {study.common_rate_qps or 'n/a'} req/s, "
        f"{lt.study.repeats} repeat(s); raw files {out_dir}",
        ref,
    )
    for name, o in study.outcomes.items():
        caps = [c.highest_pass for c in decided_searches(o.capacity)]
        p99s = [p for r in o.common if r.valid and (p := r.quantiles["p99"].value) is not None]
        # figures a variant finished stand even when a later run of it failed (o.error): a reference with
        # no capacity at the SLO leaves every variant without a common load, not without its capacity
        load.max_qps[name] = float(np.median(caps)) if caps else None
        load.p99_ms[name] = float(np.median(p99s)) if p99s else None
    return load
