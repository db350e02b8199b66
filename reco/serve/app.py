"""The /recommend HTTP app (Starlette on uvicorn): features -> candidates -> rank -> top-k.

Plain Starlette rather than FastAPI: the body is parsed once with orjson and validated by hand, which
keeps the per-request overhead to a few tens of microseconds and lets every 4xx name the exact field;
the OpenAPI schema is written out below and served at GET /openapi.json.

Request stages (Server-Timing header, ms, and Prometheus reco_stage_seconds{stage}):
    parse      body read, JSON decode, validation
    retrieval  feature-store user lookup and candidate generation (or the request's candidates)
    features   assembling the padded [N, F, L] model input
    queue      waiting for the model (executor / batcher queue, thread hand-offs)
    rank       the scorer call (the whole coalesced call under dynamic batching) + top-k
    serialize  building and encoding the JSON answer
    total      all of the above (parse .. serialize sum to it)

Errors: 400 invalid JSON or Content-Length, 413 body over max_body_bytes, 422 a field that is missing,
of the wrong type or out of range -- each body {"error": message, "field": name}. Candidate ids outside
the item table ([1, cardinality)) are a 422 naming them; ids inside it but never seen in training are
scored as cold-start items. Sparse context ids outside their table are the unknown id 0, as in training.
Overload: beyond `queue_limit` admitted requests the answer is an immediate 503 with Retry-After.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import Response
from starlette.routing import Route

from reco.data.schema import Dataset
from reco.serve.batcher import DirectRanker, DynamicBatcher
from reco.serve.features import FeatureStore, Request, ServeConfigError
from reco.serve.metrics import STAGES, ServeMetrics

log = logging.getLogger("reco.serve")

SPEC_ENV = "RECO_SERVE_SPEC"  # JSON {"variant", "dataset", "settings"} for worker processes
FIELDS = ("user_id", "context", "k", "candidates")


class RequestError(Exception):
    def __init__(self, status: int, field: str, message: str) -> None:
        super().__init__(message)
        self.status, self.field, self.message = status, field, message


def check_same_data(variant, data: Dataset, dataset_path: str) -> None:
    """A model trained on other data would index its tables out of range or score nonsense."""
    if variant.data_fingerprint and data.fingerprint and variant.data_fingerprint != data.fingerprint:
        raise ServeConfigError(
            f"--dataset {dataset_path}: data fingerprint {data.fingerprint} differs from the one variant "
            f"{variant.name!r} was built on ({variant.data_fingerprint}); pass that variant's dataset"
        )


def _json(obj: object, status: int = 200, headers: dict | None = None) -> Response:
    return Response(orjson.dumps(obj), status, headers, media_type="application/json")


def _error(status: int, field: str, message: str, headers: dict | None = None) -> Response:
    return _json({"error": message, "field": field}, status, headers)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_field(obj: dict, name: str) -> int:
    if name not in obj:
        raise RequestError(422, name, f"{name}: required field missing (expected an integer)")
    v = obj[name]
    if not _is_int(v):
        raise RequestError(422, name, f"{name}: expected an integer, got {type(v).__name__} {v!r:.40}")
    return v


def parse_request(body: bytes, store: FeatureStore, max_k: int, max_candidates: int) -> Request:
    """Decode and validate a /recommend body; raises RequestError naming the offending field."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise RequestError(400, "body", f"body: invalid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise RequestError(422, "body", f"body: expected a JSON object, got {type(obj).__name__}")
    for name in obj:
        if name not in FIELDS:
            raise RequestError(422, name, f"{name}: unknown field (expected {', '.join(FIELDS)})")
    user_id = _int_field(obj, "user_id")
    k = _int_field(obj, "k")
    if not 1 <= k <= max_k:
        raise RequestError(422, "k", f"k: expected 1 <= k <= {max_k}, got {k}")
    ctx_ids, ctx_mask, ctx_dense = _parse_context(obj.get("context"), store)
    cands = obj.get("candidates")
    if cands is not None:
        cands = _parse_candidates(cands, store, max_candidates)
    return Request(user_id, k, ctx_ids, ctx_mask, ctx_dense, cands)


