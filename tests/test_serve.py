"""The HTTP service on loopback: real server processes, a tiny untrained DLRM variant, real requests."""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import re
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import psutil
import pytest
from conftest import make_variant

from reco.cli.compose import compose
from reco.cli.serve import main as serve_main
from reco.cli.serve import settings as cli_settings
from reco.config import ConfigError
from reco.data.schema import Dataset
from reco.loadtest.scrape import parse_stage_histograms, process_cpu_s, stage_summary
from reco.serve.config import ServeConfig, read_settings, serve_config, write_settings
from reco.serve.features import FeatureStore, ServeConfigError, distinct_per_row
from reco.serve.metrics import STAGES
from reco.serve.openapi import openapi_schema
from reco.serve.process import start_server, stop_servers
from reco.serve.request import RequestError, parse_request
from reco.variant import Variant

pytestmark = pytest.mark.timeout(240)
PIN = sorted(os.sched_getaffinity(0))[-1]  # the batched server's core


def serve_settings(*overrides: str) -> ServeConfig:
    """The project's serve settings with `key=value` overrides, as `python -m reco.cli.serve` composes them."""
    return serve_config(compose([f"serve.{o}" for o in overrides]).serve)


def running_servers(vdir, dpath, specs: dict[str, list[str]], root):
    """Yield {name: ready ServerHandle}, one server per spec's overrides started side by side; all
    stopped at the end (for module fixtures: `yield from running_servers(...)`)."""
    handles = {
        name: start_server(vdir, dpath, serve_settings(*over), wait=False, work_dir=root / name)
        for name, over in specs.items()
    }
    try:
        for h in handles.values():
            h.wait_ready(timeout_s=180)
        yield handles
    finally:
        stop_servers(list(handles.values()))


@pytest.fixture(scope="module")
def served(tiny_data, tmp_path_factory):
    """Servers started side by side: plain, dynamic batching, a tiny admission limit, two workers.
    Keep-warm spinners only for the two workers (whose stop is checked to take them along): several
    SCHED_IDLE spinners on a core slow its normal tasks (reco/serve/keepwarm.py), i.e. every test here."""
    root = tmp_path_factory.mktemp("serve")
    vdir, dpath = make_variant(tiny_data, root, onnx=True)
    specs = {
        "plain": ["keep_warm=false"],
        "batched": [
            "keep_warm=false",
            "batching.enabled=true",
            "batching.max_queue_delay_ms=50.0",
            f"cpu_affinity=[{PIN}]",
        ],
        "limited": ["keep_warm=false", "queue_limit=2", "retry_after_s=1", "body_timeout_s=3"],
        "workers": ["workers=2"],
        # the network off the model's core: the event loop on core 0, the rank thread on PIN
        "split": ["keep_warm=false", "cpu_affinity=[0]", f"model_cpu_affinity=[{PIN}]"],
        # rank_threads=0: the event loop calls the model itself (no hand-off)
        "inline": ["keep_warm=false", "rank_threads=0"],
    }
    for handles in running_servers(vdir, dpath, specs, root):
        yield {
            "handles": handles,
            "data": tiny_data,
            "vdir": vdir,
            "dpath": dpath,
            "settings": serve_settings(),
        }


class Client:
    """Keep-alive HTTP/1.1 client (one connection), like a real caller."""

    def __init__(self, url: str) -> None:
        u = urlparse(url)
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        self.conn.request(method, path, body, headers or {})
        r = self.conn.getresponse()
        data = r.read()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, data

    def recommend(self, body: dict | bytes):
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        status, headers, data = self.request("POST", "/recommend", raw, {"Content-Type": "application/json"})
        return status, headers, json.loads(data)

    def close(self) -> None:
        self.conn.close()


@pytest.fixture()
def plain(served):
    c = Client(served["handles"]["plain"].url)
    yield c
    c.close()


def a_test_row(data: Dataset, i: int = 0) -> dict:
    """A request body from test row i: that row's user id and context features."""
    s = data.schema
    ids = data.test.ids[i]
    return {
        "user_id": int(ids[s.index("user_id"), 0]),
        "context": {"hour": int(ids[s.index("hour"), 0]), "device": int(ids[s.index("device"), 0])},
        "k": 10,
    }


def scores(resp: dict) -> dict[int, float]:
    return {it["item_id"]: it["score"] for it in resp["items"]}


def test_a_pinned_server_runs_every_thread_on_its_core(served):
    """It loads on any core (servers of a study start at once) and pins every thread before serving."""
    h = served["handles"]["batched"]
    c = Client(h.url)
    assert c.recommend(a_test_row(served["data"]))[0] == 200  # the batcher and executor threads exist
    c.close()
    threads = psutil.Process(h.pid).threads()
    assert len(threads) > 1 and {tuple(os.sched_getaffinity(t.id)) for t in threads} == {(PIN,)}


