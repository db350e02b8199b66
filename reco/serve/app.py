"""The /recommend service (Starlette on uvicorn): features -> candidates -> rank -> top-k.

Plain Starlette rather than FastAPI: the body is parsed once with orjson and validated by one msgspec
model (reco.serve.request), which keeps the per-request overhead to microseconds and lets every 4xx name
the exact field; the same model is the request schema of GET /openapi.json (reco.serve.openapi).

Order of work for one request, cheapest refusals first:
    415 wrong Content-Type -> body read (413 too large, 408 not in body_timeout_s) -> admission (503
    older than max_wait_ms, or beyond queue_limit) -> parse (400 / 422) -> [max_wait_ms, unbatched: the
    work gate, 503 once older than max_wait_ms while waiting for its turn] -> retrieval, features ->
    model (max_wait_ms, batched: 503 if older than max_wait_ms when its batch is formed; 504 beyond
    model_timeout_s; 503 if the batcher died) -> top-k -> JSON.
The model call runs on a rank thread (reco/serve/rank_threads.py), so the event loop keeps reading
requests meanwhile; serve.rank_threads=0 makes it on the event loop's own thread (InlineRanker: no
hand-off, but no 504 either, as nothing can cut the call short).
The body is read before the request counts against queue_limit, so clients trickling their bodies
cannot hold the admission slots. Anything unexpected is a 500 with a generic body and one log line.

What a request's age covers (serve.max_wait_ms, reco/serve/admission.py): with an X-Request-Start header,
everything since that stamp -- the client's or proxy's own delay, the network, the accept backlog and
the event loop before the handler ran, the body read, and at the later check (unbatched: its turn at
the work gate; batched: its batch being formed) the wait up to there. Without the header (or with a
malformed one) only the in-server part counts, from handler entry. A request whose work has started is
never cut short: past the gate it is served (it waits for at most rank_threads calls). Shed requests
are answered 503 + Retry-After without a model call and counted in reco_shed_total{reason}.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np
import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from reco.serve.admission import REQUEST_START, Overdue, ShedReason, WorkGate, request_age_s
from reco.serve.auth import RequireSecret, check_expected_digest, shared_secret
from reco.serve.batcher import (
    BatcherFailed,
    DirectRanker,
    DynamicBatcher,
    InlineRanker,
    Scored,
    arrival_window,
)
from reco.serve.config import FeatureSource, ServeConfig
from reco.serve.connection import error_body
from reco.serve.faults import slowed
from reco.serve.features import Block, BlockPool
from reco.serve.metrics import STAGES, ServeMetrics
from reco.serve.openapi import openapi_schema
from reco.serve.rank_threads import RankThreads
from reco.serve.recommend import candidate_items, load_variant, response_body, top_k
from reco.serve.redis_features import FeatureReadError, RedisFeatures
from reco.serve.request import Request, RequestError, check_content_type, read_body, request_schema

log = logging.getLogger("reco.serve")
RANK_THREAD = (
    "rank"  # the model-calling threads' name prefix (reco.serve.server.pin_threads finds them by it)
)

CLOSE = {"Connection": "close"}  # the rest of the body was not read: do not reuse the connection


@dataclass(slots=True)
class Clock:
    """One request's stage boundaries: wall time (perf_counter) and the event loop thread's CPU time
    (thread_time), at handler entry (0), after parsing (1) and at its turn at the gate (1g)."""

    t0: float
    c0: float
    t1: float = 0.0
    c1: float = 0.0
    t1g: float = 0.0
    c1g: float = 0.0


def _json(obj: object, status: int = 200, headers: dict | None = None) -> Response:
    return Response(orjson.dumps(obj), status, headers, media_type="application/json")


def _error(status: int, field: str, message: str, headers: dict | None = None) -> Response:
    # One error body for the whole service: the connection layer's refusals write the same bytes.
    return Response(error_body(field, message), status, headers, media_type="application/json")


def _internal_error(where: str, e: BaseException) -> Response:
    # One line, no traceback, no exception text to the client: a request must not be able to fill the
    # log or learn about the internals.
    log.error("%s failed: %s: %.200s", where, type(e).__name__, str(e).replace("\n", " "))
    return _error(500, "", "internal error (logged by the server)")


class RecoService:
    """One worker's state: feature store, scorer, ranker, metrics and admission counter."""

    def __init__(self, variant_dir: str, dataset_path: str, cfg: ServeConfig) -> None:
        """Load the variant and the dataset, build the feature store and warm the model up.

        Args:
            variant_dir: the variant directory (holds variant.json).
            dataset_path: the Dataset file whose train split feeds the feature store.
            cfg: the serve settings.
        """
        self.cfg = cfg
        loaded = load_variant(variant_dir, dataset_path, cfg)  # warmed up
        self.store, self.scorer, self.batching = loaded.store, loaded.scorer, loaded.batching
        self.name, self.backend = loaded.name, loaded.backend
        self.online = (
            RedisFeatures(self.store, loaded.data_fingerprint, cfg.redis)
            if cfg.features == FeatureSource.redis
            else None
        )
        self.request_schema = request_schema(
            self.store, cfg.max_k, cfg.max_candidates
        )  # once, not per request
        self.retry_after = str(cfg.retry_after_s)
        self.max_wait_s = math.inf if cfg.max_wait_ms is None else cfg.max_wait_ms / 1000.0
        # With max_wait_ms and no batcher, requests wait for their turn at the gate, before retrieval and
        # features, so one that runs out of time there is shed before any work; rank_threads + 1 inside
        # keeps one request preparing its block while each thread scores. The batcher is its own queue
        # (checked when a batch is formed). Without max_wait_ms nothing changes.
        self.gate = (
            WorkGate(cfg.rank_threads + 1)
            if cfg.max_wait_ms is not None and not self.batching.enabled
            else None
        )
        # rank_threads = 0: the event loop calls the model itself (InlineRanker; config.check refuses it
        # with batching or model_cpu_affinity)
        self.executor = (
            RankThreads(
                cfg.rank_threads,
                RANK_THREAD,
                initializer=pin_model_thread,
                initargs=(cfg.model_cpu_affinity,),
            )
            if cfg.rank_threads
            else None
        )
        scorer = slowed(self.scorer, cfg.faults)
        if self.executor is None:
            self.ranker: DirectRanker | DynamicBatcher = InlineRanker(scorer)
        elif self.batching.enabled:
            self.ranker = DynamicBatcher(
                scorer,
                self.executor,
                self.batching.max_batch,
                self.batching.max_queue_delay_ms,
                crash_batches=cfg.faults.batcher_crashes,
                window=arrival_window(self.batching),
            )
        else:
            self.ranker = DirectRanker(scorer, self.executor)
        self.metrics = ServeMetrics()
        self.cpu = self.metrics.loop_cpu
        # rank_threads calls running + as many blocks waiting for them: what a steady load holds at once
        self.pool = BlockPool(self.store, cfg.n_candidates, keep=2 * cfg.rank_threads + 2)
        self.inflight = 0
        self.inflight_max = 0

    async def recommend(self, request: HttpRequest) -> Response:
        """POST /recommend (see the module docstring for the order of checks)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            check_content_type(request.headers.get("content-type"))
            body = await read_body(request, self.cfg.max_body_bytes, self.cfg.body_timeout_s)
        except RequestError as e:
            resp = _error(e.status, e.field, e.message, CLOSE if e.status in (408, 413) else None)
            return self._count(resp)
        except ClientDisconnect:  # nobody is left to read an answer
            return self._count(_error(400, "body", "body: client disconnected before sending it all"))
        now = time.perf_counter()
        age = 0.0
        if self.cfg.max_wait_ms is not None:
            age, ignored = request_age_s(
                request.headers.get(REQUEST_START),
                t0,
                now,
                self.cfg.request_start_max_age_s,
                self.cfg.request_start_max_ahead_s,
            )
            if ignored is not None:
                self.metrics.stamp_ignored.labels(reason=ignored.value).inc()
        if age > self.max_wait_s:
            msg = f"server overloaded: request waited {age * 1000:.0f} ms (max_wait_ms {self.cfg.max_wait_ms:g})"
            return self._count(self._shed(ShedReason.age_at_admission, msg))
        if self.inflight >= self.cfg.queue_limit:
            msg = (
                f"server overloaded: {self.inflight} requests in flight (queue_limit {self.cfg.queue_limit})"
            )
            return self._count(self._shed(ShedReason.queue_limit, msg))
        deadline = now - age + self.max_wait_s  # perf_counter time its model call must start by
        self.inflight += 1
        self.inflight_max = max(self.inflight_max, self.inflight)
        self.metrics.inflight.inc()
        self.metrics.inflight_max.set(self.inflight_max)
        try:
            resp = await self._recommend(body, Clock(t0, c0), deadline)
        except Overdue:
            resp = self._shed(
                ShedReason.wait_before_model,
                f"server overloaded: request waited over max_wait_ms {self.cfg.max_wait_ms:g} before its "
                "model call could start",
            )
        except RequestError as e:
            resp = _error(
                e.status, e.field, e.message, {"Retry-After": self.retry_after} if e.status == 503 else None
            )
        except Exception as e:  # a bug must cost one request, never the server
            resp = _internal_error("recommend", e)
        finally:
            self.inflight -= 1
            self.metrics.inflight.dec()
        return self._count(resp)

    def _count(self, resp: Response) -> Response:
        self.metrics.answered(resp.status_code)
        return resp

    def _shed(self, reason: ShedReason, message: str) -> Response:
        """503 + Retry-After for a request refused before any model call (counted by reason)."""
        self.metrics.shed.labels(reason=reason.value).inc()
        return _error(503, "", message, {"Retry-After": self.retry_after})

    async def _recommend(self, body: bytes, clock: Clock, deadline: float) -> Response:
        req = self.request_schema.parse(body)
        clock.t1 = clock.t1g = time.perf_counter()
        clock.c1 = clock.c1g = time.thread_time()
        if self.gate is None:
            return await self._rank(req, clock, deadline)
        await self.gate.enter(deadline)  # Overdue: its turn did not come before its deadline
        try:
            # Its turn came in time: it is served. Past the gate the wait is bounded (at most rank_threads
            # calls ahead of it), and shedding it there would throw away the work it has done: under
            # a standing queue every request passes the gate near its deadline, so that would be most.
            clock.t1g, clock.c1g = time.perf_counter(), time.thread_time()
            return await self._rank(req, clock, math.inf)
        finally:
            self.gate.leave()

    async def _rank(self, req: Request, clock: Clock, deadline: float) -> Response:
        """Retrieval -> features -> model -> top-k -> JSON for a parsed request (parsed at clock.t1, its
        turn at the gate at clock.t1g)."""
        cfg = self.cfg
        urow = self.store.user_row(req.user_id)
        cpu = self.cpu
        if self.store.retriever is not None and req.candidates is None and self.executor is not None:
            # A user-tower forward and an index search: CPU work, so on the model's threads, never on
            # the event loop, where it would hold up every other request's I/O meanwhile (unless
            # rank_threads=0 put the model there too).
            loop = asyncio.get_running_loop()
            items = await loop.run_in_executor(self.executor, self.store.candidates, urow, cfg.n_candidates)
        else:
            items = candidate_items(self.store, urow, req, cfg.n_candidates)
            cpu["retrieval"].observe(time.thread_time() - clock.c1g)
        t2 = time.perf_counter()
        bufs = self.pool.take() if self.online is None and len(items) <= self.pool.rows else None
        block = await self._features(req, urow, items, t2, bufs)
        if isinstance(block, Response):
            return block
        t3 = time.perf_counter()
        scored = await self._score(block, deadline) if len(items) else None
        if bufs is not None:  # not after an exception: a timed-out call may still be reading them
            self.pool.give(bufs)
        probs, rank_s = (scored.probs, scored.rank_s) if scored else (np.empty(0, dtype=np.float32), 0.0)
        t4, c4 = time.perf_counter(), time.thread_time()
        ids, scores = top_k(self.name, items, probs, req.k)
        t5 = time.perf_counter()
        payload = response_body(self.name, ids, scores)
        t6 = time.perf_counter()
        times = {
            "parse": clock.t1 - clock.t0,
            "retrieval": t2 - clock.t1g,
            "features": t3 - t2,
            "queue": (clock.t1g - clock.t1) + (t4 - t3) - rank_s,  # at the gate + for the model
            "rank": rank_s + (t5 - t4),
            "serialize": t6 - t5,
            "total": t6 - clock.t0,
        }
        self.metrics.observe(times)
        timing = ", ".join(f"{s};dur={times[s] * 1000:.3f}" for s in STAGES)
        if scored is not None:
            timing += f", rank_cpu;dur={scored.rank_cpu_s * 1000:.3f}"
        cpu["parse"].observe(clock.c1 - clock.c0)
        cpu["serialize"].observe(time.thread_time() - c4)  # top-k, the body, the stage metrics, the header
        return Response(payload, 200, {"Server-Timing": timing}, media_type="application/json")

    async def _features(
        self, req: Request, urow: int, items: np.ndarray, t2: float, bufs: Block | None
    ) -> tuple[np.ndarray, ...] | Response:
        """The model input for `items` (dense, ids, mask; in `bufs` when given), or the error answer of a
        failed feature read."""
        if self.online is None:
            c = time.thread_time()
            block = self.store.assemble(urow, req, items, bufs)
        else:
            try:
                user, rows = await self.online.fetch(req.user_id, items)
            except FeatureReadError as e:
                took = time.perf_counter() - t2
                self.metrics.stage.labels(stage="features").observe(took)
                headers = {"Server-Timing": f"features;dur={took * 1000:.3f}"}
                if e.status == 503:
                    headers["Retry-After"] = self.retry_after
                return _error(e.status, "features", e.message, headers)
            c = time.thread_time()  # the assembly only: the read's wait runs other requests meanwhile
            block = self.store.assemble_rows(user, req, rows)
        self.cpu["features"].observe(time.thread_time() - c)
        return block

    async def _score(self, block: tuple[np.ndarray, ...], deadline: float) -> Scored:
        """The model call for one block (ranker: direct or batched), its CPU and batch figures recorded."""
        cfg = self.cfg
        try:
            # asyncio.timeout, not wait_for: wait_for (3.11) adds a waiter future and one more pass of the
            # event loop between the call's result and this handler
            async with asyncio.timeout(cfg.model_timeout_s):
                scored = await self.ranker.score(*block, deadline)
        except TimeoutError:
            raise RequestError(
                504, "", f"model call not finished within serve.model_timeout_s={cfg.model_timeout_s:g} s"
            ) from None
        except BatcherFailed as e:
            raise RequestError(503, "", str(e)) from None
        self.metrics.rank_cpu.observe(scored.rank_cpu_s)
        self.metrics.model_cpu.inc(scored.rank_cpu_s * len(scored.probs) / max(scored.batch_rows, 1))
        if scored.reports_batch:
            self.metrics.batch_rows.observe(scored.batch_rows)
            self.metrics.batch_requests.observe(scored.batch_requests)
        return scored

    async def healthz(self, request: HttpRequest) -> Response:
        """GET /healthz: liveness, the model, this worker's pid and admission figures."""
        return _json(
            {
                "status": "ok",
                "model": self.name,
                "backend": self.backend,
                "pid": os.getpid(),
                "batching": asdict(self.batching),
                "batcher_restarts": self.ranker.restarts,
                "retrieval": self.store.retrieval_name,
                "features": self.cfg.features.value,
                # redis: what the last sample check found missing (requests are 503 meanwhile), else null
                "features_lost": None if self.online is None else self.online.lost,
                "n_users": int(self.store.users.cold),
                "n_items": int(self.store.items.cold),
                "n_candidates": self.cfg.n_candidates,
                "inflight": self.inflight,
                "inflight_max": self.inflight_max,
            }
        )

    async def metrics_endpoint(self, request: HttpRequest) -> Response:
        """GET /metrics: Prometheus text (all workers' when there are several)."""
        body, ctype = self.metrics.render()
        return Response(body, 200, media_type=ctype)

    async def openapi(self, request: HttpRequest) -> Response:
        """GET /openapi.json."""
        return _json(openapi_schema(self.store, self.cfg, self.name))


