"""Typed schema of the `loadtest` config group (values: conf/loadtest/default.yaml, the one place they live).

Registered in Hydra's ConfigStore as `loadtest/schema` (reco.cli.compose._schemas); the group's YAML lists it
first in its defaults, so a typo or a wrong type fails at compose time naming `loadtest.<key>`.
Functions of reco.loadtest take a `LoadtestConfig`; an entry point holding the raw group (a benchmark,
a Hydra callback) types it once with `loadtest_config()`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from omegaconf import MISSING

from reco.config import ConfigError, typed
from reco.serve.config import FeatureSource, ServeBackend
from reco.stats import CONF, min_n_for_quantile
from reco.stats.paired import block_min_n


class LoadMode(StrEnum):
    """How requests arrive (member names equal their values so YAML can say `mode: open`)."""

    closed = "closed"  # `users` users, each sends, waits for the answer (+ think time), repeats
    open = "open"  # Poisson arrivals at `rate` req/s whatever is outstanding (MLPerf Server scenario)


class UnloadedInterleave(StrEnum):
    """How an unloaded block interleaves its variants (reco.loadtest.study, reco.loadtest.interleave)."""

    window = "window"  # one Locust window per variant, the variants one after another in a random order
    # one Locust window for the whole block: one user sends to every variant's server in cycles (each
    # cycle every variant once, in a fresh random order), so a host slow stretch of a few seconds lands
    # on every variant of the block alike and cancels in their paired ratio
    request = "request"


@dataclass
class RequestsConfig:
    """The replayed request file (reco.loadtest.requests): rows of the test split."""

    n: int = MISSING  # request bodies written
    k: int = MISSING  # top-k asked by every request


@dataclass
class LoadgenConfig:
    """The load generator process and when its figures are void (valid=0)."""

    keep_warm: bool = MISSING  # SCHED_IDLE spinner on the generator's cores (reco/serve/keepwarm.py)
    max_cpu_pct: float = MISSING  # generator CPU over the window above this (% of one core) -> invalid
    max_lag_ms: float = MISSING  # open loop: p99 lag of actual behind scheduled sends above this -> invalid
    startup_timeout_s: float = MISSING  # Locust must have started the test by then


@dataclass
class CapacityConfig:
    """The capacity search (reco.loadtest.capacity): highest open-loop rate whose p99 CI is within the SLO."""

    enabled: bool = MISSING
    slo_p99_ms: float | None = MISSING  # the SLO, fixed before measuring; null: slo_factor x reference
    slo_factor: float = MISSING  # relative SLO: this x the median unloaded p99 of the reference variant
    reference_repeats: int = MISSING  # unloaded runs of the reference behind that median (>= 5)
    max_error_rate: float = MISSING  # a step with a larger share of failed requests FAILs
    # req/s of the first step; null: 0.6 x 1000 / the variant's in-process rank p50 (one core serves
    # requests one at a time), and every later repeat starts at the previous repeat's highest pass
    start_rate: float | None = MISSING
    growth: float = MISSING  # bracketing factor (> 1): up after a pass, down after a fail
    # down by this instead after an undecided step while no rate has passed (null: growth; 1 < it <= growth):
    # an undecided step sits near the capacity, where a full step down lands far below it and, at a low
    # rate, takes long (reco.loadtest.capacity)
    undecided_step_down: float | None = MISSING
    min_rate: float = MISSING
    max_rate: float = MISSING
    steps: int = MISSING  # at most this many rates per search
    tolerance: float = MISSING  # stop once (lowest fail - highest pass) / lowest fail <= this
    step_requests: int = MISSING  # requests in a step's first window (>= 368 for a p99 CI)
    max_step_requests: int = MISSING  # extensions double a step's pooled n up to this; then INCONCLUSIVE
    # and no further than rate x this many seconds of requests (null: no time cap): a fast variant's step
    # gets the many requests a dependent p99 needs while a slow variant's stays minutes long
    max_step_s: float | None = MISSING
    step_warmup_s: float = MISSING  # unrecorded traffic before each window of a step
    screen_s: float = MISSING  # a step first runs rate x this many seconds of requests when fewer than
    # step_requests: a clear FAIL (p99's CI lower bound above the SLO) ends it there; 0: no screening

    @property
    def looks(self) -> int:
        """How many times a step may judge its pooled requests: the first window, then each doubling up to
        max_step_requests (reco.loadtest.capacity)."""
        return 1 + max(0, math.ceil(math.log2(self.max_step_requests / self.step_requests)))

    @property
    def step_conf(self) -> float:
        """Confidence of each look's p99 interval: Bonferroni over the looks."""
        return 1 - (1 - CONF) / self.looks

    def check(self, where: str) -> None:
        """Ranges, at compose time: a bad `loadtest.capacity.*` stops before any server starts."""
        lo, hi, growth = self.min_rate, self.max_rate, self.growth
        if not (0 < lo <= hi) or growth <= 1:
            raise ConfigError(
                f"{where}: expected 0 < min_rate <= max_rate and growth > 1, "
                f"got min_rate={lo}, max_rate={hi}, growth={growth}"
            )
        if (down := self.undecided_step_down) is not None and not 1 < down <= growth:
            raise ConfigError(
                f"{where}.undecided_step_down: expected 1 < factor <= growth ({growth:g}) or null, got {down}"
            )
        ok = self.max_step_requests >= self.step_requests > 0
        need = min_n_for_quantile(0.99, self.step_conf) if ok else min_n_for_quantile(0.99)
        if (
            not (need <= self.step_requests <= self.max_step_requests)
            or self.screen_s < 0
            or (self.max_step_s is not None and self.max_step_s <= 0)
        ):
            raise ConfigError(
                f"{where}: expected {need} <= step_requests <= max_step_requests (a p99 upper bound at each "
                f"look's confidence needs n >= {need}: reco/loadtest/capacity.py), screen_s >= 0 and max_step_s "
                f"null or > 0, got step_requests={self.step_requests}, max_step_requests="
                f"{self.max_step_requests}, screen_s={self.screen_s}, max_step_s={self.max_step_s}"
            )


