"""Prometheus metrics of the service, and the parser the load tester uses to read them back.

reco_stage_seconds{stage}: histogram of each request stage (the same stages as the Server-Timing
header). Buckets grow by 20 % from 10 us to ~60 s, so a p99 interpolated from two scrapes is within
~10 % of the exact value (the load generator measures the exact end-to-end percentiles itself).

With several worker processes prometheus_client's multiprocess mode is used: PROMETHEUS_MULTIPROC_DIR
must be set before prometheus_client is first imported (reco.serve.workers does it), and /metrics then
aggregates all workers.
"""

from __future__ import annotations

import os

import numpy as np

from reco.serve.admission import ShedReason

STAGES = ("parse", "retrieval", "features", "queue", "rank", "serialize", "total")
BUCKETS = tuple(float(b) for b in 1e-5 * 1.2 ** np.arange(0, 85)) + (float("inf"),)


class ServeMetrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        # In multiprocess mode metrics live in the default registry's files; a fresh registry per app
        # otherwise, so tests can build several apps in one process.
        reg = None if self.multiprocess else CollectorRegistry()
        kw = {"registry": reg} if reg is not None else {}
        self.registry = reg
        self.stage = Histogram(
            "reco_stage_seconds", "Time per request stage", ["stage"], buckets=BUCKETS, **kw
        )
        self._stage = {s: self.stage.labels(stage=s) for s in STAGES}
        # CPU time of the model call's thread (the whole call when intra_op_threads = 1): beside the rank
        # stage's wall time it tells a slower CPU (both grow) from waiting for one (only the wall grows).
        self.cpu = Histogram(
            "reco_cpu_seconds", "CPU time of a stage's thread", ["stage"], buckets=BUCKETS, **kw
        )
        self.rank_cpu = self.cpu.labels(stage="rank")
        self.requests = Counter("reco_requests", "Requests answered, by HTTP status", ["status"], **kw)
        self.shed = Counter(
            "reco_shed", "Requests shed (503 + Retry-After, no model call), by reason", ["reason"], **kw
        )
        for reason in ShedReason:  # every reason exported from the start, at 0
            self.shed.labels(reason=reason.value)
        self.batch_rows = Histogram(
            "reco_batch_rows",
            "Candidate rows per model call",
            buckets=(1, 10, 50, 100, 250, 500, 1000, 2000, 4000, 8000, 16000, float("inf")),
            **kw,
        )
        self.batch_requests = Histogram(
            "reco_batch_requests",
            "Requests per model call",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64, float("inf")),
            **kw,
        )
        g = {"multiprocess_mode": "livesum"} if self.multiprocess else {}
        self.inflight = Gauge("reco_inflight", "Requests admitted and not yet answered", **g, **kw)
        gm = {"multiprocess_mode": "max"} if self.multiprocess else {}
        self.inflight_max = Gauge("reco_inflight_max", "Most requests admitted at once", **gm, **kw)

    def observe(self, times_s: dict[str, float]) -> None:
        """Record one request's stage times (seconds, keyed by STAGES)."""
        for s, t in times_s.items():
            self._stage[s].observe(t)

    def render(self) -> tuple[bytes, str]:
        """Returns: (Prometheus text of this worker, or of all workers in multiprocess mode, content type)."""
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

        if self.multiprocess:
            from prometheus_client import multiprocess

            reg = CollectorRegistry()
            multiprocess.MultiProcessCollector(reg)
            return generate_latest(reg), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


# Reading metrics back (load tester side) ------------------------------------------------------------


# The histograms a load run reads back, and the prefix of their summary keys: wall time per stage, and the
# CPU time of the model call's thread (reco_cpu_seconds{stage="rank"} -> cpu_rank_*).
FAMILIES = {"reco_stage_seconds": "server_", "reco_cpu_seconds": "cpu_"}


def parse_histograms(text: str) -> dict[str, dict[str, dict]]:
    """FAMILIES' histograms in a /metrics scrape, summed over workers, read in one pass.

    Args:
        text: Prometheus exposition text.
    Returns:
        {family: {stage: {"sum": s, "count": n, "le": [bounds], "cum": [cumulative counts]}}}.
    """
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, dict]] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name not in FAMILIES:
            continue
        by_stage = out.setdefault(fam.name, {})
        for s in fam.samples:
            st = by_stage.setdefault(s.labels.get("stage", ""), {"sum": 0.0, "count": 0.0, "buckets": {}})
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                st["buckets"][le] = st["buckets"].get(le, 0.0) + s.value
            elif s.name.endswith("_sum"):
                st["sum"] += s.value
            elif s.name.endswith("_count"):
                st["count"] += s.value
    for by_stage in out.values():
        for st in by_stage.values():
            b = st.pop("buckets")
            st["le"] = sorted(b)
            st["cum"] = [b[le] for le in st["le"]]
    return out


def parse_stage_histograms(text: str) -> dict[str, dict]:
    """The wall-time stage histograms of a scrape: parse_histograms(text)["reco_stage_seconds"]."""
    return parse_histograms(text).get("reco_stage_seconds", {})


def stage_summary(before: str, after: str, quantile: float = 0.99) -> dict[str, float]:
    """Per-stage mean and quantile (ms) of the requests served between two scrapes.

    Args:
        before: /metrics text scraped at the start of the window.
        after: /metrics text scraped at its end.
        quantile: the quantile to report (0.99 -> keys ..._p99_ms).
    Returns:
        server_{stage}_mean_ms, server_{stage}_p99_ms (wall time), cpu_rank_mean_ms, cpu_rank_p99_ms (CPU
        time of the model call's thread); quantiles interpolated inside their bucket.
    """
    a, b = parse_histograms(before), parse_histograms(after)
    out: dict[str, float] = {}
    for family, prefix in FAMILIES.items():
        for stage, hb in b.get(family, {}).items():
            empty = {"sum": 0.0, "count": 0.0, "le": hb["le"], "cum": [0.0] * len(hb["le"])}
            ha = a.get(family, {}).get(stage, empty)
            n = hb["count"] - ha["count"]
            if n <= 0:
                continue
            out[f"{prefix}{stage}_mean_ms"] = (hb["sum"] - ha["sum"]) / n * 1000
            cum = np.array(hb["cum"]) - np.array(ha["cum"])
            q = _bucket_quantile(np.array(hb["le"]), cum, quantile)
            out[f"{prefix}{stage}_p{round(quantile * 100)}_ms"] = q * 1000
    return out


def _bucket_quantile(les: np.ndarray, cum: np.ndarray, q: float) -> float:
    """Quantile of a cumulative histogram, linear inside the bucket (Prometheus histogram_quantile)."""
    total = cum[-1]
    rank = q * total
    i = int(np.searchsorted(cum, rank, side="left"))
    i = min(i, len(les) - 1)
    if np.isinf(les[i]):
        return float(les[i - 1]) if i > 0 else float("nan")
    lo_b = les[i - 1] if i > 0 else 0.0
    lo_c = cum[i - 1] if i > 0 else 0.0
    width = cum[i] - lo_c
    frac = (rank - lo_c) / width if width > 0 else 1.0
    return float(lo_b + (les[i] - lo_b) * frac)
