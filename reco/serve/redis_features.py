"""serve.features=redis: the user and item feature rows in a real Redis server, read once per request.

Layout. One string key per entity, `<prefix>:<fingerprint>:<u|i>:<id>` (the fingerprint is the
dataset's, so two datasets never share rows), holding the entity's row of reco.serve.features.SideTable
as fixed-size little-endian bytes: ids int32 [Fs, L] | mask float32 [Fs, L] | dense float32 [Ds]. An
entity absent from the store is cold-start, as in memory. `<prefix>:<fingerprint>:sentinel` (JSON: the
dataset fingerprint, the number of rows written, the record sizes and table sizes) is written last by
`load_features`, so a server never starts against a half-loaded store: it refuses when the sentinel is
missing or describes another load.

A store that loses its rows while the server runs. A Redis restarted empty or flushed answered every
key as absent, and absent means cold-start: the server went on answering 200 with cold-start scores,
silently. So the sentinel is read in every request's MGET (the same round trip, one key more) and a
request whose MGET lacks it -- Redis answers MGET atomically, so rows and sentinel are one snapshot --
is a 503 naming serve.redis; a worker also checks a random sample of serve.redis.check_sample row keys
every serve.redis.check_interval_s (rows lost one by one, e.g. evicted under maxmemory) and answers 503
until a check finds them all again. Reloading (`load_features`, which rewrites a store whose sentinel
or sample does not match) brings the server back without a restart.

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
import contextlib
import logging
import time
from dataclasses import dataclass

import numpy as np
import orjson
import redis
import redis.asyncio as aredis
from redis.backoff import NoBackoff
from redis.retry import Retry

from reco.serve.config import RedisConfig
from reco.serve.features import FeatureRows, FeatureStore, ServeConfigError, SideTable

log = logging.getLogger("reco.serve")


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
    return f"{base}:u:", f"{base}:i:", f"{base}:sentinel"


@dataclass(frozen=True)
class _Rows:
    """The entity ids that have a row in the store (one key each), per side: found once per store, not
    at every sample check (a scan of every user and item)."""

    users: np.ndarray
    items: np.ndarray

    @classmethod
    def of(cls, store: FeatureStore) -> _Rows:
        return cls(*(np.flatnonzero(side.row != side.cold) for side in (store.users, store.items)))

    def sample_keys(self, ukey: str, ikey: str, n: int, rng: np.random.Generator) -> list[str]:
        """`n` random keys that must exist while the store holds these rows (users and items alike)."""
        nu, total = len(self.users), len(self.users) + len(self.items)
        picks = rng.integers(0, total, size=n) if total else []
        return [f"{ukey}{self.users[j]}" if j < nu else f"{ikey}{self.items[j - nu]}" for j in picks]


def _sentinel(store: FeatureStore, rows: _Rows, fingerprint: str) -> bytes:
    """What the sentinel key holds once every row of `store` has been written."""
    return orjson.dumps(
        {
            "fingerprint": fingerprint,
            "rows": len(rows.users) + len(rows.items),
            "user_bytes": _record_dtype(store.users).itemsize,
            "item_bytes": _record_dtype(store.items).itemsize,
            "n_users": int(store.users.cold),
            "n_items": int(store.items.cold),
        },
        option=orjson.OPT_SORT_KEYS,
    )


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
    reused: bool  # the store already held this dataset's rows (sentinel and sample matched): nothing written


def load_features(store: FeatureStore, fingerprint: str, cfg: RedisConfig) -> LoadReport:
    """Write every user and item row of `store` to Redis (one MSET of cfg.load_batch entities a round
    trip), then the sentinel; nothing is written when the sentinel already matches and a sample of
    serve.redis.check_sample row keys is all there (a store that lost rows is rewritten).

    Raises:
        ServeConfigError naming serve.redis when Redis is unreachable or refuses the writes (maxmemory).
    """
    t0 = time.perf_counter()
    ukey, ikey, sentinel = _keys(cfg.prefix, fingerprint)
    rows = _Rows.of(store)
    expected = _sentinel(store, rows, fingerprint)
    client = sync_client(cfg)
    try:
        sample = rows.sample_keys(ukey, ikey, cfg.check_sample, np.random.default_rng())
        if client.get(sentinel) == expected and (not sample or client.exists(*sample) == len(sample)):
            return LoadReport(store.users.cold, store.items.cold, 0, time.perf_counter() - t0, True)
        client.delete(sentinel)  # a reader must never see the sentinel of a store being rewritten
        written = 0
        for side, key, ids in ((store.users, ukey, rows.users), (store.items, ikey, rows.items)):
            for a in range(0, len(ids), cfg.load_batch):
                chunk = ids[a : a + cfg.load_batch]
                rec = _encode(side, side.row[chunk])
                client.mset({f"{key}{e}": rec[j].tobytes() for j, e in enumerate(chunk.tolist())})
                written += rec.nbytes
        client.set(sentinel, expected)
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
            ServeConfigError (before the server binds its port) when Redis is unreachable, or its
            sentinel is missing or describes another load.
        """
        self.store, self.cfg, self.fingerprint = store, cfg, fingerprint
        self.ukey, self.ikey, self.sentinel = _keys(cfg.prefix, fingerprint)
        self.rows = _Rows.of(store)
        self.expected = _sentinel(store, self.rows, fingerprint)
        self.udt, self.idt = _record_dtype(store.users), _record_dtype(store.items)
        client = sync_client(cfg)
        try:
            found = client.get(self.sentinel)
        except redis.exceptions.RedisError as e:
            raise ServeConfigError(f"{_where(cfg)}: {e}") from None
        finally:
            client.close()
        if found != self.expected:
            raise ServeConfigError(
                f"{_where(cfg)} {self._lacks(found)} (key {self.sentinel}); expected {self.expected.decode()}: "
                "load them with `python -m reco.cli.load_features --dataset PATH`"
            )
        self._client: aredis.Redis | None = None
        # an entity the store does not hold is cold-start, as in memory
        self.ucold = _encode(store.users, np.array([store.users.cold])).tobytes()
        self.icold = _encode(store.items, np.array([store.items.cold])).tobytes()
        self.lost: str | None = None  # why the last sample check failed; None: the rows were all there
        self._checker: asyncio.Task | None = None
        self._rng = np.random.default_rng()

    def _lacks(self, found: bytes | None) -> str:
        what = "has no feature rows" if found is None else f"holds another load {found[:200]!r}"
        return f"{what} for dataset fingerprint {self.fingerprint}"

    def start(self) -> None:
        """Start the periodic sample check (in the worker's event loop)."""
        self._checker = asyncio.get_running_loop().create_task(self._check_forever())

    async def _check_forever(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.check_interval_s)
            try:
                await self.check()
            except FeatureReadError:
                pass  # unreachable or slow: each request says so itself

    async def check(self) -> None:
        """Look for the sentinel and a random sample of row keys; sets `lost` to what is missing (503s
        until a later check finds everything again).

        Raises:
            FeatureReadError: Redis unreachable (503) or not answering within serve.redis.timeout_ms (504).
        """
        sample = self.rows.sample_keys(self.ukey, self.ikey, self.cfg.check_sample, self._rng)
        pipe = self._aclient().pipeline(transaction=False)
        pipe.get(self.sentinel)
        if sample:
            pipe.exists(*sample)
        found, *present = await self._bounded(pipe.execute())
        lost = None
        if found != self.expected:
            lost = self._lacks(found)
        elif sample and present[0] != len(sample):
            lost = f"lost rows: {len(sample) - present[0]} of {len(sample)} sampled row keys missing"
        if lost != self.lost:
            log.warning("feature store %s: %s", _where(self.cfg), lost or "rows back")
        self.lost = lost

    async def _bounded(self, call):
        try:
            return await asyncio.wait_for(call, self.cfg.timeout_ms / 1000.0)
        except TimeoutError:
            raise FeatureReadError(
                504, f"feature store: no answer from {_where(self.cfg)} within serve.redis.timeout_ms="
                f"{self.cfg.timeout_ms:g}",
            ) from None  # fmt: skip
        except redis.exceptions.RedisError as e:
            raise FeatureReadError(503, f"feature store unavailable: {_where(self.cfg)}: {e}") from None

    def _unserved(self, why: str) -> FeatureReadError:
        return FeatureReadError(
            503,
            f"feature store {_where(self.cfg)} {why}: not answered from it (it would be cold-start scores); "
            "reload the rows (`python -m reco.cli.load_features`), serving resumes without a restart",
        )

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
        if self.lost is not None:
            raise self._unserved(self.lost)
        keys = [self.sentinel, f"{self.ukey}{int(user_id)}"] + [f"{self.ikey}{i}" for i in items.tolist()]
        values = await self._bounded(self._aclient().mget(keys))
        if values[0] != self.expected:
            # MGET is atomic: without the sentinel in the same snapshot the rows cannot be trusted either
            # (flushed, or restarted empty) -- absent rows would read as cold-start.
            raise self._unserved(self._lacks(values[0]))
        return (
            self._decode(values[1:2], keys[1:2], self.udt, self.ucold),
            self._decode(values[2:], keys[2:], self.idt, self.icold),
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
        if self._checker is not None:
            self._checker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._checker
        if self._client is not None:
            await self._client.aclose()
