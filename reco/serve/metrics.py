"""Prometheus metrics of the service (the load tester reads them back with reco.loadtest.scrape).

reco_stage_seconds{stage}: histogram of each request stage (the same stages as the Server-Timing
header). Buckets grow by 20 % from 10 us to ~60 s, so a p99 interpolated from two scrapes is within
~10 % of the exact value (the load generator measures the exact end-to-end percentiles itself).

With several worker processes prometheus_client's multiprocess mode is used: PROMETHEUS_MULTIPROC_DIR
must be set before prometheus_client is first imported (reco.serve.workers does it), and /metrics then
aggregates all workers.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from reco.serve.admission import ShedReason, StampIgnored
from reco.serve.connection import REFUSED_REASONS

STAGES = ("parse", "retrieval", "features", "queue", "rank", "serialize", "total")
# reco_cpu_seconds{stage} of the event loop thread; serialize = top-k, the body, the stage metrics, the
# Server-Timing header
LOOP_CPU_STAGES = ("parse", "retrieval", "features", "serialize")
BUCKETS = tuple(float(b) for b in 1e-5 * 1.2 ** np.arange(0, 85)) + (float("inf"),)


class ServeMetrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        from reco.serve.histogram import BisectHistogram

        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        # In multiprocess mode metrics live in the default registry's files; a fresh registry per app
        # otherwise, so tests can build several apps in one process.
        reg = None if self.multiprocess else CollectorRegistry()
        kw = {"registry": reg} if reg is not None else {}
        self.registry = reg
        self.stage = BisectHistogram(
            "reco_stage_seconds", "Time per request stage", ["stage"], buckets=BUCKETS, **kw
        )
        self._stage = {s: self.stage.labels(stage=s) for s in STAGES}
        # CPU time of the model call's thread (the whole call when intra_op_threads = 1): beside the rank
        # stage's wall time it tells a slower CPU (both grow) from waiting for one (only the wall grows).
        self.cpu = BisectHistogram(
            "reco_cpu_seconds", "CPU time of a stage's thread", ["stage"], buckets=BUCKETS, **kw
        )
        self.rank_cpu = self.cpu.labels(stage="rank")
        # The event loop thread's own CPU per stage (synchronous parts only: while a stage awaits, the
        # thread runs other requests), so a request's server CPU splits into the model call (rank), the
        # application's stages and the rest (HTTP, the ASGI layers, hand-offs): bench.overhead reads them.
        self.loop_cpu = {s: self.cpu.labels(stage=s) for s in LOOP_CPU_STAGES}
        # The model calls' CPU, each call's counted once: a batched call's CPU is split over its requests
        # by their candidate rows (its rank CPU observation is the whole call's, once per request), so
        # this over a window / the requests answered is the model's share of a request's server CPU.
        self.model_cpu = Counter(
            "reco_model_cpu_seconds", "CPU seconds of the model calls (each call once)", **kw
        )
        self.requests = Counter("reco_requests", "Requests answered, by HTTP status", ["status"], **kw)
        self._answered: dict[int, Any] = {}  # status -> its child: labels() validates and locks per call
        self.shed = Counter(
            "reco_shed", "Requests shed (503 + Retry-After, no model call), by reason", ["reason"], **kw
        )
        for reason in ShedReason:  # every reason exported from the start, at 0
            self.shed.labels(reason=reason.value)
        # Connections refused below the application (reco/serve/connection.py), and X-Request-Start
        # stamps not trusted (reco/serve/admission.py): an attack or a broken clock shows up here.
        self.http_refused = Counter(
            "reco_http_refused", "Connections refused below the application, by reason", ["reason"], **kw
        )
        for reason in REFUSED_REASONS:
            self.http_refused.labels(reason=reason)
        self.stamp_ignored = Counter(
            "reco_request_start_ignored",
            "X-Request-Start stamps ignored as implausible, by reason",
            ["reason"],
            **kw,
        )
        for reason in StampIgnored:
            self.stamp_ignored.labels(reason=reason.value)
        self.batch_rows = BisectHistogram(
            "reco_batch_rows",
            "Candidate rows per model call",
            buckets=(1, 10, 50, 100, 250, 500, 1000, 2000, 4000, 8000, 16000, float("inf")),
            **kw,
        )
        self.batch_requests = BisectHistogram(
            "reco_batch_requests",
            "Requests per model call",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64, float("inf")),
            **kw,
        )
        g = {"multiprocess_mode": "livesum"} if self.multiprocess else {}
        self.inflight = Gauge("reco_inflight", "Requests admitted and not yet answered", **g, **kw)
        gm = {"multiprocess_mode": "max"} if self.multiprocess else {}
        self.inflight_max = Gauge("reco_inflight_max", "Most requests admitted at once", **gm, **kw)
        # This worker's CPU seconds (every thread: event loop, rank threads, batcher), summed over workers:
        # what the hardware bill sees. A gauge set after each request and at each scrape rather than
        # prometheus_client's ProcessCollector, which multiprocess mode does not aggregate.
        self.process_cpu = Gauge(
            "reco_process_cpu_seconds", "CPU seconds used by the server's workers", **g, **kw
        )
        self.process_cpu.set(time.process_time())

    def count_refused(self, reason: str) -> None:
        """One connection-level refusal (reco/serve/connection.py REFUSED_REASONS)."""
        self.http_refused.labels(reason=reason).inc()

    def answered(self, status: int) -> None:
        """One request answered with HTTP `status` (reco_requests_total{status})."""
        child = self._answered.get(status)
        if child is None:
            child = self._answered[status] = self.requests.labels(status=str(status))
        child.inc()

    def observe(self, times_s: dict[str, float]) -> None:
        """Record one request's stage times (seconds, keyed by STAGES)."""
        for s, t in times_s.items():
            self._stage[s].observe(t)
        self.process_cpu.set(time.process_time())

    def render(self) -> tuple[bytes, str]:
        """Returns: (Prometheus text of this worker, or of all workers in multiprocess mode, content type)."""
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

        self.process_cpu.set(time.process_time())
        if self.multiprocess:
            from prometheus_client import multiprocess

            reg = CollectorRegistry()
            multiprocess.MultiProcessCollector(reg)
            return generate_latest(reg), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
