"""serve.features=redis: the user and item feature rows in a real Redis server, read once per request.

Layout. One string key per entity, `<prefix>:<fingerprint>:<u|i>:<id>` (the fingerprint is the
dataset's, so two datasets never share rows), holding the entity's row of reco.serve.features.SideTable
as fixed-size little-endian bytes: ids int32 [Fs, L] | mask float32 [Fs, L] | dense float32 [Ds]. An
entity absent from the store is cold-start, as in memory. `<prefix>:<fingerprint>:meta` (a hash: the
record sizes and counts) is written last by `load_features`, so a server never starts against a
half-loaded store: it refuses when the meta key is missing or describes another layout.

Reading. A request's user and all its candidates are one MGET: one command, one round trip. Feast's
Redis online store pipelines one HMGET per entity (also one round trip); one MGET leaves Redis and the
client one reply to build instead of N + 1. The bytes are decoded with one np.frombuffer over a
structured dtype, and every record's length is checked first: a malformed record is a 503 naming its
key, never a half-read row. A dead Redis is a 503 once serve.redis.connect_timeout_s has passed, a slow
one a 504 after serve.redis.timeout_ms; both name the store and the setting, and the server keeps
serving.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np
import redis
import redis.asyncio as aredis
from redis.backoff import NoBackoff
from redis.retry import Retry

from reco.serve.config import RedisConfig
from reco.serve.features import FeatureRows, FeatureStore, ServeConfigError, SideTable


class FeatureReadError(Exception):
    """A request's features could not be read: HTTP `status` (503 unavailable / malformed, 504 slow)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def _record_dtype(side: SideTable) -> np.dtype:
    fs, L = side.ids.shape[1:]
    return np.dtype(
        [("ids", "<i4", (fs, L)), ("mask", "<f4", (fs, L)), ("dense", "<f4", (side.dense.shape[1],))]
    )


def _encode(side: SideTable, rows: np.ndarray) -> np.ndarray:
    rec = np.empty(len(rows), dtype=_record_dtype(side))
    rec["ids"], rec["mask"], rec["dense"] = side.ids[rows], side.mask[rows], side.dense[rows]
    return rec


def _keys(prefix: str, fingerprint: str) -> tuple[str, str, str]:
    base = f"{prefix}:{fingerprint}"
    return f"{base}:u:", f"{base}:i:", f"{base}:meta"


def _layout(store: FeatureStore) -> dict[str, str]:
    return {
        "user_bytes": str(_record_dtype(store.users).itemsize),
        "item_bytes": str(_record_dtype(store.items).itemsize),
        "n_users": str(store.users.cold),
        "n_items": str(store.items.cold),
    }


def _where(cfg: RedisConfig) -> str:
    return f"redis at {cfg.host}:{cfg.port} (serve.redis)"


def sync_client(cfg: RedisConfig) -> redis.Redis:
    """A blocking client for loading and startup checks (no retries: errors surface at once)."""
    return redis.Redis(
        host=cfg.host, port=cfg.port, socket_connect_timeout=cfg.connect_timeout_s,
        socket_timeout=max(cfg.connect_timeout_s, 30.0), retry=Retry(NoBackoff(), 0),
    )  # fmt: skip


@dataclass(frozen=True)
class LoadReport:
    """What load_features wrote (or found already there)."""

    n_users: int
    n_items: int
    bytes: int
    seconds: float
    reused: bool  # the store already held this dataset's rows (its meta key matched): nothing written


def load_features(store: FeatureStore, fingerprint: str, cfg: RedisConfig) -> LoadReport:
    """Write every user and item row of `store` to Redis (one MSET of cfg.load_batch entities a round
    trip), then the meta key; nothing is written when the meta key already matches.

    Raises:
        ServeConfigError naming serve.redis when Redis is unreachable or refuses the writes (maxmemory).
    """
    t0 = time.perf_counter()
    ukey, ikey, meta = _keys(cfg.prefix, fingerprint)
    layout = _layout(store)
    client = sync_client(cfg)
    try:
        if {k.decode(): v.decode() for k, v in client.hgetall(meta).items()} == layout:
            return LoadReport(store.users.cold, store.items.cold, 0, time.perf_counter() - t0, True)
        client.delete(meta)  # a reader must never see the meta key of a store being rewritten
        written = 0
        for side, key in ((store.users, ukey), (store.items, ikey)):
            ids = np.flatnonzero(side.row != side.cold)
            for a in range(0, len(ids), cfg.load_batch):
                chunk = ids[a : a + cfg.load_batch]
                rec = _encode(side, side.row[chunk])
                client.mset({f"{key}{e}": rec[j].tobytes() for j, e in enumerate(chunk.tolist())})
                written += rec.nbytes
        client.hset(meta, mapping=layout)
    except redis.exceptions.ResponseError as e:
        raise ServeConfigError(
            f"{_where(cfg)} refused the feature rows: {e} (raise serve.redis.maxmemory_mb, or the server's "
            "maxmemory)"
        ) from None
    except redis.exceptions.RedisError as e:
        raise ServeConfigError(f"{_where(cfg)}: cannot load the feature rows: {e}") from None
    finally:
        client.close()
    return LoadReport(store.users.cold, store.items.cold, written, time.perf_counter() - t0, False)


