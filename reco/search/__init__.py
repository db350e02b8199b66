"""Accuracy-budget search (`python run.py -m experiment=search`): Hydra's Optuna sweeper proposes step
settings, each trial is one pipeline execution, and this package turns a trial's variants into the value
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

A variant served another way (loadtest.study.servings, e.g. `batched`: the same model behind the dynamic
batcher) is a copy the screen cannot tell from its model (same scores, same call, same file), so it takes
no part in the objective or the front; it is load-tested, as the study's serving row, whenever its model
is on the front.

Within the budget (`search.budget_test`): `point`, the ΔAUC's point estimate is within it; or `ci`, its
whole 95% CI is (the CI's worst end is what is held against the budget). Either way the summary labels
every variant with the CI's verdict: PASS (whole CI within), INCONCLUSIVE (the CI straddles the budget),
FAIL (whole CI beyond).

Penalty convention: a trial with no variant within the budget returns minus how far its best variant is
over the budget, in percentage points (always < 0 < any feasible objective, and larger the nearer it came,
so the sampler is steered toward the budget); a trial with no variant built returns NO_VARIANT. Its MLflow
parent run carries the tag `search.within_budget=false`.

ΔAUC is paired (DeLong) on the validation split: the test split stays the report's.

    config    SearchConfig (`search`), the objectives and budget tests, the search space's check
    trial     Candidate (with the budget tests), the objective, the trial record Trial, finish_trial
    front     the Pareto front, the variants the front's load test serves, FrontLoad
    summary   the winner, search_summary.md and the plots (reco.report.fmt / reco.report.plots)
    callback  SearchSummary (the Hydra callback) and load_test_front

summary is not imported here: it pulls in reco.report and matplotlib, which a process composing the config
(every server) does not need.
"""

from reco.search.callback import SearchSummary, load_test_front
from reco.search.config import BUDGET_TESTS, OBJECTIVES, SearchConfig, check_space
from reco.search.front import FrontLoad, front, load_key
from reco.search.trial import NO_VARIANT, TRIAL_FILE, Candidate, Trial, TrialScore, finish_trial, objective

__all__ = [
    "BUDGET_TESTS",
    "NO_VARIANT",
    "OBJECTIVES",
    "TRIAL_FILE",
    "Candidate",
    "FrontLoad",
    "SearchConfig",
    "SearchSummary",
    "Trial",
    "TrialScore",
    "check_space",
    "finish_trial",
    "front",
    "load_key",
    "load_test_front",
    "objective",
]