def test_recommend_returns_ranked_items_with_server_timing(plain, served):
    status, headers, resp = plain.recommend(a_test_row(served["data"]))
    assert status == 200
    assert resp["model"] == "tiny"
    items = resp["items"]
    assert len(items) == 10 and len({it["item_id"] for it in items}) == 10
    s = [it["score"] for it in items]
    assert s == sorted(s, reverse=True) and all(0 < x < 1 for x in s)
    timing = dict(part.split(";dur=") for part in headers["server-timing"].split(", "))
    assert list(timing) == [*STAGES, "rank_cpu"]
    t = {k: float(v) for k, v in timing.items()}
    assert all(v >= 0 for v in t.values())
    # The model call's thread used CPU, and no more than the call's wall time (rank also holds the top-k).
    assert 0 < t["rank_cpu"] <= t["rank"] + 0.01
    # The stages partition the request: they add up to the total (up to the header's rounding).
    assert abs(sum(t[k] for k in STAGES if k != "total") - t["total"]) < 0.01


def test_candidates_come_from_the_users_recent_categories_and_popularity(plain, served):
    data, body = served["data"], a_test_row(served["data"])
    store = FeatureStore(data, served["settings"].retrieval)
    row = store.user_row(body["user_id"])
    cands = store.candidates(row, 500)
    assert len(cands) == len(set(cands.tolist())) == 500
    cat_col = data.schema.index("category")
    item_cat = store.items.ids[store.items.lookup(cands), list(store.items.cols).index(cat_col), 0]
    recent_col = list(store.users.cols).index(data.schema.index("recent_categories"))
    user_cats = set(store.users.ids[row, recent_col].tolist()) - {0}
    known_cat = store.items.ids[:-1, list(store.items.cols).index(cat_col), 0]
    m = min(250, int(np.isin(known_cat, list(user_cats)).sum()))  # half from the user's categories
    assert user_cats and m > 0 and np.isin(item_cat[:m], list(user_cats)).all()
    # ... the rest by global popularity, skipping what is already in.
    rest = [i for i in store.popular.tolist() if i not in set(cands[:m].tolist())][: 500 - m]
    assert cands[m:].tolist() == rest
    # The served top-k are drawn from exactly these candidates.
    status, _, resp = plain.recommend({**body, "k": 100})
    assert status == 200 and set(scores(resp)) <= set(cands.tolist())


def test_feature_store_rebuilds_the_latest_training_row(served):
    """The last train row is the latest for its user and its item: serving must reproduce it exactly."""
    data = served["data"]
    s, tr = data.schema, data.train
    store = FeatureStore(data, served["settings"].retrieval)
    r = len(tr) - 1
    ids, mask = tr.ids[r].numpy(), tr.mask()[r].numpy()
    body = {"user_id": int(ids[s.index("user_id"), 0]), "k": 1}
    body["context"] = {"hour": int(ids[s.index("hour"), 0]), "device": int(ids[s.index("device"), 0])}
    req = parse_request(json.dumps(body).encode(), store, 100, 10)
    item = np.array([ids[s.index("item_id"), 0]])
    dense_a, ids_a, mask_a = store.assemble(store.user_row(body["user_id"]), req, item)
    np.testing.assert_array_equal(ids_a[0], ids)
    np.testing.assert_array_equal(mask_a[0], mask)
    np.testing.assert_array_equal(dense_a[0], tr.dense[r].numpy())


def test_each_users_retrieval_groups_are_its_distinct_valid_ids():
    # Precomputed at start-up for every user row (FeatureStore.candidates reads them per request).
    rng = np.random.default_rng(0)
    ids, valid = rng.integers(-2, 12, size=(300, 6)), rng.random((300, 6)) < 0.7
    groups, count = distinct_per_row(ids, valid, 10)
    for r in range(300):
        want = np.unique(ids[r][valid[r] & (ids[r] > 0) & (ids[r] < 10)])
        assert groups[r, : count[r]].tolist() == want.tolist() and (groups[r, count[r] :] == 10).all()