class RedisFeatures:
    """One server worker's reader of the feature rows (an asyncio client, created in its event loop)."""

    def __init__(self, store: FeatureStore, fingerprint: str, cfg: RedisConfig) -> None:
        """Check that Redis holds `store`'s rows for `fingerprint`.

        Raises:
            ServeConfigError (before the server binds its port) when Redis is unreachable, or its meta
            key is missing or describes another layout.
        """
        self.store, self.cfg = store, cfg
        self.ukey, self.ikey, meta = _keys(cfg.prefix, fingerprint)
        self.udt, self.idt = _record_dtype(store.users), _record_dtype(store.items)
        client = sync_client(cfg)
        try:
            found = {k.decode(): v.decode() for k, v in client.hgetall(meta).items()}
        except redis.exceptions.RedisError as e:
            raise ServeConfigError(f"{_where(cfg)}: {e}") from None
        finally:
            client.close()
        if found != _layout(store):
            what = "has no feature rows" if not found else f"holds another layout {found}"
            raise ServeConfigError(
                f"{_where(cfg)} {what} for dataset fingerprint {fingerprint} (key {meta}); expected "
                f"{_layout(store)}: load them with `python -m reco.cli.load_features --dataset PATH`"
            )
        self._client: aredis.Redis | None = None
        # an entity the store does not hold is cold-start, as in memory
        self.ucold = _encode(store.users, np.array([store.users.cold])).tobytes()
        self.icold = _encode(store.items, np.array([store.items.cold])).tobytes()

    def _aclient(self) -> aredis.Redis:
        if self._client is None:  # lazily: it binds to the event loop it is first used in
            c = self.cfg
            self._client = aredis.Redis(
                host=c.host, port=c.port, socket_connect_timeout=c.connect_timeout_s,
                retry=Retry(NoBackoff(), 0), max_connections=64,
            )  # fmt: skip
        return self._client

    async def fetch(self, user_id: int, items: np.ndarray) -> tuple[FeatureRows, FeatureRows]:
        """The user's row and the rows of `items` [N] in one MGET.

        Raises:
            FeatureReadError: 503 Redis unreachable or a malformed record (naming its key), 504 no answer
            within serve.redis.timeout_ms.
        """
        keys = [f"{self.ukey}{int(user_id)}"] + [f"{self.ikey}{i}" for i in items.tolist()]
        try:
            values = await asyncio.wait_for(self._aclient().mget(keys), self.cfg.timeout_ms / 1000.0)
        except TimeoutError:
            raise FeatureReadError(
                504, f"feature store: no answer from {_where(self.cfg)} within serve.redis.timeout_ms="
                f"{self.cfg.timeout_ms:g}",
            ) from None  # fmt: skip
        except redis.exceptions.RedisError as e:
            raise FeatureReadError(503, f"feature store unavailable: {_where(self.cfg)}: {e}") from None
        return (
            self._decode(values[:1], keys[:1], self.udt, self.ucold),
            self._decode(values[1:], keys[1:], self.idt, self.icold),
        )

    def _decode(self, values: list, keys: list[str], dt: np.dtype, cold: bytes) -> FeatureRows:
        parts = []
        for k, v in zip(keys, values, strict=True):
            if v is None:
                v = cold
            elif len(v) != dt.itemsize:
                raise FeatureReadError(
                    503, f"feature store: malformed record at key {k!r} in {_where(self.cfg)}: {len(v)} bytes, "
                    f"expected {dt.itemsize}",
                )  # fmt: skip
            parts.append(v)
        rec = np.frombuffer(b"".join(parts), dtype=dt)
        return FeatureRows(rec["ids"], rec["mask"], rec["dense"])

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