@dataclass
class CorrectnessConfig:
    """Scores returned under load vs the variant's offline scores (MLPerf TEST01's idea)."""

    enabled: bool = MISSING
    every: int = MISSING  # the generator records the scores of every Nth request of a common-load window
    tolerance: float = MISSING  # max |served - offline| score (fp32)


@dataclass
class ServingConfig:
    """One way of serving a model (loadtest.study.servings.<name>); crossed with the study's variants.

    A serving is not a variant: the same model files, served differently. The fields default to reco's
    own server as conf/serve configures it, so an entry states only what differs.
    """

    backend: ServeBackend = ServeBackend.reco  # reco's server, or Triton Inference Server (PyTriton)
    batching: bool = False  # the server's dynamic batcher on (serve.batching's window and size)
    instances: int | None = None  # backend=triton: model instances (null: serve.triton.instances)
    features: FeatureSource | None = (
        None  # memory | redis (null: serve.features): what the online store costs
    )
    user_once: bool | None = None  # (null: serve.user_once) false: per candidate, what user_once buys
    variants: list[str] | None = None  # the variants served this way; null: every variant of the study

    def check(self, where: str) -> None:
        if self.instances is not None and self.instances < 1:
            raise ConfigError(f"{where}.instances: expected >= 1 or null, got {self.instances}")
        if self.instances is not None and self.backend != ServeBackend.triton:
            raise ConfigError(f"{where}.instances: only backend=triton has model instances")


