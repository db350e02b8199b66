"""Fuzzing the service from its own OpenAPI schema (Schemathesis) plus hand-written nasties.

One real server on 127.0.0.1 serving a tiny model whose data has a dense *context* feature
(user_activity moved to the context side), so numbers in requests are fuzzed too. Schemathesis checks
that schema-valid requests get 2xx, schema-violating ones a 4xx, and that every answer conforms to the
documented status codes and response schemas. The test prints how many requests it sent and how many
5xx it saw (none is the pass mark).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import socket
from urllib.parse import urlparse

import pytest
import requests
import schemathesis
from conftest import make_variant
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.config import SchemathesisConfig
from test_serve import Client, _read_response, _trickle, expected_scores, nested, scores, serve_settings

from reco.serve.process import start_server

pytestmark = pytest.mark.timeout(300)

EXAMPLES = {GenerationMode.POSITIVE: 500, GenerationMode.NEGATIVE: 500}  # POST /recommend
GOOD = {
    "user_id": 7,
    "k": 10,
    "candidates": [5, 17, 300, 999, 42],
    "context": {"hour": 3, "user_activity": 1.5},
}


@pytest.fixture(scope="module")
def fuzzed(tiny_data, tmp_path_factory):
    s = tiny_data.schema
    dense = tuple(dataclasses.replace(f, side="context") if f.name == "user_activity" else f for f in s.dense)
    data = dataclasses.replace(tiny_data, schema=dataclasses.replace(s, dense=dense))
    data.compute_fingerprint()
    root = tmp_path_factory.mktemp("fuzz")
    vdir, dpath = make_variant(data, root, onnx=True)
    cfg = serve_settings("keep_warm=false", "n_candidates=50", "body_timeout_s=2")
    h = start_server(vdir, dpath, cfg, work_dir=root / "server")
    want = expected_scores(vdir, data, cfg, GOOD)
    stats: collections.Counter = collections.Counter()
    try:
        yield {"handle": h, "cfg": cfg, "want": want, "stats": stats}
    finally:
        h.stop()
        n, n5 = sum(stats.values()), sum(v for k, v in stats.items() if k >= 500)
        print(f"\nfuzzed {n} requests against POST /recommend, GET /healthz, GET /metrics: {n5} answered 5xx")
        print("by status:", dict(sorted(stats.items())))


def _still_correct(fuzzed: dict) -> None:
    """The server is alive and a well-formed request still gets the right answer."""
    c = Client(fuzzed["handle"].url)
    status, _, resp = c.recommend(GOOD)
    c.close()
    assert status == 200, resp
    got, want = scores(resp), fuzzed["want"]
    assert got.keys() == want.keys() and all(abs(got[i] - want[i]) < 1e-5 for i in want)


def _no_null_scores(status: int, body: bytes) -> None:
    if status == 200 and body.startswith(b"{"):
        for it in json.loads(body).get("items", []):
            assert it["score"] is not None and math.isfinite(it["score"]), it


def test_schemathesis_generated_requests(fuzzed):
    h, stats = fuzzed["handle"], fuzzed["stats"]
    # How the service refuses a schema-violating body; 413 too: a negative case can outgrow max_body_bytes
    # (thousands of nested candidates), which Schemathesis' default list of refusals leaves out.
    rejected = ["400", "413", "415", "422"]
    config = SchemathesisConfig.from_dict(
        {"checks": {"negative_data_rejection": {"expected-statuses": rejected}}}
    )
    schema = schemathesis.openapi.from_url(h.url + "/openapi.json", config=config)
    session = requests.Session()
    common = settings(
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )

    def run(strategy, n: int) -> None:
        @settings(common, max_examples=n)
        @given(case=strategy)
        def check(case) -> None:
            r = case.call(session=session, timeout=30)
            stats[r.status_code] += 1
            _no_null_scores(r.status_code, r.content)
            case.validate_response(r)  # status documented; valid -> 2xx, invalid -> 4xx; body schema

        check()

    for mode, n in EXAMPLES.items():
        run(schema["/recommend"]["POST"].as_strategy(generation_mode=mode), n)
    for path in ("/healthz", "/metrics"):
        run(schema[path]["GET"].as_strategy(), 5)
    assert stats[200] > 0 and sum(v for k, v in stats.items() if 400 <= k < 500) > 0
    assert not [k for k in stats if k >= 500], stats
    _still_correct(fuzzed)


DEEP = nested(1000)
NASTIES: list[tuple[str, bytes, str | None, int]] = [
    # (what, body, Content-Type, expected status)
    ("deep user_id", b'{"user_id": ' + DEEP + b', "k": 5}', "application/json", 422),
    ("deep context", b'{"user_id": 1, "k": 5, "context": {"hour": ' + DEEP + b"}}", "application/json", 422),
    ("deep candidates", b'{"user_id": 1, "k": 5, "candidates": ' + DEEP + b"}", "application/json", 422),
    ("deep unknown field", b'{"x": ' + DEEP + b', "user_id": 1, "k": 5}', "application/json", 422),
    ("deep object", b'{"a":' * 1000 + b"1" + b"}" * 1000, "application/json", 422),
    ("deeper than orjson's limit", nested(2000), "application/json", 400),
    (
        "dense 1e39 (inf in float32)",
        b'{"user_id": 1, "k": 5, "context": {"user_activity": 1e39}}',
        "application/json",
        422,
    ),
    (
        "dense -3.5e38",
        b'{"user_id": 1, "k": 5, "context": {"user_activity": -3.5e38}}',
        "application/json",
        422,
    ),
    (
        "dense 3.4e38",
        b'{"user_id": 1, "k": 5, "context": {"user_activity": 3.4e38}}',
        "application/json",
        200,
    ),
    ("dense 1e-45", b'{"user_id": 1, "k": 5, "context": {"user_activity": 1e-45}}', "application/json", 200),
    ("dense 1e308", b'{"user_id": 1, "k": 5, "context": {"user_activity": 1e308}}', "application/json", 422),
    ("1e400", b'{"user_id": 1e400, "k": 5}', "application/json", 400),
    ("user_id 10**30", b'{"user_id": 1000000000000000000000000000000, "k": 5}', "application/json", 422),
    ("user_id 2**64", b'{"user_id": 18446744073709551616, "k": 5}', "application/json", 422),
    ("user_id -2**63-1", b'{"user_id": -9223372036854775809, "k": 5}', "application/json", 422),
    ("user_id 2**53", b'{"user_id": 9007199254740992, "k": 5}', "application/json", 422),
    ("user_id 2**53-1 as float", b'{"user_id": 9007199254740991.0, "k": 5}', "application/json", 200),
    ("k 5.0", b'{"user_id": 1, "k": 5.0}', "application/json", 200),
    ("k 5.5", b'{"user_id": 1, "k": 5.5}', "application/json", 422),
    ("candidate 1e19", b'{"user_id": 1, "k": 5, "candidates": [1e19]}', "application/json", 422),
    ("NaN", b'{"user_id": NaN, "k": 5}', "application/json", 400),
    ("nan", b'{"user_id": 1, "k": 5, "context": {"user_activity": nan}}', "application/json", 400),
    ("-NaN", b'{"user_id": 1, "k": 5, "context": {"user_activity": -NaN}}', "application/json", 400),
    ("Infinity", b'{"user_id": 1, "k": 5, "context": {"user_activity": Infinity}}', "application/json", 400),
    (
        "-Infinity",
        b'{"user_id": 1, "k": 5, "context": {"user_activity": -Infinity}}',
        "application/json",
        400,
    ),
    ("inf", b'{"user_id": 1, "k": 5, "context": {"user_activity": inf}}', "application/json", 400),
    ("1e999", b'{"user_id": 1, "k": 5, "context": {"user_activity": 1e999}}', "application/json", 400),
    ('"NaN" string', b'{"user_id": 1, "k": 5, "context": {"user_activity": "NaN"}}', "application/json", 422),
    ("text/plain", json.dumps(GOOD).encode(), "text/plain", 415),
    ("form", b"user_id=1&k=5", "application/x-www-form-urlencoded", 415),
    ("multipart", b"--x\r\n\r\n--x--", "multipart/form-data; boundary=x", 415),
    ("no Content-Type", json.dumps(GOOD).encode(), None, 415),
    ("json, latin-1", json.dumps(GOOD).encode(), "application/json; charset=latin-1", 415),
    ("truncated JSON", b'{"user_id": 1, "k"', "application/json", 400),
    ("empty body", b"", "application/json", 400),
    ("null", b"null", "application/json", 422),
    ("a string", b'"hello"', "application/json", 422),
    ("BOM", b'\xef\xbb\xbf{"user_id": 1, "k": 5}', "application/json", 400),
    ("invalid UTF-8", b'{"user_id": 1, "k": 5, "x": "\xff"}', "application/json", 400),
    ("lone surrogate", b'{"user_id": 1, "k": 5, "context": {"\\ud800": 1}}', "application/json", 400),
    ("long unknown key", b'{"' + b"k" * 60_000 + b'": 1}', "application/json", 422),
    ("duplicate keys", b'{"user_id": 1, "k": 0, "k": 5}', "application/json", 200),
    ("oversized", b'{"user_id": 1, "k": 5, "x": "' + b"x" * 70_000 + b'"}', "application/json", 413),
    (
        "2001 candidates",
        json.dumps({"user_id": 1, "k": 5, "candidates": list(range(1, 2002))}).encode(),
        "application/json",
        422,
    ),
    ("empty context list", b'{"user_id": 1, "k": 5, "context": {"hour": []}}', "application/json", 422),
]


@pytest.mark.parametrize("what, body, ctype, status", NASTIES, ids=[n[0] for n in NASTIES])
def test_nasty_request(fuzzed, what, body, ctype, status):
    c = Client(fuzzed["handle"].url)
    got, _, data = c.request("POST", "/recommend", body, {"Content-Type": ctype} if ctype else {})
    c.close()
    fuzzed["stats"][got] += 1
    _no_null_scores(got, data)
    resp = json.loads(data)
    assert got == status, (what, resp)
    if got != 200:
        assert set(resp) == {"error", "field"} and len(resp["error"]) < 400, resp
    if what.startswith("dense"):
        assert got == 200 or resp["field"] == "context.user_activity"
    _still_correct(fuzzed)


def _raw(url: str, raw: bytes) -> int:
    """Send raw bytes, return the answer's status (0 when the server just closed the connection)."""
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(raw)
        head = s.recv(65536)
        return int(head.split()[1]) if head.startswith(b"HTTP/") else 0


