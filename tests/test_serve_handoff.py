"""The request path's per-request machinery, in process: the model calls' hand-off to the rank threads
(reco/serve/rank_threads.py), the inline ranker (serve.rank_threads=0) and the bisecting histogram
(reco/serve/histogram.py). The servers that use them are tested in tests/test_serve.py."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from reco.serve.admission import Overdue
from reco.serve.batcher import DirectRanker, InlineRanker
from reco.serve.histogram import BisectHistogram
from reco.serve.metrics import BUCKETS
from reco.serve.rank_threads import RankThreads

BLOCK = (np.zeros((4, 3), np.float32), np.zeros((4, 2, 1), np.int64), np.ones((4, 2, 1), np.float32))


def test_rank_threads_return_results_and_errors_to_the_event_loop_on_named_threads():
    threads = RankThreads(2, "rank")
    seen: list[str] = []

    def work(x: int) -> int:
        seen.append(threading.current_thread().name)
        if x < 0:
            raise ValueError(f"negative {x}")
        return x * 2

    async def scenario() -> tuple[list[int], str, int]:
        got = await asyncio.gather(*(threads.call(work, i) for i in range(6)))
        try:
            await threads.call(work, -1)
        except ValueError as e:
            err = str(e)
        # what goes through run_in_executor (batcher, two-tower retrieval) runs on the same threads
        via_executor = await asyncio.get_running_loop().run_in_executor(threads, work, 5)
        return list(got), err, via_executor

    try:
        assert asyncio.run(scenario()) == ([0, 2, 4, 6, 8, 10], "negative -1", 10)
    finally:
        threads.shutdown(wait=True)
    assert set(seen) <= {"rank_0", "rank_1"} and len(seen) == 8
    assert not any(t.is_alive() for t in threads._threads)


def test_a_call_cancelled_before_a_thread_takes_it_is_not_made():
    threads = RankThreads(1, "rank")
    release = threading.Event()
    made: list[str] = []

    def hold() -> None:
        release.wait(10)
        made.append("hold")

    async def scenario() -> bool:
        busy = threads.call(hold)  # takes the only thread
        queued = threads.call(made.append, "queued")
        queued.cancel()  # its request stopped waiting (model_timeout_s, or the client left)
        release.set()
        await busy
        await threads.call(made.append, "after")  # the queue behind it still runs, in order
        return queued.cancelled()

    try:
        assert asyncio.run(scenario()) is True
    finally:
        threads.shutdown(wait=True)
    assert made == ["hold", "after"]


@pytest.mark.parametrize("make", ["threads", "inline"])
def test_rankers_score_in_time_blocks_and_refuse_late_ones(make):
    calls: list[int] = []

    def scorer(dense: np.ndarray, ids: np.ndarray, mask: np.ndarray, sizes=None) -> np.ndarray:
        calls.append(len(dense))
        return np.full(len(dense), 0.5, dtype=np.float32)

    threads = RankThreads(1, "rank") if make == "threads" else None
    ranker = DirectRanker(scorer, threads) if threads else InlineRanker(scorer)

    async def scenario() -> tuple[float, int, type]:
        ok = await ranker.score(*BLOCK, time.perf_counter() + 60)
        try:
            await ranker.score(*BLOCK, time.perf_counter() - 1)
        except Overdue as e:
            return float(ok.probs.sum()), ok.batch_rows, type(e)
        raise AssertionError("a block past its deadline was scored")

    try:
        assert asyncio.run(scenario()) == (2.0, 4, Overdue) and calls == [4]
    finally:
        if threads:
            threads.shutdown(wait=True)


def test_bisect_histogram_exposes_what_the_stock_histogram_does():
    """Values on the bounds (le is inclusive), between them, below the first and beyond the last finite
    one land in the same buckets as prometheus_client's own scan puts them."""
    values = [0.0, 1e-6, *BUCKETS[:-1:7], *(b * 1.0001 for b in BUCKETS[3:-1:11]), 1e-3, 0.0123, 60.0, 1e6]
    texts = []
    for cls in (Histogram, BisectHistogram):
        reg = CollectorRegistry()
        h = cls("t_seconds", "test", ["stage"], buckets=BUCKETS, registry=reg)
        for v in values:
            h.labels(stage="rank").observe(v)
        lines = generate_latest(reg).decode().splitlines()
        texts.append("\n".join(x for x in lines if "_created" not in x))  # a timestamp of its own
    assert texts[0] == texts[1]
    assert "t_seconds_count" in texts[0] and math.isinf(BUCKETS[-1])