@dataclass
class StudyConfig:
    """How the pipeline compares variants (reco.loadtest.study)."""

    reference: str = (
        MISSING  # variant whose unloaded p99 sets a relative SLO and whose capacity the common load
    )
    variants: list[str] | None = MISSING  # names to serve and load-test; null: all
    repeats: int = MISSING  # each kind of run per variant, interleaved across variants (A B C A B C ...)
    common_load_fraction: float = MISSING  # common offered load = this x the reference's median capacity
    common_rate: float | None = MISSING  # or a fixed common load in req/s
    equal_util_fraction: float = (
        MISSING  # each variant also at this fraction of its own median capacity (0: skip)
    )
    settle_s: float = MISSING  # unrecorded closed-loop traffic per variant before the first window (0: none)
    unloaded_requests: int = MISSING  # requests of an unloaded run (one closed-loop user)
    # unrecorded traffic before an unloaded run (null: loadtest.warmup_s); short, because the server was
    # settled and kept warm and one user has no queue to fill (reco.loadtest.study)
    unloaded_warmup_s: float | None = MISSING
    unloaded_repeats: int | None = MISSING  # unloaded runs per variant (null: repeats), spread over the study
    unloaded_interleave: UnloadedInterleave = MISSING  # window | request: what one unloaded block runs
    # null: every unloaded window unloaded_requests; else a variant's windows take about this many seconds
    # (requests = this / its seconds a request, measured on its settling run, else its first window; at
    # least unloaded_requests), so a fast variant's tail rests on as much of the host's time as a slow one's
    unloaded_window_s: float | None = MISSING
    load_requests: int = MISSING  # requests of a common-load window
    # common-load rounds per variant (null: repeats): the rounds are the clusters of the pooled interval
    # (Student t on rounds - 1 df), so more, shorter rounds close a p99 with fewer requests
    common_repeats: int | None = MISSING
    equal_util_requests: int = MISSING  # requests of an equal-utilisation window
    # wall-time limit of the load test in minutes (null: none); windows past it are skipped and listed,
    # never guessed (reco.loadtest.budget)
    budget_min: float | None = MISSING
    # the declared headline's and the reference's capacity searches bisect until their brackets are this
    # narrow (null: capacity.tolerance): the QPS gain's interval is the product of the two brackets
    # (reco.loadtest.study._Study.search_config)
    headline_tolerance: float | None = MISSING
    reference_tolerance: float | None = MISSING
    # the reference's capacity steps pool at most this many requests (null: capacity.max_step_requests): a
    # slow reference's requests are a large share of the SLO, so near its capacity only its p99 interval
    # can PASS a step, and the looks past a few thousand requests cost it minutes
    # (reco.loadtest.study._Study.search_config)
    reference_max_step_requests: int | None = MISSING
    # the other variants' first capacity searches start at this fraction of their predicted capacity (no
    # lower than the common load), where the first step should PASS and so decide the latency gate that
    # their p99 at the common load cannot (null: above the prediction, like the first searches;
    # reco.loadtest.study._more_searches)
    gate_start_fraction: float | None = MISSING
    correctness: CorrectnessConfig = field(default_factory=CorrectnessConfig)
    # name -> how to serve; each variant x serving pair is one row of the report: `<variant>` for the
    # serving named `reco`, `<variant>_<name>` for the others (reco.loadtest.servings)
    servings: dict[str, ServingConfig] = field(default_factory=dict)

    def check(self, where: str) -> None:
        if self.unloaded_warmup_s is not None and self.unloaded_warmup_s < 0:
            raise ConfigError(
                f"{where}.unloaded_warmup_s: expected >= 0 s or null, got {self.unloaded_warmup_s}"
            )
        if self.unloaded_window_s is not None and not self.unloaded_window_s > 0:
            raise ConfigError(
                f"{where}.unloaded_window_s: expected > 0 s or null, got {self.unloaded_window_s}"
            )
        if self.unloaded_window_s is not None and self.unloaded_interleave != UnloadedInterleave.window:
            raise ConfigError(
                f"{where}.unloaded_window_s: sizes each variant's own unloaded window, so it needs "
                f"{where}.unloaded_interleave=window (got {self.unloaded_interleave.value}); set it to null"
            )
        for key in ("repeats", "common_repeats"):
            if (rounds := getattr(self, key)) is not None and rounds < 1:
                raise ConfigError(f"{where}.{key}: expected >= 1 round, got {rounds}")
        for key in ("headline_tolerance", "reference_tolerance"):
            if (tol := getattr(self, key)) is not None and not 0 < tol < 1:
                raise ConfigError(f"{where}.{key}: expected 0 < tolerance < 1 or null, got {tol}")
        if self.gate_start_fraction is not None and not 0 < self.gate_start_fraction <= 1:
            raise ConfigError(
                f"{where}.gate_start_fraction: expected 0 < fraction <= 1 or null, got {self.gate_start_fraction}"
            )
        # A run is one block of the paired comparison (reco.stats.paired): its own p99 must not be its
        # largest request, or the block tells nothing about the tail.
        need = block_min_n(0.99)
        for key in ("unloaded_requests", "load_requests", "equal_util_requests"):
            if getattr(self, key) < need:
                raise ConfigError(
                    f"{where}.{key}: expected >= {need} requests (a block's p99 must not be its largest "
                    f"request: reco/stats/paired.py), got {getattr(self, key)}"
                )