def _parse_context(ctx: object, store: FeatureStore) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Context features by schema name -> ids [Fc, L], mask [Fc, L], dense [Dc]; missing -> unknown / 0."""
    ids = np.zeros((len(store.ctx_cols), store.L), dtype=np.int64)
    mask = np.zeros((len(store.ctx_cols), store.L), dtype=np.float32)
    mask[:, 0] = 1.0  # the unknown id 0, length 1
    dense = np.zeros(len(store.ctx_dense_cols), dtype=np.float32)
    if ctx is None:
        return ids, mask, dense
    if not isinstance(ctx, dict):
        raise RequestError(422, "context", f"context: expected an object, got {type(ctx).__name__}")
    for name, v in ctx.items():
        field = f"context.{name}"
        if name in store.ctx_sparse:
            j, f = store.ctx_sparse[name]
            vals = [v] if _is_int(v) else v
            if not isinstance(vals, list) or not all(_is_int(x) for x in vals) or len(vals) > f.max_len:
                raise RequestError(
                    422,
                    field,
                    f"{field}: expected an integer id or a list of at most {f.max_len}, got {v!r:.60}",
                )
            ids[j, : len(vals)] = [x if 0 <= x < f.cardinality else 0 for x in vals]
            mask[j] = 0.0
            mask[j, : len(vals)] = 1.0
        elif name in store.ctx_dense:
            if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
                raise RequestError(422, field, f"{field}: expected a finite number, got {v!r:.60}")
            dense[store.ctx_dense[name]] = v
        else:
            known = sorted([*store.ctx_sparse, *store.ctx_dense])
            raise RequestError(
                422, field, f"{field}: not a context feature of this model (expected one of {known})"
            )
    return ids, mask, dense


def _parse_candidates(cands: object, store: FeatureStore, max_candidates: int) -> np.ndarray:
    if not isinstance(cands, list) or not cands:
        raise RequestError(422, "candidates", "candidates: expected a non-empty list of item ids")
    if len(cands) > max_candidates:
        raise RequestError(
            422, "candidates", f"candidates: at most {max_candidates} item ids, got {len(cands)}"
        )
    for i, c in enumerate(cands):
        if not _is_int(c) or not -(2**63) <= c < 2**63:
            raise RequestError(
                422, f"candidates[{i}]", f"candidates[{i}]: expected an item id, got {c!r:.40}"
            )
    arr = np.array(list(dict.fromkeys(cands)), dtype=np.int64)  # duplicates scored once
    bad = store.check_items(arr)
    if len(bad):
        raise RequestError(
            422,
            "candidates",
            f"candidates: {len(bad)} unknown item id(s) {bad[:10].tolist()} "
            f"(expected ids in [1, {store.item_card}))",
        )
    return arr


class RecoService:
    """One worker's state: feature store, scorer, ranker, metrics and admission counter."""

    def __init__(self, variant_dir: str, dataset_path: str, settings: dict) -> None:
        from reco.runtime import load_scorer
        from reco.variant import Variant

        self.settings = settings
        need = _need(settings)
        variant = Variant.load(variant_dir)
        data = Dataset.load(str(dataset_path))
        check_same_data(variant, data, dataset_path)
        self.store = FeatureStore(data, need("retrieval"))
        del data
        self.name = variant.name
        self.backend = variant.backend
        self.scorer = load_scorer(variant, threads=int(need("intra_op_threads")))
        self.batching = {**need("batching"), **variant.runtime.get("batching", {})}
        self.n_candidates = int(need("n_candidates"))
        self.max_k, self.max_candidates = int(need("max_k")), int(need("max_candidates"))
        self.max_body = int(need("max_body_bytes"))
        self.queue_limit, self.retry_after = int(need("queue_limit")), str(need("retry_after_s"))
        self.warmup_calls = int(need("warmup_calls"))
        self.executor = ThreadPoolExecutor(int(need("rank_threads")), thread_name_prefix="rank")
        if self.batching.get("enabled"):
            self.ranker = DynamicBatcher(
                self.scorer, self.executor, self.batching["max_batch"], self.batching["max_queue_delay_ms"]
            )
        else:
            self.ranker = DirectRanker(self.scorer, self.executor)
        self.metrics = ServeMetrics()
        self.inflight = 0
        self.inflight_max = 0
        self._warm_up()

    def _warm_up(self) -> None:
        """First calls of a runtime allocate and pick kernels; do them before accepting traffic."""
        s = self.store
        req = parse_request(b'{"user_id": 0, "k": 1}', s, self.max_k, self.max_candidates)
        block = s.assemble(s.users.cold, req, s.candidates(s.users.cold, self.n_candidates))
        for _ in range(self.warmup_calls):
            self.scorer(*block)

    async def read_body(self, request: HttpRequest) -> bytes:
        cl = request.headers.get("content-length")
        if cl is not None:
            if not cl.isdigit():
                raise RequestError(400, "Content-Length", f"Content-Length: expected an integer, got {cl!r}")
            if int(cl) > self.max_body:
                raise RequestError(413, "body", f"body: {cl} bytes, at most {self.max_body} accepted")
            return await request.body()
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body:
                raise RequestError(413, "body", f"body: more than {self.max_body} bytes")
        return body

    async def recommend(self, request: HttpRequest) -> Response:
        t0 = time.perf_counter()
        if self.inflight >= self.queue_limit:
            self.metrics.requests.labels(status="503").inc()
            return _error(
                503,
                "",
                f"server overloaded: {self.inflight} requests in flight (queue_limit {self.queue_limit})",
                {"Retry-After": self.retry_after},
            )
        self.inflight += 1
        self.inflight_max = max(self.inflight_max, self.inflight)
        self.metrics.inflight.inc()
        self.metrics.inflight_max.set(self.inflight_max)
        try:
            resp = await self._recommend(request, t0)
        except RequestError as e:
            resp = _error(e.status, e.field, e.message)
        except ClientDisconnect:  # nobody is left to read an answer
            resp = _error(400, "body", "body: client disconnected before sending it all")
        except Exception as e:  # a bug must cost one request, never the server
            log.exception("recommend failed")
            resp = _error(500, "", f"internal error: {type(e).__name__}: {e}")
        finally:
            self.inflight -= 1
            self.metrics.inflight.dec()
        self.metrics.requests.labels(status=str(resp.status_code)).inc()
        return resp

    async def _recommend(self, request: HttpRequest, t0: float) -> Response:
        req = parse_request(await self.read_body(request), self.store, self.max_k, self.max_candidates)
        t1 = time.perf_counter()
        urow = self.store.user_row(req.user_id)
        items = (
            req.candidates if req.candidates is not None else self.store.candidates(urow, self.n_candidates)
        )
        t2 = time.perf_counter()
        block = self.store.assemble(urow, req, items)
        t3 = time.perf_counter()
        if len(items):
            scored = await self.ranker.score(*block)
            probs, rank_s = scored.probs, scored.rank_s
            if scored.reports_batch:
                self.metrics.batch_rows.observe(scored.batch_rows)
                self.metrics.batch_requests.observe(scored.batch_requests)
        else:
            probs, rank_s = np.empty(0, dtype=np.float32), 0.0
        t4 = time.perf_counter()
        k = min(req.k, len(items))
        top = np.argpartition(-probs, k - 1)[:k] if 0 < k < len(items) else np.arange(k)
        top = top[np.argsort(-probs[top], kind="stable")]
        t5 = time.perf_counter()
        payload = orjson.dumps(
            {
                "items": [
                    {"item_id": i, "score": p}
                    for i, p in zip(items[top].tolist(), probs[top].tolist(), strict=True)
                ],
                "model": self.name,
            }
        )
        t6 = time.perf_counter()
        times = {
            "parse": t1 - t0,
            "retrieval": t2 - t1,
            "features": t3 - t2,
            "queue": (t4 - t3) - rank_s,
            "rank": rank_s + (t5 - t4),
            "serialize": t6 - t5,
            "total": t6 - t0,
        }
        self.metrics.observe(times)
        timing = ", ".join(f"{s};dur={times[s] * 1000:.3f}" for s in STAGES)
        return Response(payload, 200, {"Server-Timing": timing}, media_type="application/json")

    async def healthz(self, request: HttpRequest) -> Response:
        return _json(
            {
                "status": "ok",
                "model": self.name,
                "backend": self.backend,
                "pid": os.getpid(),
                "batching": self.batching,
                "retrieval": self.store.retrieval_name,
                "n_users": int(self.store.users.cold),
                "n_items": int(self.store.items.cold),
                "n_candidates": self.n_candidates,
                "inflight": self.inflight,
                "inflight_max": self.inflight_max,
            }
        )

    async def metrics_endpoint(self, request: HttpRequest) -> Response:
        body, ctype = self.metrics.render()
        return Response(body, 200, media_type=ctype)

    async def openapi(self, request: HttpRequest) -> Response:
        return _json(openapi_schema(self))


