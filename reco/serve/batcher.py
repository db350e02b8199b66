"""Model calls off the event loop, one at a time or dynamically batched (as Triton's dynamic batcher).

Both rankers run the scorer in a dedicated thread pool, so the event loop keeps accepting and parsing
requests while a model call runs (torch and ONNX Runtime release the GIL). `score` returns the
probabilities with the time the block waited (queue) and the time of the model call it rode in (rank).

DynamicBatcher: a block that arrives while no call is being formed opens a batch; blocks arriving within
`max_queue_delay_ms` of it join until the batch holds `max_batch` candidate ROWS. The batch's blocks are
concatenated into one scorer call and the result is split back. A block larger than `max_batch` is
scored on its own (never split), and a block that would overflow the batch opens the next one.

With serve.batching.slo_ms set, the window is not fixed but derived per batch from the SLO and the
measured arrival rate (ArrivalWindow): a block may spend at most slo_share x slo_ms waiting for company,
and waits only when company is expected within that budget (the smoothed gap between arrivals is
shorter), then only as long as the expected arrivals take to fill the batch. At a low arrival rate a
lone request goes out at once instead of paying a window for nothing; under load the window opens to
the budget.

Every block carries a deadline (perf_counter seconds; inf without serve.max_wait_ms): a block whose
deadline has passed when its model call would start is not scored but fails with Overdue, so under
overload the model's time goes to requests that can still be answered in time (reco/serve/admission.py).
A request that stops waiting (serve.model_timeout_s, or its client left) cancels its block's future; a
cancelled block still pending is dropped, not scored. If the batcher task itself dies, the requests of
the batch it held fail at once with BatcherFailed and a new task takes over the pending ones: nothing
waits on a task that no longer exists.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from concurrent.futures import Executor
from dataclasses import dataclass, field

import numpy as np

from reco.runtime import Scorer
from reco.serve.admission import Overdue
from reco.serve.config import BatchingConfig
from reco.serve.rank_threads import RankThreads

log = logging.getLogger("reco.serve")


class BatcherFailed(RuntimeError):
    """The dynamic batcher task died while it held this request's block (it has been restarted)."""


@dataclass
class Scored:
    probs: np.ndarray  # [N] float32
    queue_s: float
    rank_s: float
    batch_rows: int = 0
    batch_requests: int = 1
    reports_batch: bool = True  # one block per model call carries the call's batch statistics
    rank_cpu_s: float = 0.0  # CPU time of the thread that made the model call (time.thread_time)


class DirectRanker:
    """One scorer call per request, in arrival order on the executor's threads."""

    restarts = 0  # as DynamicBatcher's: there is no task to restart

    def __init__(self, scorer: Scorer, executor: Executor) -> None:
        self.scorer, self.executor = scorer, executor
        # RankThreads: its own hand-off (reco/serve/rank_threads.py); any other Executor: run_in_executor
        self._hand_off = (
            executor.call
            if isinstance(executor, RankThreads)
            else lambda fn, *a: asyncio.get_running_loop().run_in_executor(executor, fn, *a)
        )

    def _call(
        self, dense: np.ndarray, ids: np.ndarray, mask: np.ndarray, t_submit: float, deadline: float
    ) -> Scored:
        t0, c0 = time.perf_counter(), time.thread_time()
        if t0 > deadline:  # checked on the model's thread: the wait behind other calls counts
            raise Overdue(t0 - deadline)
        probs = self.scorer(dense, ids, mask, [len(dense)])
        t1, c1 = time.perf_counter(), time.thread_time()
        return Scored(probs, t0 - t_submit, t1 - t0, len(probs), 1, rank_cpu_s=c1 - c0)

    def score(
        self, dense: np.ndarray, ids: np.ndarray, mask: np.ndarray, deadline: float = math.inf
    ) -> asyncio.Future[Scored]:
        """Score one block: dense [N, D] f32, ids [N, F, L] i64, mask [N, F, L] f32 -> Scored (probs [N]).

        Awaited as DynamicBatcher.score is; a future rather than a coroutine, so asyncio.wait_for does
        not wrap it in a task of its own (per-request work on the model's core). Raises Overdue, without
        calling the model, when the call would start after `deadline` (time.perf_counter() seconds).
        """
        return self._hand_off(self._call, dense, ids, mask, time.perf_counter(), deadline)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


