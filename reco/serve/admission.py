"""Admission by age: how long a request has already waited decides whether it is still worth serving.

Counting requests in flight (serve.queue_limit) does not bound latency: under overload requests wait in
the accept backlog and the event loop BEFORE the handler can count them, and that wait is invisible to
the server. So, as Triton's queue policy (max queue delay -> reject) and CoDel do, the server also looks
at each request's AGE and sheds (503 + Retry-After, no model call) one that is already older than
serve.max_wait_ms -- it would most likely miss its deadline anyway, and serving it would delay the
requests behind it too.

The age counts from the request's `X-Request-Start` header when it has one -- the time it entered the
system (a proxy's receive time, or the load generator's scheduled send time), as Heroku's router and
New Relic use it -- and otherwise from the moment the handler started. The stamp must come from a clock
in step with the server's (same host, or NTP): a skew shows up as age. It is read leniently: a missing
or malformed header counts as absent (never a 4xx), a stamp slightly ahead (within
serve.request_start_max_ahead_s, clock skew) as age 0. It is not trusted beyond reason: a stamp further
ahead, or older than serve.request_start_max_age_s, is a wrong clock or a forged header -- taken at its
word, t=1 was shed as "waited 1796417980784 ms" and a stamp an hour ahead skipped the age check -- so
it is ignored (the age counts from handler entry, as without the header) and counted
(reco_request_start_ignored_total{reason}).

Where the age is checked matters as much as the limit: a request should wait where waiting is free and
be shed BEFORE its expensive work (retrieval, features), not after it. WorkGate is that place for an
unbatched model: at most `slots` requests prepare or score at once, the rest wait in a FIFO in front of
the work, and one whose deadline passes there leaves at once.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from enum import StrEnum

REQUEST_START = "x-request-start"
_MAX_LEN = 64  # longer than any timestamp spelling: not parsed


class ShedReason(StrEnum):
    """Why a request was shed (the `reason` label of reco_shed_total)."""

    queue_limit = "queue_limit"  # serve.queue_limit requests already admitted
    age_at_admission = "age_at_admission"  # older than serve.max_wait_ms when its body had been read
    wait_before_model = "wait_before_model"  # passed serve.max_wait_ms while waiting for its model call


class StampIgnored(StrEnum):
    """Why an X-Request-Start stamp was not trusted (the `reason` label of reco_request_start_ignored_total)."""

    future = "future"  # further ahead of the server's clock than serve.request_start_max_ahead_s
    too_old = "too_old"  # older than serve.request_start_max_age_s


class Overdue(Exception):
    """A block's deadline passed before its model call could start; it was not scored (a ranker raises it)."""

    def __init__(self, late_s: float) -> None:
        super().__init__(f"deadline passed {late_s * 1000:.1f} ms before the model call could start")
        self.late_s = late_s


def request_start_epoch(value: str | None) -> float | None:
    """The time an X-Request-Start header gives, in seconds since the epoch.

    Accepted spellings: `t=<number>` or `<number>`, the number in seconds, milliseconds, microseconds or
    nanoseconds since the epoch, the unit told by its magnitude (as New Relic reads the header; nginx's
    `t=${msec}` gives seconds with a fraction, Heroku milliseconds, this project's generator microseconds).

    Args:
        value: the header value, or None when absent.
    Returns:
        Epoch seconds, or None when the header is absent or not one of those spellings.
    """
    if not value or len(value) > _MAX_LEN:
        return None
    v = value.strip()
    if v[:2] in ("t=", "T="):
        v = v[2:]
    try:
        x = float(v)
    except ValueError:
        return None
    if not math.isfinite(x) or x <= 0:
        return None
    for per_second in (1.0, 1e3, 1e6, 1e9):  # seconds up to year ~5000, then the next unit
        if x < 1e11 * per_second:
            return x / per_second
    return None


def request_age_s(
    header: str | None, entered_perf: float, now_perf: float, max_age_s: float, max_ahead_s: float
) -> tuple[float, StampIgnored | None]:
    """How long a request has waited so far.

    Args:
        header: its X-Request-Start value, or None.
        entered_perf: time.perf_counter() when the handler started (the age origin without a usable stamp).
        now_perf: time.perf_counter() now.
        max_age_s: a stamp older than this is not trusted (serve.request_start_max_age_s).
        max_ahead_s: a stamp further in the future is not trusted; up to it, age 0 (clock skew).
    Returns:
        (seconds since its X-Request-Start, or since `entered_perf` when the header is absent, malformed
        or not trusted; why a parsed stamp was not trusted, else None).
    """
    in_server = max(0.0, now_perf - entered_perf)
    start = request_start_epoch(header)
    if start is None:
        return in_server, None
    age = time.time() - start
    if age < -max_ahead_s:
        return in_server, StampIgnored.future
    if age > max_age_s:
        return in_server, StampIgnored.too_old
    return max(0.0, age), None


class WorkGate:
    """FIFO in front of the expensive part of a request: at most `slots` requests inside at once.

    A waiter whose deadline passes before its turn fails at once with Overdue (it never takes a slot);
    a waiter cancelled by its task leaves the queue without leaking the slot it may just have been given.
    """

    def __init__(self, slots: int) -> None:
        """Args:
        slots: requests allowed inside at once (>= 1).
        """
        if slots < 1:
            raise ValueError(f"WorkGate: slots must be >= 1, got {slots}")
        self.free = slots
        self.waiters: deque[asyncio.Future] = deque()

    async def enter(self, deadline: float) -> None:
        """Wait for a slot; raises Overdue once `deadline` (time.perf_counter() seconds) has passed."""
        if self.free > 0 and not self.waiters:
            self.free -= 1
            return
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.waiters.append(fut)
        timer = None
        if math.isfinite(deadline):
            timer = loop.call_later(max(0.0, deadline - time.perf_counter()), _expire, fut, deadline)
        try:
            await fut  # None: a slot handed over by leave(); Overdue: the timer fired first
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.leave()  # the slot arrived as the task was cancelled: pass it on
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def leave(self) -> None:
        """Give the slot to the oldest live waiter, or free it."""
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():  # expired or cancelled waiters are skipped
                fut.set_result(None)
                return
        self.free += 1


def _expire(fut: asyncio.Future, deadline: float) -> None:
    if not fut.done():
        fut.set_exception(Overdue(time.perf_counter() - deadline))