def test_broken_framing_and_slow_bodies(fuzzed):
    h = fuzzed["handle"]
    url = h.url
    stats = fuzzed["stats"]
    head = b"POST /recommend HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    cases = [
        ("Content-Length huge", head + b"Content-Length: 99999999999999999999999\r\n\r\n{}", {400, 413}),
        ("Content-Length bad", head + b"Content-Length: 1x\r\n\r\n{}", {400}),
        ("Content-Length negative", head + b"Content-Length: -5\r\n\r\n{}", {400}),
        ("chunked garbage", head + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", {0, 400}),
    ]
    for what, raw, ok in cases:
        status = _raw(url, raw)
        stats[status] += 1
        assert status in ok, (what, status)
    # A body shorter than its Content-Length, and one trickled in chunks: 408 after body_timeout_s (a
    # server that never answers fails the read on the client socket's own timeout, not on a clock here).
    for sock in (_trickle(url, 200, b'{"user_id": 1, "k": 5}'), _trickle(url, 0, b'{"user', chunked=True)):
        status, err = _read_response(sock)
        sock.close()
        stats[status] += 1
        assert status == 408 and err["field"] == "body" and "body_timeout_s" in err["error"], err
    _still_correct(fuzzed)
    assert h.proc.poll() is None and "Traceback" not in h.log_path.read_text()
