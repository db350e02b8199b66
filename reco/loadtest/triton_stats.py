"""Triton's own statistics of a model (GET /v2/models/<name>/stats) as a load test's server stage times.

Triton keeps cumulative per-request counts and nanosecond sums for each phase of a request (the KServe v2
statistics extension): queue (waiting for an instance, dynamic batcher included), compute_input,
compute_infer (here: the whole reco pipeline in the Python model, IPC with the stub included) and
compute_output; success is the request's whole time inside Triton. Two scrapes, at the window's start
and end, give the means over the window's requests in the keys reco's own server reports
(server_<stage>_mean_ms, reco.loadtest.scrape.stage_summary), so the report's stage breakdown shows either
server. Triton keeps no histograms here, so there are no p99s. Also: requests per model execution
(server_batch_requests_mean) and failed requests (server_failed_requests).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

PHASES = {  # Triton phase -> the stage key it is reported under
    "queue": "queue",
    "compute_input": "compute_input",
    "compute_infer": "compute_infer",
    "compute_output": "compute_output",
    "success": "total",
}


def scrape_stats(url: str, model: str, timeout_s: float = 5.0) -> str:
    """GET {url}/v2/models/{model}/stats as text; empty string when the server does not answer.

    Args:
        url: the server's base URL.
        model: the Triton model name.
        timeout_s: HTTP timeout.
    Returns:
        The JSON text.
    """
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/v2/models/{model}/stats", timeout=timeout_s) as r:
            return r.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return ""


def _model_stats(text: str) -> dict:
    stats = json.loads(text)["model_stats"]
    return stats[0] if stats else {}


def stats_summary(before: str, after: str) -> dict[str, float]:
    """Per-phase means (ms) of the requests Triton finished between two scrapes.

    Args:
        before: scrape_stats text at the window's start.
        after: scrape_stats text at its end.
    Returns:
        server_{queue,compute_input,compute_infer,compute_output,total}_mean_ms,
        server_batch_requests_mean, server_failed_requests ({} when a scrape is missing or unreadable).
    """
    try:
        a, b = _model_stats(before), _model_stats(after)
    except (ValueError, KeyError, IndexError, TypeError):
        return {}
    sa, sb = a.get("inference_stats", {}), b.get("inference_stats", {})
    out: dict[str, float] = {}
    for phase, stage in PHASES.items():
        pa, pb = sa.get(phase, {}), sb.get(phase, {})
        n = int(pb.get("count", 0)) - int(pa.get("count", 0))
        if n > 0:
            out[f"server_{stage}_mean_ms"] = (int(pb.get("ns", 0)) - int(pa.get("ns", 0))) / n / 1e6
    executions = int(b.get("execution_count", 0)) - int(a.get("execution_count", 0))
    if executions > 0:
        inferences = int(b.get("inference_count", 0)) - int(a.get("inference_count", 0))
        out["server_batch_requests_mean"] = inferences / executions
    if sb:
        failed = int(sb.get("fail", {}).get("count", 0)) - int(sa.get("fail", {}).get("count", 0))
        out["server_failed_requests"] = float(failed)
    return out
