"""The server's own figures over a load-test window: two scrapes (the window's open and close) and what
the requests served between them cost, per stage.

    text = scrape(url)                            # GET {url}/metrics ("" when the server does not answer)
    stage_summary(before, after)                  # {"server_rank_mean_ms": ..., "server_rank_p99_ms": ...}
    probe = ServerProbe(triton_model)             # reco's /metrics, or Triton's statistics when a model
    probe.stages(probe.read(url), probe.read(url))  # is named (reco.loadtest.triton_stats)

reco's server exports the reco_stage_seconds{stage} histogram (wall time per request stage) and
reco_cpu_seconds{stage} (CPU time of the model call's thread; the event loop thread's per stage), with
20 % wide buckets (reco.serve.metrics); a quantile is interpolated linearly inside its bucket from the
difference of the two scrapes' cumulative counts (Prometheus' histogram_quantile), so warm-up requests
are in neither.

The one reader of /metrics: the runner (reco.loadtest.window) scrapes at the window's edges, and
loadtest/locustfile.py's web UI ("reco" tab) at the test's start and on each poll. Standard library and
numpy at import (prometheus_client's parser is imported on first parse), so a Locust process pays little.
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass

import numpy as np

from reco.loadtest.triton_stats import scrape_stats, stats_summary

# The histograms a load run reads back, and the prefix of their summary keys: wall time per stage, and the
# CPU time of the model call's thread (reco_cpu_seconds{stage="rank"} -> cpu_rank_*).
FAMILIES = {"reco_stage_seconds": "server_", "reco_cpu_seconds": "cpu_"}


def scrape(url: str, timeout_s: float = 5.0) -> str:
    """GET {url}/metrics as text; empty string when the server does not answer (any OSError: refused,
    reset, timed out, an HTTP error status), so a missing scrape leaves the stages out, never the run."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout_s) as r:
            return r.read().decode()
    except OSError:
        return ""


# The counters stage_summary reads beside the histograms: family -> its sample that Scrape.scalars sums
SCALARS = {
    "reco_process_cpu_seconds": "reco_process_cpu_seconds",
    "reco_model_cpu_seconds": "reco_model_cpu_seconds_total",
}


@dataclass(frozen=True)
class Scrape:
    histograms: dict[str, dict[str, dict]]  # parse_histograms' result
    scalars: dict[str, float]  # SCALARS' families present in the scrape, each summed over workers


def parse_scrape(text: str) -> Scrape:
    """One pass of prometheus_client's parser over a scrape: FAMILIES' histograms and SCALARS' sums. Its
    ~1,200 lines cost ~50 ms of the runner's CPU a pass (most of them histogram buckets), and a window
    reads two scrapes, so each is parsed once, not once per figure."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, dict]] = {}
    scalars: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name in SCALARS:
            scalars[fam.name] = float(sum(s.value for s in fam.samples if s.name == SCALARS[fam.name]))
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
    return Scrape(out, scalars)


def parse_histograms(text: str) -> dict[str, dict[str, dict]]:
    """FAMILIES' histograms in a /metrics scrape, summed over workers, read in one pass.

    Args:
        text: Prometheus exposition text.
    Returns:
        {family: {stage: {"sum": s, "count": n, "le": [bounds], "cum": [cumulative counts]}}}.
    """
    return parse_scrape(text).histograms


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
        time of the model call's thread); quantiles interpolated inside their bucket; cpu_per_request_ms,
        the server processes' CPU (every thread) per answered request, and its split
        (cpu_per_request_<model|parse|retrieval|features|serialize|rest>_ms, cpu_split).
    """
    pa, pb = parse_scrape(before), parse_scrape(after)
    a, b = pa.histograms, pb.histograms
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

    def answered(h: dict) -> float:  # requests that reached the end of the handler
        return h.get("reco_stage_seconds", {}).get("total", {}).get("count", 0.0)

    served = answered(b) - answered(a)
    cpu_a, cpu_b = pa.scalars.get("reco_process_cpu_seconds"), pb.scalars.get("reco_process_cpu_seconds")
    if served > 0 and cpu_a is not None and cpu_b is not None and cpu_b >= cpu_a:
        out["cpu_per_request_ms"] = (cpu_b - cpu_a) / served * 1000
        model_a, model_b = pa.scalars.get("reco_model_cpu_seconds"), pb.scalars.get("reco_model_cpu_seconds")
        if model_a is not None and model_b is not None:
            out |= cpu_split(a, b, model_b - model_a, served, out)
    return out


def cpu_split(a: dict, b: dict, model_s: float, served: float, out: dict[str, float]) -> dict[str, float]:
    """The server CPU of a request split by stage: cpu_per_request_<part>_ms for the model calls (`model`,
    reco_model_cpu_seconds: each call once), the event loop's stages (LOOP_CPU_STAGES) and `rest` = the
    process's CPU per request (out["cpu_per_request_ms"]) - those; {} when the server exports no split (an
    older server, or nothing between the scrapes).

    Args:
        a, b: parse_histograms of the scrapes at the window's open and close.
        model_s: model CPU seconds between them.
        served: requests answered between them.
    """
    # here, not at the top: the Locust workers import this module and need none of the server's
    from reco.serve.metrics import LOOP_CPU_STAGES

    ha, hb = a.get("reco_cpu_seconds", {}), b.get("reco_cpu_seconds", {})
    if not all(s in hb for s in LOOP_CPU_STAGES):
        return {}
    parts = {"model": model_s} | {s: hb[s]["sum"] - ha.get(s, {"sum": 0.0})["sum"] for s in LOOP_CPU_STAGES}
    split = {f"cpu_per_request_{k}_ms": v / served * 1000 for k, v in parts.items()}
    split["cpu_per_request_rest_ms"] = out["cpu_per_request_ms"] - sum(split.values())
    return split


def process_cpu_s(text: str) -> float | None:
    """reco_process_cpu_seconds in a scrape (summed over workers); None when absent."""
    return parse_scrape(text).scalars.get("reco_process_cpu_seconds")


def model_cpu_s(text: str) -> float | None:
    """reco_model_cpu_seconds in a scrape (summed over workers); None when absent (an older server)."""
    return parse_scrape(text).scalars.get("reco_model_cpu_seconds")


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


@dataclass(frozen=True)
class ServerProbe:
    """Where a window's server figures come from: reco's /metrics, or, for a Triton server, the named
    model's statistics (Triton keeps no histograms there: means only, reco.loadtest.triton_stats)."""

    triton_model: str | None = None

    def read(self, url: str) -> str:
        """One scrape ("" when the server does not answer)."""
        return scrape_stats(url, model=self.triton_model) if self.triton_model else scrape(url)

    def stages(self, before: str, after: str) -> dict[str, float]:
        """The stage figures of the requests served between two scrapes ({} when either is missing)."""
        if not (before and after):
            return {}
        return stats_summary(before, after) if self.triton_model else stage_summary(before, after)
