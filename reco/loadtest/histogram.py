"""Exact latency quantiles from the load generator's per-request file, and the latency CDF plot.

Quantiles are nearest-rank over EVERY request of the measured window, each with a 95 % CI between two
order statistics, widened for requests that are not independent (reco.stats.dependent reads the
requests in send order): always a latency some request really had, no interpolation, no histogram
buckets. A request that failed, was shed (503), timed out, was never sent (generator over
max_inflight) or was still unanswered when the window drained counts as +inf, so dropping slow
requests can never improve a figure. A quantile n cannot support is None ("n/a (n=...)"), never the max.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from reco.loadtest.outcome import QUANTILES
from reco.stats import Estimate
from reco.stats.dependent import dependent_quantile_ci


@dataclass
class Latencies:
    """One load test's requests in the measured window.

    start_s:    [N] float64 send (open loop: scheduled) time, s after the test start
    latency_ms: [N] float64 (NaN for requests the generator could not send)
    ok:         [N] bool
    status:     [N] int64 HTTP status (0: no response, -1: not sent)
    """

    start_s: np.ndarray
    latency_ms: np.ndarray
    ok: np.ndarray
    status: np.ndarray

    def __len__(self) -> int:
        return len(self.ok)

    @property
    def ok_ms(self) -> np.ndarray:
        return self.latency_ms[self.ok]

    def window_ms(self, unanswered: int = 0) -> np.ndarray:
        """[N + unanswered] every request of the window in send order: successes' latency, +inf for the
        rest (the unanswered last: they were sent last).

        unanswered: requests sent in the window that had no answer when the generator stopped (they are
        in no row of the file).
        """
        order = np.argsort(self.start_s, kind="stable")  # time order: the interval reads the dependence
        lat = np.where(self.ok, self.latency_ms, np.inf)[order]
        return np.concatenate([lat, np.full(int(unanswered), np.inf)])


def read_latencies(path: str | Path) -> Latencies:
    """The CSV written by loadtest/locustfile.py: header `start_s,latency_ms,ok,status`."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: latency file missing (the load generator did not finish)")
    with open(p) as f:
        header = f.readline().strip()
    if header != "start_s,latency_ms,ok,status":
        raise ValueError(f"{p}: expected header 'start_s,latency_ms,ok,status', got {header!r}")
    a = np.loadtxt(p, delimiter=",", skiprows=1, ndmin=2)
    if a.size == 0:
        a = np.zeros((0, 4))
    return Latencies(a[:, 0], a[:, 1], a[:, 2] > 0, a[:, 3].astype(np.int64))


def quantiles(latency_ms: np.ndarray) -> dict[str, Estimate]:
    """{'p50': Estimate, ..., 'p999': Estimate} over `latency_ms` ([n] in send order, +inf = failed),
    each interval one that holds for dependent requests (reco.stats.dependent)."""
    return {name: dependent_quantile_ci([latency_ms], q) for name, q in QUANTILES.items()}


def plot_cdf(curves: dict[str, np.ndarray], out: str | Path, title: str = "Latency CDF") -> Path:
    """Empirical CDF per curve (label -> latencies ms, +inf = failed), log-x, with the p50/p99 marked.

    The y axis counts every request, failures included, so a curve that ends below 1 shows the failed share.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, lat in curves.items():
        x = np.sort(lat[np.isfinite(lat)])
        if len(x) == 0:
            continue
        y = np.arange(1, len(x) + 1) / len(lat)
        p = quantiles(lat)
        ax.step(x, y, where="post", label=f"{label}: p50 {p['p50'].fmt('.2f')}, p99 {p['p99'].fmt('.2f')}")
        for q in ("p50", "p99"):
            if p[q].value is not None and np.isfinite(p[q].value):
                ax.axvline(p[q].value, color=ax.lines[-1].get_color(), ls=":", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("end-to-end latency (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.0)
    ax.grid(alpha=0.3, which="both")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
