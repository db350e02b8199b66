"""Exact latency percentiles from the load generator's per-request file, and the latency CDF plot.

Percentiles are nearest-rank over every successful request of the measured window: p is the smallest
recorded latency with at least p % of the requests at or below it -- always a latency that some request
really had, no interpolation and no histogram buckets.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

PERCENTILES = {"p50": 50.0, "p90": 90.0, "p95": 95.0, "p99": 99.0, "p999": 99.9}


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


def percentiles(latency_ms: np.ndarray) -> dict[str, float]:
    """{'p50': ..., 'p999': ...} nearest-rank (numpy 'inverted_cdf'); NaN when there is no sample."""
    if len(latency_ms) == 0:
        return {k: float("nan") for k in PERCENTILES}
    vals = np.percentile(latency_ms, list(PERCENTILES.values()), method="inverted_cdf")
    return {k: float(v) for k, v in zip(PERCENTILES, vals, strict=True)}


def plot_cdf(curves: dict[str, np.ndarray], out: str | Path, title: str = "Latency CDF") -> Path:
    """Empirical CDF per curve (label -> latencies ms), log-x, with the p50/p99 marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, lat in curves.items():
        x = np.sort(lat[np.isfinite(lat)])
        if len(x) == 0:
            continue
        y = np.arange(1, len(x) + 1) / len(x)
        p = percentiles(x)
        ax.step(
            x, y, where="post", label=f"{label} (p50 {p['p50']:.2f} ms, p99 {p['p99']:.2f} ms, n={len(x)})"
        )
        for q in ("p50", "p99"):
            ax.axvline(p[q], color=ax.lines[-1].get_color(), ls=":", lw=0.8)
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