class InlineRanker(DirectRanker):
    """serve.rank_threads=0: the event loop's own thread calls the model, no hand-off to another thread
    (no queue, no wake-up of a rank thread and then of the event loop, one thread on the core instead of
    two). Meanwhile the event loop reads no other request, and serve.model_timeout_s cannot cut a call
    short (nothing can interrupt it): a call that hangs holds the whole worker."""

    def __init__(self, scorer: Scorer) -> None:  # noqa: D107 -- no threads, so no super().__init__
        self.scorer, self.executor = scorer, None

    def score(
        self, dense: np.ndarray, ids: np.ndarray, mask: np.ndarray, deadline: float = math.inf
    ) -> asyncio.Future[Scored]:
        """DirectRanker.score, the call made before this returns (the future is done)."""
        fut = asyncio.get_running_loop().create_future()
        try:
            fut.set_result(self._call(dense, ids, mask, time.perf_counter(), deadline))
        except Exception as e:  # as on a rank thread: the handler decides what it means
            fut.set_exception(e)
        return fut


@dataclass
class ArrivalWindow:
    """The batching window from an SLO budget and the measured arrival rate (see the module docstring).

    The arrival rate is an exponentially weighted mean of the gaps between blocks (weight `alpha` on the
    newest), each gap clipped at twice the budget: one idle minute must not hide a burst for long, and
    a gap that long already says "no company within the budget". Rows per block are averaged alike.
    """

    budget_s: float  # slo_share x slo_ms: the longest a block may wait for company
    max_rows: int  # batching.max_batch
    alpha: float = 0.1
    gap_s: float = math.inf  # smoothed gap between arrivals; inf until two blocks were seen
    rows: float = 0.0  # smoothed rows per block
    last: float | None = None  # arrival time of the previous block (perf_counter seconds)

    def observe(self, t: float, rows: int) -> None:
        """A block of `rows` candidates arrived at `t` (perf_counter seconds)."""
        if self.last is not None:
            gap = min(max(t - self.last, 0.0), 2 * self.budget_s)
            self.gap_s = gap if math.isinf(self.gap_s) else self.gap_s + self.alpha * (gap - self.gap_s)
        self.rows = float(rows) if self.rows == 0 else self.rows + self.alpha * (rows - self.rows)
        self.last = t

    def delay_s(self) -> float:
        """How long the batch being opened waits for company: 0 when the next arrival is not expected
        within the budget, else the time the expected arrivals take to fill max_rows, at most the budget."""
        if not self.gap_s < self.budget_s:
            return 0.0
        more = max(self.max_rows / max(self.rows, 1.0) - 1.0, 0.0)  # blocks still fitting beside this one
        return min(self.budget_s, more * self.gap_s)


def arrival_window(b: BatchingConfig) -> ArrivalWindow | None:
    """serve.batching's derived window, or None (the fixed max_queue_delay_ms) when slo_ms is null."""
    return None if b.slo_ms is None else ArrivalWindow(b.slo_share * b.slo_ms / 1000.0, b.max_batch)


@dataclass
class _Block:
    dense: np.ndarray
    ids: np.ndarray
    mask: np.ndarray
    fut: asyncio.Future
    deadline: float = math.inf  # perf_counter seconds; not scored when its call would start later
    t_enqueue: float = field(default_factory=time.perf_counter)

    @property
    def rows(self) -> int:
        return self.dense.shape[0]