def _need(settings: dict):
    def get(key: str):
        if key not in settings:
            raise ServeConfigError(
                f"serve.{key}: missing from the serve settings (see conf/serve/default.yaml)"
            )
        return settings[key]

    return get


def create_app(variant_dir: str, dataset_path: str, settings: dict) -> Starlette:
    svc = RecoService(variant_dir, dataset_path, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        await svc.ranker.start()
        yield
        await svc.ranker.stop()
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
    app.state.service = svc
    return app


def app_from_env() -> Starlette:
    """uvicorn factory for worker processes: the spec comes from $RECO_SERVE_SPEC."""
    spec = json.loads(os.environ[SPEC_ENV])
    return create_app(spec["variant"], spec["dataset"], spec["settings"])


def serve_worker(spec: str, host: str, port: int, options: dict) -> None:
    """One worker process: build the app (model loaded), then bind its own SO_REUSEPORT socket."""
    import uvicorn

    os.environ[SPEC_ENV] = spec
    app = app_from_env()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, **options)).run(sockets=[sock])


def openapi_schema(svc: RecoService) -> dict:
    s = svc.store
    ctx_props: dict[str, dict] = {}
    for name, (_, f) in s.ctx_sparse.items():
        one = {"type": "integer", "minimum": 0, "maximum": f.cardinality - 1}
        ctx_props[name] = (
            one
            if f.max_len == 1
            else {"oneOf": [one, {"type": "array", "items": one, "maxItems": f.max_len}]}
        )
    for name in s.ctx_dense:
        ctx_props[name] = {"type": "number"}
    error = {"$ref": "#/components/schemas/Error"}
    err_resp = {"content": {"application/json": {"schema": error}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "reco recommendation service", "version": "1", "description": __doc__},
        "paths": {
            "/recommend": {
                "post": {
                    "summary": "Top-k items for a user",
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {"schema": {"$ref": "#/components/schemas/RecommendRequest"}}
                        },
                    },
                    "responses": {
                        "200": {
                            "description": "Ranked items; Server-Timing header with per-stage times",
                            "content": {
                                "application/json": {
                                    "schema": {"$ref": "#/components/schemas/RecommendResponse"}
                                }
                            },
                        },
                        "400": {"description": "Invalid JSON", **err_resp},
                        "413": {"description": f"Body over {svc.max_body} bytes", **err_resp},
                        "422": {"description": "Invalid field (named in `field`)", **err_resp},
                        "503": {"description": "Overloaded; retry after Retry-After seconds", **err_resp},
                    },
                }
            },
            "/healthz": {
                "get": {"summary": "Liveness and model info", "responses": {"200": {"description": "ok"}}}
            },
            "/metrics": {
                "get": {"summary": "Prometheus metrics", "responses": {"200": {"description": "text"}}}
            },
        },
        "components": {
            "schemas": {
                "RecommendRequest": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["user_id", "k"],
                    "properties": {
                        "user_id": {
                            "type": "integer",
                            "description": "encoded user id; unknown -> cold start",
                        },
                        "k": {"type": "integer", "minimum": 1, "maximum": svc.max_k},
                        "context": {"type": "object", "additionalProperties": False, "properties": ctx_props},
                        "candidates": {
                            "type": "array",
                            "items": {"type": "integer", "minimum": 1, "maximum": s.item_card - 1},
                            "minItems": 1,
                            "maxItems": svc.max_candidates,
                            "description": f"item ids to rank; omitted -> {svc.n_candidates} generated",
                        },
                    },
                },
                "RecommendResponse": {
                    "type": "object",
                    "properties": {
                        "items": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {"item_id": {"type": "integer"}, "score": {"type": "number"}},
                            },
                        },
                        "model": {"type": "string"},
                    },
                },
                "Error": {
                    "type": "object",
                    "properties": {"error": {"type": "string"}, "field": {"type": "string"}},
                },
            }
        },
    }


def load_settings(config_path: str | Path | None = None, overrides: list[str] | None = None) -> dict:
    """conf/serve/default.yaml (or `config_path`, YAML or JSON) with `key=value` overrides applied."""
    from omegaconf import OmegaConf

    path = Path(config_path) if config_path else default_config_path()
    if not path.exists():
        raise ServeConfigError(f"{path}: serve config file not found")
    cfg = OmegaConf.load(path)
    for o in overrides or []:
        if "=" not in o:
            raise ServeConfigError(f"override {o!r}: expected key=value (e.g. batching.enabled=true)")
        key, value = o.split("=", 1)
        if OmegaConf.select(cfg, key, default="__missing__") == "__missing__":
            raise ServeConfigError(f"override {o!r}: no key {key!r} in {path}")
        OmegaConf.update(cfg, key, _yaml_value(value), merge=False)
    return OmegaConf.to_container(cfg, resolve=True)


def _yaml_value(s: str):
    import yaml

    return yaml.safe_load(s)


def default_config_path() -> Path:
    return Path(__file__).resolve().parents[2] / "conf" / "serve" / "default.yaml"