def test_concurrent_requests_each_get_their_own_answer(served):
    # Model inputs are written into reused per-worker buffers (BlockPool): requests in flight at once
    # must never share one. Answered one at a time, then 8 at a time: the same items and scores.
    url, data = served["handles"]["plain"].url, served["data"]
    bodies = [{**a_test_row(data, i), "k": 20} for i in range(48)]
    c = Client(url)
    alone = [c.recommend(b)[2] for b in bodies]
    c.close()
    together: dict[int, dict] = {}

    def run(part: list[int]) -> None:
        client = Client(url)
        for i in part:
            together[i] = client.recommend(bodies[i])[2]
        client.close()

    threads = [threading.Thread(target=run, args=(list(range(j, 48, 8)),)) for j in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [together[i] for i in range(48)] == alone


def test_head_and_expect_continue_answered_through_the_one_write_response(served):
    # A response's head is held and sent with its body (reco.serve.connection.HeadWithBody): a HEAD
    # answer (no body write) and the interim 100 of `Expect: 100-continue` must still go out.
    u = urlparse(served["handles"]["plain"].url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 200 ")
        body = json.dumps(a_test_row(served["data"])).encode()
        head = (
            "POST /recommend HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Expect: 100-continue\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        s.sendall(head.encode())
        assert s.recv(65536).startswith(b"HTTP/1.1 100 Continue")  # before the body is sent
        s.sendall(body)
        answer = b""
        while b'"model"' not in answer:
            answer += s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200 ")


def test_unknown_user_is_cold_start_not_an_error(plain):
    answers = []
    for uid in (0, 10**12, -3, 1_999_999):
        status, _, resp = plain.recommend({"user_id": uid, "k": 5})
        assert status == 200 and len(resp["items"]) == 5
        answers.append(scores(resp))
    # Every unknown id gets the same cold-start features, hence the same answer.
    assert all(a == answers[0] for a in answers)


def test_given_candidates_are_ranked_and_context_is_used(plain):
    cands = [5, 17, 300, 999, 42]
    status, _, resp = plain.recommend({"user_id": 7, "k": 10, "candidates": cands})
    assert status == 200 and sorted(scores(resp)) == sorted(cands)  # k > len(candidates): all of them
    _, _, night = plain.recommend({"user_id": 7, "k": 5, "candidates": cands, "context": {"hour": 3}})
    _, _, day = plain.recommend({"user_id": 7, "k": 5, "candidates": cands, "context": {"hour": 15}})
    assert scores(night) != scores(day)
    # A context id outside its table is the unknown id 0, as in training.
    _, _, oov = plain.recommend({"user_id": 7, "k": 5, "candidates": cands, "context": {"hour": 10_000}})
    _, _, unk = plain.recommend({"user_id": 7, "k": 5, "candidates": cands, "context": {"hour": 0}})
    assert scores(oov) == scores(unk)


BAD = [
    (b"{not json", 400, "body"),
    (b"[1, 2]", 422, "body"),
    (b'{"k": 5}', 422, "user_id"),
    (b'{"user_id": "7", "k": 5}', 422, "user_id"),
    (b'{"user_id": 1.5, "k": 5}', 422, "user_id"),
    (b'{"user_id": true, "k": 5}', 422, "user_id"),
    (b'{"user_id": 7}', 422, "k"),
    (b'{"user_id": 7, "k": 0}', 422, "k"),
    (b'{"user_id": 7, "k": -1}', 422, "k"),
    (b'{"user_id": 7, "k": 101}', 422, "k"),
    (b'{"user_id": 7, "k": "5"}', 422, "k"),
    (b'{"user_id": 7, "k": 5, "context": [1]}', 422, "context"),
    (b'{"user_id": 7, "k": 5, "context": {"hour": "noon"}}', 422, "context.hour"),
    (b'{"user_id": 7, "k": 5, "context": {"colour": 1}}', 422, "context.colour"),
    (b'{"user_id": 7, "k": 5, "context": {"user_id": 1}}', 422, "context.user_id"),
    (b'{"user_id": 7, "k": 5, "context": {"hour": [3, 4]}}', 422, "context.hour"),  # max_len 1
    (b'{"user_id": 7, "k": 5, "context": {"hour": [2.5]}}', 422, "context.hour"),
    (b'{"user_id": 7, "k": 5, "context": {"hour": null}}', 422, "context.hour"),
    (b'{"user_id": 7, "k": 5, "candidates": []}', 422, "candidates"),
    (b'{"user_id": 7, "k": 5, "candidates": "1,2"}', 422, "candidates"),
    (b'{"user_id": 7, "k": 5, "candidates": [1, "x"]}', 422, "candidates[1]"),
    (b'{"user_id": 7, "k": 5, "candidates": [1, 2.5]}', 422, "candidates[1]"),
    (b'{"user_id": 7, "k": 5, "candidates": [1, 99999, 0]}', 422, "candidates"),
    (json.dumps({"user_id": 7, "k": 5, "candidates": list(range(1, 2002))}).encode(), 422, "candidates"),
    (b'{"user_id": 7, "k": 5, "kk": 1}', 422, "kk"),
    (b'{"user_id": 1, "k": 1, "pad": "' + b"x" * 70_000 + b'"}', 413, "body"),
]


def test_bad_input_is_a_4xx_naming_the_field_and_the_server_keeps_serving(plain, served):
    for body, status, field in BAD:
        got, headers, resp = plain.recommend(body)
        assert (got, resp["field"]) == (status, field), (body[:60], resp)
        assert resp["error"].startswith(field if field != "body" else "body")
        if status == 413:  # the server may close the connection after refusing a large body
            plain.close()
            plain.__init__(served["handles"]["plain"].url)
    _, _, resp = plain.recommend({"user_id": 7, "k": 5, "candidates": [1, 99999, 0]})
    assert "99999" in resp["error"] and "0" in resp["error"]
    # A body without Content-Length (chunked) over the limit is refused while streaming.
    c = Client(served["handles"]["plain"].url)
    c.conn.request(
        "POST",
        "/recommend",
        iter([b"x" * 40_000] * 2),
        {"Content-Type": "application/json"},
        encode_chunked=True,
    )
    r = c.conn.getresponse()
    assert r.status == 413 and json.loads(r.read())["field"] == "body"
    c.close()
    status, _, resp = Client(served["handles"]["plain"].url).request("GET", "/recommend")
    assert status == 405 and "field" in json.loads(resp)
    status, _, resp = plain.recommend(a_test_row(served["data"]))
    assert status == 200 and len(resp["items"]) == 10


def test_the_validating_model_is_the_openapi_schema(tiny_data):
    """/openapi.json's request schema is generated from the model that validates: its limits and each
    field's description (the "expected ..." of that field's 422 message) come from one place."""
    store, cfg = FeatureStore(tiny_data, None), serve_settings("max_k=7", "max_candidates=3")
    props = openapi_schema(store, cfg, "tiny")["components"]["schemas"]["RecommendRequest"]["properties"]
    assert props["k"]["maximum"] == 7 and props["candidates"]["anyOf"][0]["maxItems"] == 3
    for body, field in [
        (b'{"user_id": 1, "k": 8}', "k"),
        (b'{"user_id": 1, "k": 1, "candidates": [1,2,3,4]}', "candidates"),
    ]:
        with pytest.raises(RequestError) as e:
            parse_request(body, store, cfg.max_k, cfg.max_candidates)
        assert e.value.field == field and f"expected {props[field]['description']}, got" in e.value.message
    assert parse_request(b'{"user_id": 66.0, "k": 7.0}', store, cfg.max_k, cfg.max_candidates).k == 7


def expected_scores(vdir, data: Dataset, cfg: ServeConfig, body: dict) -> dict[int, float]:
    """The scores the server should answer for `body` (given candidates, k >= their number), computed
    in this process from the same variant and data."""
    from reco.runtime import load_scorer

    store = FeatureStore(data, cfg.retrieval)
    req = parse_request(json.dumps(body).encode(), store, cfg.max_k, cfg.max_candidates)
    assert req.candidates is not None and req.k >= len(req.candidates)
    probs = load_scorer(Variant.load(vdir))(*store.assemble(store.user_row(req.user_id), req, req.candidates))
    return dict(zip(req.candidates.tolist(), probs.tolist(), strict=True))


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def test_deeply_nested_json_is_a_4xx_not_a_crash(plain, served):
    """Error messages used repr(), which recursed through ~1000 levels: 500 and a stack trace per request."""
    log_before = served["handles"]["plain"].log_path.read_text()
    for field, body in [
        ("user_id", b'{"user_id": ' + nested(1000) + b', "k": 5}'),
        ("k", b'{"user_id": 1, "k": ' + nested(1000) + b"}"),
        ("context", b'{"user_id": 1, "k": 5, "context": ' + nested(1000) + b"}"),
        ("context.hour", b'{"user_id": 1, "k": 5, "context": {"hour": ' + nested(1000) + b"}}"),
        ("candidates[0]", b'{"user_id": 1, "k": 5, "candidates": ' + nested(1000) + b"}"),
        ("body", nested(1023)),
        ("body", nested(5000)),  # beyond orjson's depth limit (1024): invalid JSON
    ]:
        status, _, resp = plain.recommend(body)
        assert status in (400, 422) and resp["field"] == field, (field, status, resp)
        assert len(resp["error"]) < 300
    status, _, resp = plain.recommend({"user_id": 1, "k": 3, "candidates": [5, 17, 300]})
    assert status == 200 and sorted(scores(resp)) == [5, 17, 300]
    new_log = served["handles"]["plain"].log_path.read_text()[len(log_before) :]
    assert "Traceback" not in new_log and "RecursionError" not in new_log


@pytest.mark.parametrize(
    "ctype, status",
    [
        ("application/json", 200),
        ("application/json; charset=utf-8", 200),
        ("Application/JSON;charset=UTF-8", 200),
        (None, 415),  # a missing Content-Type is refused too (documented in the OpenAPI description)
        ("text/plain", 415),
        ("application/x-www-form-urlencoded", 415),
        ("application/json; charset=latin-1", 415),
        ("application/jsonx", 415),
    ],
)
def test_content_type_must_be_json(plain, ctype, status):
    headers = {"Content-Type": ctype} if ctype else {}
    got, _, data = plain.request("POST", "/recommend", b'{"user_id": 1, "k": 2}', headers)
    resp = json.loads(data)
    assert got == status, resp
    if status == 415:
        assert resp["field"] == "Content-Type" and "application/json" in resp["error"]
    else:
        assert len(resp["items"]) == 2


def _trickle(url: str, declared: int, sent: bytes, chunked: bool = False) -> socket.socket:
    """A connection that sends the request head and part of the body, then nothing."""
    u = urlparse(url)
    sock = socket.create_connection((u.hostname, u.port), timeout=60)
    length = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {declared}"
    head = f"POST /recommend HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{length}\r\n\r\n"
    body = f"{len(sent):x}\r\n".encode() + sent + b"\r\n" if chunked else sent
    sock.sendall(head.encode() + body)
    return sock


def _read_response(sock: socket.socket) -> tuple[int, dict]:
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _content_length(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _content_length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def test_slow_bodies_do_not_take_admission_slots(served):
    """Clients trickling their bodies used to count against queue_limit (2 here) with no read timeout,
    so two of them refused everyone else with 503, forever. Now the body is read first, with
    body_timeout_s (3 s here) -> 408."""
    h = served["handles"]["limited"]
    slow = [_trickle(h.url, 100, b'{"user_id": 1,') for _ in range(3)]
    slow.append(_trickle(h.url, 0, b'{"user_id"', chunked=True))
    c = Client(h.url)
    body = {"user_id": 7, "k": 3, "candidates": [5, 17, 300]}
    status, _, resp = c.recommend(body)
    assert status == 200 and sorted(scores(resp)) == [5, 17, 300]
    for sock in slow:
        status, err = _read_response(sock)
        assert status == 408 and err["field"] == "body" and "body_timeout_s" in err["error"]
        assert sock.recv(1) == b""  # and the connection is closed: the rest of that body is not wanted
        sock.close()
    status, _, resp2 = c.recommend(body)
    assert status == 200 and scores(resp2) == scores(resp)
    assert h.health()["inflight_max"] <= 2
    c.close()


def test_healthz_metrics_and_openapi(plain, served):
    status, _, body = plain.request("GET", "/healthz")
    h = json.loads(body)
    assert status == 200 and h["status"] == "ok" and h["model"] == "tiny" and h["backend"] == "onnxruntime"
    assert h["retrieval"] == "recent_categories->category" and h["batching"]["enabled"] is False

    first = plain.request("GET", "/metrics")[2].decode()
    before = parse_stage_histograms(first)
    for i in range(3):
        assert plain.recommend(a_test_row(served["data"], i))[0] == 200
    status, headers, text = plain.request("GET", "/metrics")
    after = parse_stage_histograms(text.decode())
    # What the hardware bill sees: the process's CPU between the scrapes, per answered request.
    used = process_cpu_s(text.decode()) - process_cpu_s(first)
    assert used > 0 and stage_summary(first, text.decode())["cpu_per_request_ms"] == pytest.approx(
        used / 3 * 1000
    )
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert set(after) == set(STAGES)
    for stage in STAGES:
        assert after[stage]["count"] - before.get(stage, {"count": 0})["count"] == 3
        assert after[stage]["cum"][-1] == after[stage]["count"]

    status, _, body = plain.request("GET", "/openapi.json")
    spec = json.loads(body)
    assert status == 200 and spec["openapi"].startswith("3.")
    schemas = spec["components"]["schemas"]
    req = schemas["RecommendRequest"]
    assert req["required"] == ["user_id", "k"] and req["properties"]["k"]["maximum"] == 100
    assert req["properties"]["context"]["anyOf"] == [
        {"$ref": "#/components/schemas/RecommendContext"},
        {"type": "null"},
    ]
    assert set(schemas["RecommendContext"]["properties"]) == {"hour", "device"}
    assert schemas["RecommendResponse"]["required"] == ["items", "model"]
    assert {"200", "413", "422", "503"} <= set(spec["paths"]["/recommend"]["post"]["responses"])


def test_dynamic_batching_gives_the_same_scores(served):
    data = served["data"]
    bodies = [{**a_test_row(data, i), "k": 20} for i in range(8)]
    plain, batched = Client(served["handles"]["plain"].url), Client(served["handles"]["batched"].url)
    expected = [scores(plain.recommend(b)[2]) for b in bodies]
    # One at a time: the batcher scores a lone block exactly as the plain server does.
    for b, exp in zip(bodies, expected, strict=True):
        got = scores(batched.recommend(b)[2])
        assert got.keys() == exp.keys()
        np.testing.assert_allclose([got[i] for i in exp], list(exp.values()), rtol=1e-6)
    # Concurrently: blocks are coalesced into shared model calls, scores still match.
    before = _batch_counts(batched)
    results: list[dict | None] = [None] * len(bodies)
    gate = threading.Barrier(len(bodies))

    def send(i: int) -> None:
        c = Client(served["handles"]["batched"].url)
        gate.wait()
        results[i] = c.recommend(bodies[i])[2]
        c.close()

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, exp in zip(results, expected, strict=True):
        g = scores(got)
        assert g.keys() == exp.keys()
        np.testing.assert_allclose([g[i] for i in exp], list(exp.values()), rtol=1e-5, atol=1e-7)
    after = _batch_counts(batched)
    calls, reqs = after[0] - before[0], after[1] - before[1]
    assert reqs == len(bodies) and calls < reqs  # at least one call carried several requests
    plain.close()
    batched.close()


CPU_PARTS = ("model", "parse", "retrieval", "features", "serialize", "rest")


def _rank_cpu_ms(headers: dict) -> float:
    """The Server-Timing rank_cpu of an answer: its model call's CPU (ms, the whole call)."""
    return float(dict(p.split(";dur=") for p in headers["server-timing"].split(", "))["rank_cpu"])


def _cpu_split(first: str, last: str, n: int) -> dict[str, float]:
    """The CPU split of the `n` requests answered between two scrapes, checked to cover the process's CPU:
    every part is there, the event loop's stages and the model's part are positive, and they leave a
    rest >= 0 (stages that double-counted, or counted wall time, would exceed what the process used)."""
    s = stage_summary(first, last)
    used = process_cpu_s(last) - process_cpu_s(first)
    assert s["cpu_per_request_ms"] == pytest.approx(used / n * 1000)
    parts = {k: s[f"cpu_per_request_{k}_ms"] for k in CPU_PARTS}
    assert all(parts[k] > 0 for k in ("model", "parse", "features", "serialize")), parts
    assert parts["retrieval"] >= 0 and parts["rest"] >= 0, parts
    assert sum(parts.values()) == pytest.approx(s["cpu_per_request_ms"])
    return parts


def test_server_cpu_split_covers_the_process_cpu(plain, served):
    """One request per model call: the model's part is what the answers' Server-Timing rank_cpu add up to
    (to their 1 µs rounding), and the parts leave a rest >= 0 of the process's CPU."""
    first = plain.request("GET", "/metrics")[2].decode()
    n = 30
    rank_ms = [_rank_cpu_ms(plain.recommend(a_test_row(served["data"], i))[1]) for i in range(n)]
    parts = _cpu_split(first, plain.request("GET", "/metrics")[2].decode(), n)
    assert parts["model"] == pytest.approx(sum(rank_ms) / n, abs=1e-3)


def test_server_cpu_split_counts_a_batched_call_once(served):
    """A call carrying several requests reports its whole CPU to each (Server-Timing rank_cpu); the
    model's part of the split counts it once, shared by rows, so it is below their mean, and at least
    that mean / the largest batch."""
    url, data = served["handles"]["batched"].url, served["data"]
    c = Client(url)
    first, (calls0, reqs0) = c.request("GET", "/metrics")[2].decode(), _batch_counts(c)
    n = 8
    rank_ms: list[float] = [0.0] * n
    gate = threading.Barrier(n)

    def send(i: int) -> None:
        ci = Client(url)
        gate.wait()
        status, headers, _ = ci.recommend({**a_test_row(data, i), "candidates": list(range(1, 41))})
        assert status == 200
        rank_ms[i] = _rank_cpu_ms(headers)
        ci.close()

    threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    calls1, reqs1 = _batch_counts(c)
    parts = _cpu_split(first, c.request("GET", "/metrics")[2].decode(), n)
    c.close()
    assert reqs1 - reqs0 == n and calls1 - calls0 < n  # at least one call carried several requests
    assert sum(rank_ms) / n / n - 1e-3 <= parts["model"] < sum(rank_ms) / n


def _batch_counts(c: Client) -> tuple[float, float]:
    """(model calls, requests carried) from reco_batch_requests."""
    from prometheus_client.parser import text_string_to_metric_families

    text = c.request("GET", "/metrics")[2].decode()
    fam = next(f for f in text_string_to_metric_families(text) if f.name == "reco_batch_requests")
    count = next(s.value for s in fam.samples if s.name.endswith("_count"))
    total = next(s.value for s in fam.samples if s.name.endswith("_sum"))
    return count, total


def _hammer(url: str, n_clients: int, per_client: int, body: dict) -> list[tuple[int, float, dict]]:
    """n_clients keep-alive clients back to back; (status, e2e ms, headers) per request."""
    import time

    out: list[tuple[int, float, dict]] = []
    lock = threading.Lock()
    gate = threading.Barrier(n_clients)

    def run() -> None:
        c = Client(url)
        gate.wait()
        for _ in range(per_client):
            t = time.perf_counter()
            status, headers, _ = c.recommend(body)
            with lock:
                out.append((status, (time.perf_counter() - t) * 1000, headers))
            if status == 503:
                time.sleep(0.01)  # a refused client backs off briefly instead of spinning
        c.close()

    threads = [threading.Thread(target=run) for _ in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_overload_is_refused_with_503_so_admitted_latency_stays_bounded(served):
    """Same overload (24 clients, 1000 candidates each) against queue_limit 64 and queue_limit 2."""
    body = {"user_id": 7, "k": 10, "candidates": list(range(1, 1001))}
    limited, plain = served["handles"]["limited"], served["handles"]["plain"]
    res_limited = _hammer(limited.url, 24, 8, body)
    res_plain = _hammer(plain.url, 24, 8, body)

    refused = [h for s, _, h in res_limited if s == 503]
    assert refused and all(h["retry-after"] == "1" for h in refused)
    assert {s for s, _, _ in res_limited} <= {200, 503}
    assert all(s == 200 for s, _, _ in res_plain)  # 24 in flight fit under queue_limit 64
    assert limited.health()["inflight_max"] <= 2  # the queue never grew past the limit
    assert plain.health()["inflight_max"] > 2  # without the limit the same load queues deeper

    def p99(res: list, server_side: bool) -> float:
        ms = [_total_ms(h) if server_side else e2e for st, e2e, h in res if st == 200]
        return float(np.percentile(ms, 99, method="inverted_cdf"))

    print(
        f"admitted p99 e2e / in server: queue_limit 2 -> {p99(res_limited, False):.1f} / "
        f"{p99(res_limited, True):.1f} ms, queue_limit 64 -> {p99(res_plain, False):.1f} / {p99(res_plain, True):.1f} ms"
    )
    # The bound is structural (inflight_max above): no request ever waited behind more than one other.
    # The p99s are printed, not asserted -- timings on a shared 2-core machine are not a test.


def _total_ms(headers: dict) -> float:
    return float(dict(p.split(";dur=") for p in headers["server-timing"].split(", "))["total"])


def test_schema_without_user_key_refuses_to_start(served, tmp_path, capsys):
    data = served["data"]
    nokey = dataclasses.replace(data, schema=dataclasses.replace(data.schema, user_key=None))
    path = tmp_path / "nokey.pt"
    nokey.save(str(path))
    with pytest.raises(ServeConfigError, match="user_key"):
        FeatureStore(nokey, None)
    code = serve_main(["--variant", str(served["vdir"]), "--dataset", str(path), "--port", "1"])
    assert code == 2
    assert "user_key" in capsys.readouterr().err


def test_variant_built_on_other_data_refuses_to_start(served, tmp_path, capsys):
    v = Variant.load(served["vdir"])
    v.data_fingerprint = "0" * 16  # as if trained on another dataset
    v.dir = str(tmp_path / "other")
    (tmp_path / "other").mkdir()
    for f in v.artifacts.values():
        (tmp_path / "other" / f).write_bytes((served["vdir"] / f).read_bytes())
    v.save()
    code = serve_main(["--variant", v.dir, "--dataset", str(served["dpath"]), "--port", "1"])
    assert code == 2
    assert "data fingerprint" in capsys.readouterr().err


def test_the_model_runs_on_its_own_cores_and_the_event_loop_on_the_servers(served):
    """serve.model_cpu_affinity: the threads that called the model (the rank thread, and any its runtime
    started) are on their cores, the event loop (the main thread) stays on cpu_affinity, and the answers
    are the plain server's."""
    h = served["handles"]["split"]
    c, p = Client(h.url), Client(served["handles"]["plain"].url)
    body = a_test_row(served["data"])
    try:
        a, b = c.recommend(body), p.recommend(body)
    finally:
        c.close()
        p.close()
    assert a[0] == 200 and a[2]["items"] == b[2]["items"]

    def cores(tid: int) -> str:
        status = Path(f"/proc/{h.pid}/task/{tid}/status").read_text()
        return re.search(r"Cpus_allowed_list:\s*(\S+)", status).group(1)

    placed = {tid: cores(tid) for tid in map(int, os.listdir(f"/proc/{h.pid}/task"))}
    assert placed[h.pid] == "0"  # the main thread runs the event loop
    assert str(PIN) in placed.values() and set(placed.values()) == {"0", str(PIN)}
    with pytest.raises(
        ConfigError, match=r"serve.model_cpu_affinity: expected a non-empty list of this machine's cores"
    ):
        cli_settings(["model_cpu_affinity=[4096]"])
    with pytest.raises(ConfigError, match=r"serve.cpu_affinity: expected a non-empty list"):
        cli_settings(["cpu_affinity=[]"])


def test_an_inline_model_call_answers_as_the_rank_thread_does_and_its_cpu_is_the_model_part(served):
    """serve.rank_threads=0: the same items and scores as the plain server's, the model's part of the CPU
    split is what the answers' rank_cpu add up to, and the parts still leave a rest >= 0 (the model call
    now runs on the event loop's thread, and no loop stage may count it again)."""
    c, p = Client(served["handles"]["inline"].url), Client(served["handles"]["plain"].url)
    first = c.request("GET", "/metrics")[2].decode()
    n, rank_ms = 20, []
    try:
        for i in range(n):
            body = a_test_row(served["data"], i)
            (status, headers, got), exp = c.recommend(body), p.recommend(body)[2]
            assert status == 200 and [it["item_id"] for it in got["items"]] == [
                it["item_id"] for it in exp["items"]
            ]
            np.testing.assert_allclose(list(scores(got).values()), list(scores(exp).values()), rtol=1e-6)
            rank_ms.append(_rank_cpu_ms(headers))
        parts = _cpu_split(first, c.request("GET", "/metrics")[2].decode(), n)
    finally:
        c.close()
        p.close()
    assert parts["model"] == pytest.approx(sum(rank_ms) / n, abs=1e-3)


def test_settings_overrides_and_their_errors(tmp_path):
    s = cli_settings(["batching.enabled=true", "cpu_affinity=[1]", "n_candidates=50"], port=9)
    assert s.batching.enabled is True and s.cpu_affinity == [1] and s.n_candidates == 50 and s.port == 9
    assert s.batching.max_batch == compose().serve.batching.max_batch  # the rest from conf/serve
    with pytest.raises(Exception, match="serve.batching.nope"):
        cli_settings(["batching.nope=1"])
    with pytest.raises(Exception, match="serve.workers"):
        cli_settings(["workers=many"])
    with pytest.raises(ConfigError, match="serve.workers: expected >= 1"):
        cli_settings(["workers=0"])
    with pytest.raises(ConfigError, match="serve.model_timeout_s: expected > 0"):
        cli_settings(["model_timeout_s=0"])
    with pytest.raises(ConfigError, match="serve.rank_threads: expected >= 0"):
        cli_settings(["rank_threads=-1"])
    for other in ("batching.enabled=true", "model_cpu_affinity=[0]"):  # no thread to batch on or to pin
        with pytest.raises(ConfigError, match=r"serve.rank_threads=0 \(the event loop calls the model"):
            cli_settings(["rank_threads=0", other])
    # Worker processes and start_server take the same settings as JSON / a plain dict.
    as_json = json.dumps(dataclasses.asdict(s))
    assert serve_config(as_json) == s and serve_config(json.loads(as_json)) == s
    with pytest.raises(ConfigError, match="retrieval.nope"):
        serve_config({**json.loads(as_json), "retrieval": {"nope": 1}})
    # A server process (and each worker) types its one settings file once; the command line's values on
    # top are range-checked, and a bad file names itself and the key.
    path = write_settings(s, tmp_path / "settings.json")
    assert read_settings(path) == s and cli_settings([], file=path) == s
    assert cli_settings([], port=10, file=path) == dataclasses.replace(s, port=10)
    with pytest.raises(ConfigError, match="serve.expect_sha256"):
        cli_settings([], file=path, expect_sha256="not-hex")
    path.write_text(json.dumps({**json.loads(as_json), "workers": 0}))
    with pytest.raises(ConfigError, match=f"--settings {path}.workers: expected >= 1"):
        read_settings(path)


def test_bad_settings_refuse_to_start_naming_the_key(served, capsys):
    code = serve_main(
        ["--variant", str(served["vdir"]), "--dataset", str(served["dpath"]), "batching.nope=1"]
    )
    assert code == 2 and "serve.batching.nope" in capsys.readouterr().err


def test_two_workers_share_the_port_and_their_metrics(served):
    import psutil

    h = served["handles"]["workers"]
    kids = psutil.Process(h.pid).children(recursive=True)
    pids = set()
    for i in range(40):  # a new connection each time: SO_REUSEPORT spreads them over the workers
        c = Client(h.url)
        status, _, resp = c.recommend({"user_id": i, "k": 3})
        assert status == 200 and len(resp["items"]) == 3
        pids.add(json.loads(c.request("GET", "/healthz")[2])["pid"])
        c.close()
    assert len(pids) == 2 and pids <= {k.pid for k in kids}
    text = Client(h.url).request("GET", "/metrics")[2].decode()
    assert parse_stage_histograms(text)["rank"]["count"] == 40  # summed over both workers
    worker_cpu = sum(psutil.Process(p).cpu_times().user + psutil.Process(p).cpu_times().system for p in pids)
    assert 0 < process_cpu_s(text) <= worker_cpu + 0.05  # both workers' CPU, each as of its last request
    assert h.stop() == 0
    _, alive = psutil.wait_procs(kids, timeout=10)  # workers, keep-warm spinners, mp's resource tracker
    assert not [k for k in alive if k.status() != psutil.STATUS_ZOMBIE]


def test_start_server_takes_typed_settings_only(tmp_path):
    """A raw `serve` section is typed once where it is read (serve_config), not again by every caller."""
    from reco.serve.process import start_server

    with pytest.raises(TypeError, match="serve_config"):
        start_server(tmp_path, tmp_path / "data.pt", compose([]).serve, work_dir=tmp_path)