@dataclass
class LoadtestConfig:
    """One load test (run_load) plus the capacity search and the study built on it."""

    enabled: bool = MISSING
    mode: LoadMode = MISSING
    users: int = MISSING  # closed loop users (open loop always runs one Poisson scheduler)
    spawn_rate: float = MISSING  # users started per second
    think_time_s: float = MISSING  # closed loop pause between a user's requests
    rate: float = MISSING  # open loop: requests per second in total
    max_inflight: int = MISSING  # open loop: outstanding requests beyond which an arrival is unsent (failed)
    window_requests: int | None = MISSING  # the window ends after this many requests; null: after duration_s
    duration_s: float = MISSING  # measured window when window_requests is null
    max_window_s: float = MISSING  # cap on a window ended by a request count (a slow server, a low rate)
    warmup_s: float = MISSING  # unrecorded traffic before the window
    drain_s: float = MISSING  # after the window: in-flight requests may finish (else they count as failed)
    score_every: int = MISSING  # record the returned scores of every Nth request of the window (0: none)
    seed: int = MISSING
    # generator processes: 1 = one Locust process; N > 1 = Locust master + N workers, the open-loop rate,
    # closed-loop users and window_requests split across them (reco.loadtest.distributed)
    workers: int = MISSING
    requests: RequestsConfig = field(default_factory=RequestsConfig)
    loadgen: LoadgenConfig = field(default_factory=LoadgenConfig)
    capacity: CapacityConfig = field(default_factory=CapacityConfig)
    study: StudyConfig = field(default_factory=StudyConfig)

    def check(self, where: str) -> None:
        if (cap := self.study.reference_max_step_requests) is None:
            return
        key, first = f"{where}.study.reference_max_step_requests", self.capacity.step_requests
        if cap < first:
            raise ConfigError(
                f"{key}: expected >= {where}.capacity.step_requests ({first}) or null, got {cap}"
            )
        # the reference's search runs on loadtest.capacity with this cap: more looks, each at a higher
        # confidence, and its first window must still carry a p99 upper bound at that confidence
        ref = dataclasses.replace(self.capacity, max_step_requests=cap)
        if first < (need := min_n_for_quantile(0.99, ref.step_conf)):
            raise ConfigError(
                f"{key}: {cap} gives a step {ref.looks} looks, at which a p99 upper bound needs "
                f"{where}.capacity.step_requests >= {need} (reco/loadtest/capacity.py), got {first}"
            )


def loadtest_config(node: Any) -> LoadtestConfig:
    """`node` (the `loadtest` group as composed: a DictConfig or dict) as a checked LoadtestConfig; for
    entry points, once."""
    return typed(node, LoadtestConfig, "loadtest")
