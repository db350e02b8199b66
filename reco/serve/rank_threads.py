"""The threads that call the model (serve.rank_threads), with a hand-off that costs the event loop little.

`loop.run_in_executor` on a ThreadPoolExecutor makes, per call, a concurrent Future (with its own
Condition), a work item, a semaphore check for idle threads and the chaining of that future onto an
asyncio one, and the worker thread releases the semaphore after each call: Python-level locking on the
model's core for every request. `RankThreads.call` hands the same call over as one tuple on a C queue
and gives its result back with one `call_soon_threadsafe` (bench.overhead measures what it saves).

RankThreads is also a concurrent.futures Executor (`submit`), so what still goes through
`run_in_executor` (the dynamic batcher, a two-tower retrieval) runs on the same threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("reco.serve")


def _deliver(fut: asyncio.Future, ok: bool, value: Any) -> None:
    """On the event loop: the call's outcome into its future (unless its request stopped waiting)."""
    if fut.done():
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


class RankThreads(concurrent.futures.Executor):
    """`n` threads named `name`_<i> taking calls from one queue, in arrival order."""

    def __init__(
        self, n: int, name: str, initializer: Callable[..., None] | None = None, initargs: tuple = ()
    ) -> None:
        """Args:
        n: threads (>= 1).
        name: their name prefix (reco.serve.server.pin_threads finds them by it).
        initializer: run first in each thread with `initargs` (e.g. pinning it to cores).
        """
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, args=(initializer, initargs), name=f"{name}_{i}", daemon=True)
            for i in range(n)
        ]
        for t in self._threads:
            t.start()

    def call(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """Run fn(*args) on a rank thread; on the event loop, returns the future of its result. A call whose
        future was cancelled before a thread took it (its request stopped waiting) is not made."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._jobs.put((loop, fut, fn, args))
        return fut

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        """concurrent.futures' submit (what run_in_executor calls)."""
        if self._closed:
            raise RuntimeError("cannot schedule new calls after shutdown")
        f: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((None, f, lambda: fn(*args, **kwargs), ()))
        return f

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop the threads once the queued calls ahead are done (`cancel_futures`: those are dropped)."""
        self._closed = True
        if cancel_futures:
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                job[1].cancel()
        for _ in self._threads:
            self._jobs.put(None)
        if wait:
            for t in self._threads:
                t.join()

    def _work(self, initializer: Callable[..., None] | None, initargs: tuple) -> None:
        if initializer is not None:
            initializer(*initargs)
        while (job := self._jobs.get()) is not None:
            loop, fut, fn, args = job
            if loop is None:
                self._run_submitted(fut, fn)
                continue
            if fut.cancelled():  # read off the loop's thread: at worst a cancelled call is still made
                continue
            try:
                out = (True, fn(*args))
            except BaseException as e:  # the request's handler decides what it means
                out = (False, e)
            try:
                loop.call_soon_threadsafe(_deliver, fut, *out)
            except RuntimeError:  # the loop closed meanwhile (server stopping): nobody waits for it
                log.debug("rank thread: event loop closed before a call's result was delivered")
            del job, fut, fn, args, out  # the block and the result are not held until the next call

    @staticmethod
    def _run_submitted(f: concurrent.futures.Future, fn: Callable[[], Any]) -> None:
        if not f.set_running_or_notify_cancel():
            return
        try:
            f.set_result(fn())
        except BaseException as e:
            f.set_exception(e)
