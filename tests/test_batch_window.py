"""The batching window derived from the SLO and the measured arrival rate (serve.batching.slo_ms,
reco.serve.batcher.ArrivalWindow): arrival times are given, not read from the clock, except in the batcher
test, whose windows are either zero or far longer than the test."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from reco.cli.compose import compose
from reco.config import ConfigError
from reco.serve.batcher import ArrivalWindow, DynamicBatcher, arrival_window
from reco.serve.config import serve_config

BUDGET = 0.005  # s: slo_share 0.1 x slo_ms 50


def window_after(gaps_s: list[float], rows: int, max_rows: int = 4096) -> ArrivalWindow:
    w, t = ArrivalWindow(BUDGET, max_rows), 100.0
    for g in [0.0, *gaps_s]:
        t += g
        w.observe(t, rows)
    return w


def test_no_window_until_company_is_expected_within_the_budget():
    assert ArrivalWindow(BUDGET, 4096).delay_s() == 0.0  # nothing measured yet
    assert window_after([0.020] * 50, 50).delay_s() == 0.0  # one request per 20 ms: waiting buys nothing
    # one per 0.5 ms, 50 rows each: 80 more fit, far more than arrive within the budget
    assert window_after([0.0005] * 50, 50).delay_s() == BUDGET


def test_the_window_is_the_time_to_fill_the_batch_when_that_is_shorter():
    w = window_after([0.001] * 50, 1024)  # 3 more blocks fill 4096 rows: ~3 ms at one per ms
    assert w.delay_s() == pytest.approx(3 * w.gap_s) and w.delay_s() < BUDGET
    assert window_after([0.001] * 50, 4096).delay_s() == 0.0  # one block fills the batch alone


def test_an_idle_pause_closes_the_window_and_a_burst_reopens_it():
    w = window_after([0.0005] * 50 + [60.0], 50)
    assert w.gap_s == pytest.approx(0.0005 + 0.1 * (2 * BUDGET - 0.0005))  # the pause counts as 2 budgets
    assert w.delay_s() == BUDGET  # one long gap alone does not hide a steady rate
    w = window_after([60.0] * 5, 50)
    assert w.delay_s() == 0.0
    t = w.last
    for _ in range(30):  # a burst at one per 0.2 ms
        t += 0.0002
        w.observe(t, 50)
    assert w.delay_s() == BUDGET


def test_slo_keys_build_the_window_and_bad_values_name_the_key():
    assert arrival_window(serve_config(compose(["serve.batching.enabled=true"]).serve).batching) is None
    b = serve_config(compose(["serve.batching.slo_ms=50", "serve.batching.slo_share=0.1"]).serve).batching
    w = arrival_window(b)
    assert w is not None and w.budget_s == pytest.approx(BUDGET) and w.max_rows == b.max_batch
    for bad in (["serve.batching.slo_ms=0"], ["serve.batching.slo_share=1.5"]):
        with pytest.raises(ConfigError, match="serve.batching.slo_ms and serve.batching.slo_share"):
            serve_config(compose(bad).serve)


def rows(n: int, j: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.full((n, 2), j, np.float32), np.zeros((n, 1, 1), np.int64), np.ones((n, 1, 1), np.float32)


def score_two(window: ArrivalWindow) -> list:
    """Two 50-row blocks, the second sent 20 ms after the first, through a batcher whose fixed window is 0."""

    def scorer(dense, ids, mask, sizes=None):
        return dense[:, 0].copy()

    async def run():
        with ThreadPoolExecutor(1) as ex:
            b = DynamicBatcher(scorer, ex, max_batch=100, max_queue_delay_ms=0, window=window)
            await b.start()
            try:
                first = asyncio.ensure_future(b.score(*rows(50, 1)))
                await asyncio.sleep(0.02)
                return await asyncio.wait_for(asyncio.gather(first, b.score(*rows(50, 2))), 30)
            finally:
                await b.stop()

    return asyncio.run(run())


def test_the_batcher_waits_only_when_the_measured_rate_promises_company():
    busy = ArrivalWindow(budget_s=600.0, max_rows=100)  # a window far longer than the test, when open
    busy.observe(0.0, 50)  # the last arrivals were close together: company is expected
    busy.observe(0.001, 50)
    together = score_two(busy)
    assert [s.batch_requests for s in together] == [2, 2]  # the first waited for the second
    assert together[0].probs.tolist() == [1.0] * 50 and together[1].probs.tolist() == [2.0] * 50
    # no history: the first block goes out at once instead of waiting the budget for nothing
    assert [s.batch_requests for s in score_two(ArrivalWindow(600.0, 100))] == [1, 1]