class DynamicBatcher:
    """Coalesces concurrent requests' candidate blocks into one scorer call (see the module docstring)."""

    def __init__(
        self,
        scorer: Scorer,
        executor: Executor,
        max_batch: int,
        max_queue_delay_ms: float,
        crash_batches: int = 0,
        window: ArrivalWindow | None = None,
    ) -> None:
        """Args:
        scorer: the model call, (dense, ids, mask) -> probs [N].
        executor: the threads that call it.
        max_batch: candidate rows per coalesced call.
        max_queue_delay_ms: longest a block waits for company (without `window`).
        crash_batches: test-only (serve.faults.batcher_crashes): the task dies on its first N batches.
        window: the SLO- and arrival-derived window (serve.batching.slo_ms) instead of max_queue_delay_ms.
        """
        if max_batch < 1 or max_queue_delay_ms < 0:
            raise ValueError(
                f"serve.batching: max_batch must be >= 1 and max_queue_delay_ms >= 0, "
                f"got {max_batch} and {max_queue_delay_ms}"
            )
        self.scorer, self.executor = scorer, executor
        self.max_batch = int(max_batch)
        self.max_delay_s = float(max_queue_delay_ms) / 1000.0
        self.window = window
        self.pending: deque[_Block] = deque()
        self.wakeup = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.current: list[_Block] = []  # the batch being formed or scored by the task
        self.restarts = 0
        self.crashes_left = int(crash_batches)
        self.stopping = False

    async def start(self) -> None:
        self.stopping = False
        self._launch()

    async def stop(self) -> None:
        self.stopping = True
        if self.task is not None:
            self.task.cancel()

    def _launch(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())
        self.task.add_done_callback(self._on_task_done)

    def _on_task_done(self, task: asyncio.Task) -> None:
        if self.stopping or task.cancelled():
            return
        exc = task.exception()
        held, self.current = self.current, []
        # The traceback once; a batcher that keeps dying must not write one per batch.
        log.error(
            "dynamic batcher died (%s: %.200s); failing the %d request(s) it held and restarting it",
            type(exc).__name__,
            exc,
            len(held),
            exc_info=exc if self.restarts == 0 else None,
        )
        err = BatcherFailed(f"dynamic batcher failed ({type(exc).__name__}) and was restarted; retry")
        for b in held:
            if not b.fut.done():
                b.fut.set_exception(err)
        self.restarts += 1
        self._launch()
        self.wakeup.set()

    async def score(
        self, dense: np.ndarray, ids: np.ndarray, mask: np.ndarray, deadline: float = math.inf
    ) -> Scored:
        """Queue one block (shapes and `deadline` as DirectRanker.score) for the next coalesced call;
        await its share."""
        if self.task is None or self.task.done():
            raise BatcherFailed("dynamic batcher is not running (server starting or stopping)")
        block = _Block(dense, ids, mask, asyncio.get_running_loop().create_future(), deadline)
        if self.window is not None:
            self.window.observe(block.t_enqueue, block.rows)
        self.pending.append(block)
        self.wakeup.set()
        return await block.fut

    def _drop_abandoned(self) -> None:
        while self.pending and self.pending[0].fut.done():  # cancelled: its request stopped waiting
            self.pending.popleft()

    def _take(self) -> list[_Block]:
        """Pop pending blocks that fit one batch (the first live one always goes, however large); blocks
        past their deadline fail with Overdue on the way. Empty when no live block was pending."""
        now = time.perf_counter()
        batch: list[_Block] = []
        rows = 0
        while self.pending:
            b = self.pending[0]
            if b.fut.done():  # cancelled: its request stopped waiting
                self.pending.popleft()
            elif b.deadline < now:
                self.pending.popleft()
                b.fut.set_exception(Overdue(now - b.deadline))
            elif batch and rows + b.rows > self.max_batch:
                break
            else:
                self.pending.popleft()
                rows += b.rows
                batch.append(b)
        return batch

    def _rows_pending(self) -> int:
        return sum(b.rows for b in self.pending)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._drop_abandoned()
            if not self.pending:
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            # Wait for company until the oldest block has waited the window or the batch is full.
            delay = self.max_delay_s if self.window is None else self.window.delay_s()
            deadline = self.pending[0].t_enqueue + delay
            while self._rows_pending() < self.max_batch and (left := deadline - time.perf_counter()) > 0:
                self.wakeup.clear()
                try:
                    await asyncio.wait_for(self.wakeup.wait(), left)
                except TimeoutError:
                    break
            batch = self.current = self._take()
            if not batch:
                continue
            if self.crashes_left > 0:
                self.crashes_left -= 1
                raise RuntimeError("injected batcher failure (serve.faults.batcher_crashes)")
            try:
                results = await loop.run_in_executor(self.executor, self._call, batch)
            except Exception as e:  # a failed call fails its requests, never the batcher
                self.current = []
                for b in batch:
                    if not b.fut.done():
                        b.fut.set_exception(e)
                continue
            self.current = []
            for b, r in zip(batch, results, strict=True):
                if not b.fut.done():  # the client may have gone away
                    b.fut.set_result(r)

    def _call(self, batch: list[_Block]) -> list[Scored]:
        t0, c0 = time.perf_counter(), time.thread_time()
        sizes = [b.rows for b in batch]
        if len(batch) == 1:
            probs = self.scorer(batch[0].dense, batch[0].ids, batch[0].mask, sizes)
        else:
            probs = self.scorer(
                np.concatenate([b.dense for b in batch]),
                np.concatenate([b.ids for b in batch]),
                np.concatenate([b.mask for b in batch]),
                sizes,
            )
        t1, cpu = time.perf_counter(), time.thread_time() - c0
        rows = sum(b.rows for b in batch)
        out, lo = [], 0
        for j, b in enumerate(batch):
            share = probs[lo : lo + b.rows]
            out.append(Scored(share, t0 - b.t_enqueue, t1 - t0, rows, len(batch), j == 0, rank_cpu_s=cpu))
            lo += b.rows
        return out
