"""Capacity search shortcuts that must not change its answers: screening windows and a prior bracket.

Driven by the deterministic FakeServer of test_loadtest_capacity (true capacity known).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from reco.config import compose
from reco.loadtest.capacity import P99_MIN_N, SCREEN_MIN_N, find_capacity, screen_requests
from reco.loadtest.config import loadtest_config
from reco.stats import Verdict, quantile_ci, quantile_lower_bound
from tests.test_loadtest_capacity import FakeServer


@pytest.fixture(scope="module")
def cap():
    return loadtest_config(compose([]).loadtest).capacity


def test_lower_bound_is_the_two_sided_cis_and_exists_for_small_n():
    x = np.random.default_rng(3).lognormal(size=1000)
    assert quantile_lower_bound(x, 0.99) == quantile_ci(x, 0.99).lo
    assert quantile_ci(x[:100], 0.99).value is None and quantile_lower_bound(x[:100], 0.99) is not None
    assert quantile_lower_bound(np.array([]), 0.99) is None


def test_lower_bound_coverage_at_a_screening_size():
    """P(lower bound > true p99) <= 2.5 %: a screening FAIL is wrong at most that often."""
    rng = np.random.default_rng(11)
    true_p99 = float(np.exp(2.3263478740408408))  # lognormal(0, 1)
    wrong = sum(quantile_lower_bound(rng.lognormal(size=80), 0.99) > true_p99 for _ in range(2000))
    assert wrong <= 0.035 * 2000


def test_screening_ends_a_step_far_past_capacity_early(cap, tmp_path):
    c = dataclasses.replace(
        cap, start_rate=8, growth=2.0, min_rate=1, screen_s=10, step_requests=400, steps=12
    )
    fake = FakeServer(slo=100.0, capacity=5.0)
    res = find_capacity(fake, 100.0, c, tmp_path)
    first = res.steps[0]
    assert first.verdict == Verdict.FAIL and first.run.n == 80 and "screening" in first.reason
    passes = [s for s in res.steps if s.verdict == Verdict.PASS]
    assert passes and all(s.run.n >= P99_MIN_N for s in passes)  # a PASS always rests on a full window
    assert 0 < res.highest_pass <= 5.0
    # Screening off: the same bracket, more requests.
    full = find_capacity(FakeServer(100.0, 5.0), 100.0, dataclasses.replace(c, screen_s=0), tmp_path / "b")
    assert (full.highest_pass, full.lowest_fail) == (res.highest_pass, res.lowest_fail)
    assert sum(s.run.n for s in full.steps) > sum(s.run.n for s in res.steps)


def test_screen_requests_only_where_a_full_window_is_long(cap):
    c = dataclasses.replace(cap, screen_s=10, step_requests=400)
    assert screen_requests(8.0, c) == 80 and screen_requests(2.0, c) == SCREEN_MIN_N
    assert screen_requests(50.0, c) == 0 and screen_requests(8.0, dataclasses.replace(c, screen_s=0)) == 0


def test_a_prior_bracket_is_confirmed_in_two_steps(cap, tmp_path):
    c = dataclasses.replace(cap, growth=1.5, min_rate=1, tolerance=0.05, screen_s=0, steps=12)
    first = find_capacity(FakeServer(100.0, 300.0), 100.0, dataclasses.replace(c, start_rate=200), tmp_path)
    again = find_capacity(
        FakeServer(100.0, 300.0),
        100.0,
        dataclasses.replace(c, start_rate=first.highest_pass),
        tmp_path / "r1",
        expect_fail=first.lowest_fail,
    )
    assert len(again.steps) == 2 < len(first.steps)
    assert (again.highest_pass, again.lowest_fail) == (first.highest_pass, first.lowest_fail)
    # A bracket that moved is still found: the hint only orders the steps.
    moved = find_capacity(
        FakeServer(100.0, 400.0),
        100.0,
        dataclasses.replace(c, start_rate=first.highest_pass),
        tmp_path / "r2",
        expect_fail=first.lowest_fail,
    )
    assert first.lowest_fail < moved.highest_pass <= 400.0