class GuardErrors:
    """ASGI middleware: an exception escaping a route is a generic 500 and one log line.

    Starlette's own error middleware answers 500 but re-raises, and uvicorn then logs a stack trace
    for every such request.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracking(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracking)
        except Exception as e:
            resp = _internal_error(f"{scope.get('method')} {scope.get('path')}", e)
            if not started:
                await resp(scope, receive, send)


class RecommendRoute:
    """ASGI middleware: POST /recommend straight to its handler, past Starlette's router, exception
    middleware and endpoint wrapper (per-request Python work on the model's core: bench.overhead
    measures it); every other request goes through them as before (GET /recommend: 405 from the router).
    """

    def __init__(self, app: ASGIApp, handler) -> None:
        self.app, self.handler = app, handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/recommend" and scope["method"] == "POST":
            resp = await self.handler(HttpRequest(scope, receive))
            await resp(scope, receive, send)
            return
        await self.app(scope, receive, send)


def create_app(variant_dir: str, dataset_path: str, cfg: ServeConfig) -> Starlette:
    """The Starlette app serving one variant (model loaded and warmed up before this returns).

    Args:
        variant_dir: the variant directory.
        dataset_path: the Dataset file for the feature store.
        cfg: the serve settings.
    Returns:
        The app; `app.state.service` is its RecoService.
    """
    check_expected_digest(variant_dir, cfg)
    secret = shared_secret(cfg)  # before the model loads: a missing secret stops the server at once
    svc = RecoService(variant_dir, dataset_path, cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        await svc.ranker.start()
        if svc.online is not None:
            svc.online.start()
        yield
        await svc.ranker.stop()
        if svc.online is not None:
            await svc.online.close()
        if svc.executor is not None:
            svc.executor.shutdown(wait=False, cancel_futures=True)

    async def http_error(request: HttpRequest, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return _error(exc.status_code, "", f"{request.method} {request.url.path}: {exc.detail}", exc.headers)

    app = Starlette(
        routes=[
            Route("/recommend", svc.recommend, methods=["POST"]),
            Route("/healthz", svc.healthz, methods=["GET"]),
            Route("/metrics", svc.metrics_endpoint, methods=["GET"]),
            Route("/openapi.json", svc.openapi, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error},
        lifespan=lifespan,
    )
    # No trailing-slash redirect: Starlette builds its Location from the Host header, so
    # `POST /recommend/` with `Host: evil.example` answered 307 to http://evil.example/recommend.
    app.router.redirect_slashes = False
    app.add_middleware(RecommendRoute, handler=svc.recommend)  # innermost: behind the secret's check
    if secret is not None:
        app.add_middleware(RequireSecret, secret=secret)
    app.add_middleware(GuardErrors)
    app.state.service = svc
    return app


def pin_model_thread(cpus: list[int] | None) -> None:
    """A rank thread's start: onto serve.model_cpu_affinity (threads it starts, e.g. torch's intra-op
    pool, inherit it); None leaves it where the event loop is."""
    if cpus:
        os.sched_setaffinity(threading.get_native_id(), cpus)
