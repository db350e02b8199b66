"""One unloaded block as ONE Locust window over every variant's server (loadtest.study.unloaded_interleave
= request), turned back into one LoadRun per variant.

    runs = run_interleaved([Target("a", url_a, out / "a"), Target("b", url_b, out / "b")], c, requests,
                           cpus, kind="unloaded", seed=7, pool=pool)      # {"a": LoadRun, "b": LoadRun}

Why: on these VMs sequential requests to an idle server run 1.3-1.9x slower for stretches of 2-10 s, every
minute or two (the host's other tenants). A block of per-variant windows (0.2-3 s each, one after another)
puts such a stretch on one variant and not the others, so it does not cancel in their ratio and one block
sets a variant's pooled p99. Here the one closed-loop user takes the servers in cycles -- each cycle every
server once, in a fresh seeded random order (loadtest/locustfile.py, --targets) -- so a stretch lands on
every variant of the block alike.

Each server gets what a window of its own gives it: the same request bodies in the same order (its own
stream, seeded as the one user's), `window_requests` requests in the window after a warm-up that also
cycles, its own record under its own directory (latencies.csv, .summary.json, .scores.jsonl, the CDF
plot), its /metrics (or Triton statistics: a Triton target speaks KServe v2) scraped before and after the
window, and so its own LoadRun (reco.loadtest.window.finish_run), judged on the one generator's CPU. Its
window_s (and so its qps) is its share of the window, the time from each of its sends to the user's next
(own_seconds), which is what a window of its own would have lasted; the steal and generator CPU are the
whole window's. Locust's own reports and log go to the first target's directory. Closed loop, one user,
one process only: that is what an unloaded window is.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from reco.loadtest.config import LoadMode, LoadtestConfig
from reco.loadtest.histogram import read_latencies
from reco.loadtest.locust_pool import LocustPool, PooledLocust
from reco.loadtest.outcome import LoadRun
from reco.loadtest.runner import HeadlessLocust
from reco.loadtest.window import Window, finish_single_process, plan_window


@dataclass(frozen=True)
class Target:
    """One variant's server in a request-interleaved window."""

    name: str  # the variant (the key of its LoadRun)
    url: str
    out: Path  # its window directory (its record, as a window of its own would leave it)
    triton_model: str | None = None  # a Triton server: KServe v2 to this model (ServerHandle.triton_model)


def run_interleaved(
    targets: Sequence[Target],
    c: LoadtestConfig,
    requests_path: str | Path | None,
    cpus: list[int] | None,
    *,
    kind: str,
    seed: int,
    reports: bool = True,
    pool: LocustPool | None = None,
) -> dict[str, LoadRun]:
    """One closed-loop window over every target's server (see the module docstring).

    Args:
        targets: the block's variants, in the order their requests are listed (the cycles are shuffled
            anyway); names unique.
        c: the window's settings: closed loop, one user, one process, window_requests per server.
        seed: of the cycles' order (the request bodies follow loadtest.seed, as in any window).
        pool: run it in a kept Locust process (one of its own: reco.loadtest.locust_pool); None: headless.
    Returns:
        name -> its LoadRun. Raises LoadTestError as run_load does; ValueError for settings a
        one-user interleaved window cannot have.
    """
    _check(targets, c)
    windows = [
        plan_window(
            t.url, c, t.out, requests_path, cpus, kind=kind, reports=reports, triton_model=t.triton_model
        )
        for t in targets
    ]
    gen = HeadlessLocust() if pool is None else PooledLocust(pool)
    samples = gen.collect(lead_window(windows, seed))
    runs = {}
    for t, w, (b, a), own in zip(targets, windows, samples.servers, own_seconds(windows), strict=True):
        run = finish_single_process(w, dataclasses.replace(samples, before=b, after=a))
        runs[t.name] = dataclasses.replace(run, window_s=own, qps=(run.n - run.n_failed) / own)
    return runs


def own_seconds(windows: Sequence[Window]) -> list[float]:
    """Each target's share of the window: from each of its requests' send to the user's next send (its
    last one: its own latency), so the shares add up to the window and a target's qps reads as in a
    window of its own (one user: a request's slot is its latency plus the generator's turn-around)."""
    lats = [read_latencies(w.latency_file) for w in windows]
    start = np.concatenate([x.start_s for x in lats])
    who = np.concatenate([np.full(len(x), i) for i, x in enumerate(lats)])
    last = np.nan_to_num(np.concatenate([x.latency_ms for x in lats]) / 1000.0)
    order = np.argsort(start, kind="stable")
    slot = np.append(np.diff(start[order]), last[order][-1:]) if len(order) else np.zeros(0)
    return [max(float(slot[who[order] == i].sum()), 1e-9) for i in range(len(windows))]


def lead_window(windows: Sequence[Window], seed: int) -> Window:
    """The one window Locust runs: the first target's, sent to every target (--targets). Each target's
    protocol travels in --targets, so the process itself speaks reco's (no --triton-model)."""
    spec = {
        "seed": seed,
        "targets": [
            {"url": w.url, "latency_file": str(w.latency_file), "triton_model": w.triton_model or ""}
            for w in windows
        ],
    }
    first = windows[0]
    opts = {**first.opts, "targets": json.dumps(spec)}
    return dataclasses.replace(first, triton_model=None, opts=opts, targets=tuple(windows))


def _check(targets: Sequence[Target], c: LoadtestConfig) -> None:
    names = [t.name for t in targets]
    if not names or len(set(names)) != len(names):
        raise ValueError(f"an interleaved window needs targets with distinct names, got {names}")
    if c.mode != LoadMode.closed or c.users != 1 or c.workers != 1 or not c.window_requests:
        raise ValueError(
            "a request-interleaved window (loadtest.study.unloaded_interleave=request) is one closed-loop "
            f"user in one process with a request count; got loadtest.mode={c.mode.value}, users={c.users}, "
            f"workers={c.workers}, window_requests={c.window_requests}"
        )
