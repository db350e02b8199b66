"""Limits below the application (serve.http, reco/serve/connection.py) on real servers over real sockets.

One client with an oversized or half-sent head must not stall the others; every refusal is the JSON
error body the application uses; no redirect is built from the Host header.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import make_variant
from prometheus_client.parser import text_string_to_metric_families
from test_serve import Client, running_servers, serve_settings

from reco.config import ConfigError

pytestmark = pytest.mark.timeout(240)

HEADER_TIMEOUT_S = 2.0
BODY = json.dumps({"user_id": 7, "k": 3, "candidates": [5, 17, 300, 999, 42]}).encode()
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def servers(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("limits")
    vdir, dpath = make_variant(tiny_data, root, onnx=True)
    specs = {
        "guarded": ["keep_warm=false", f"http.header_timeout_s={HEADER_TIMEOUT_S}"],
        "few": ["keep_warm=false", "http.max_connections=3", "http.keepalive_timeout_s=3"],
    }
    yield from running_servers(vdir, dpath, specs, root)


def _port(h) -> int:
    return int(h.url.rsplit(":", 1)[1])


def _read_all(s: socket.socket) -> bytes:
    """Everything the server sends until it closes; TimeoutError when it does not close within the
    socket's (generous) timeout."""
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def _parse(raw: bytes) -> tuple[int, dict[str, str], dict]:
    """(status, lower-cased headers, JSON body) of one raw HTTP response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, json.loads(body)


def _raw(port: int, data: bytes, timeout_s: float = 30.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before all of it was sent: the answer is still there to read
        return _read_all(s)


def _refused(c: Client) -> dict[str, float]:
    text = c.request("GET", "/metrics")[2].decode()
    for fam in text_string_to_metric_families(text):
        if fam.name == "reco_http_refused":
            return {s.labels["reason"]: s.value for s in fam.samples if s.name == "reco_http_refused_total"}
    raise AssertionError("reco_http_refused_total not exported")


def _latencies(url: str, n: int) -> list[float]:
    c = Client(url)
    out = []
    for _ in range(n):
        t = time.perf_counter()
        status, _, _ = c.request("POST", "/recommend", BODY, JSON)
        out.append(time.perf_counter() - t)
        assert status == 200
    c.close()
    return out


def test_oversized_header_is_431_json_and_others_are_still_served(servers):
    """A 1 MiB header streamed in pieces: refused once it passes max_header_bytes, not read to its end;
    a concurrent normal client keeps being answered meanwhile (issue 48: /recommend got no answer in 10 s)."""
    h = servers["guarded"]
    c = Client(h.url)
    before = _refused(c)
    answers: list[bytes] = []

    def stream() -> None:
        with socket.create_connection(("127.0.0.1", _port(h)), timeout=30) as s:
            try:
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ")
                for _ in range(16):  # 1 MiB in 64 KiB pieces, a little apart
                    s.sendall(b"a" * 65536)
                    time.sleep(0.02)
            except (BrokenPipeError, ConnectionResetError):
                pass
            answers.append(_read_all(s))

    t = threading.Thread(target=stream)
    t.start()
    served = _latencies(h.url, 20)  # each answered (a 200) while the stream goes on
    t.join(60)
    assert len(served) == 20
    status, headers, body = _parse(answers[0])
    assert status == 431 and headers["content-type"] == "application/json", answers[0][:300]
    assert body == {
        "error": "request line and headers over serve.http.max_header_bytes=16384 bytes",
        "field": "headers",
    }
    assert _refused(c)["header_bytes"] == before["header_bytes"] + 1
    # The same limit holds for a head sent in one piece, and for one too many header fields.
    status, _, body = _parse(_raw(_port(h), b"GET /healthz HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n"))
    assert status == 431 and body["field"] == "headers"
    many = b"".join(b"X-%d: a\r\n" % i for i in range(101))
    status, _, body = _parse(_raw(_port(h), b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n"))
    assert (status, body["error"]) == (431, "more than serve.http.max_headers=100 header fields")
    # ... and a head just within both limits is served.
    ok = b"".join(b"X-%d: %s\r\n" % (i, b"a" * 100) for i in range(98))
    status, _, body = _parse(
        _raw(_port(h), b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + ok + b"\r\n")
    )
    assert status == 200 and body["status"] == "ok"
    c.close()


def test_slow_headers_are_closed_within_the_header_timeout_and_do_not_stall_others(servers):
    """200 connections holding half-sent heads (slowloris): a normal request is answered meanwhile, and
    each slow connection gets a 408 JSON and is closed once serve.http.header_timeout_s has passed."""
    h = servers["guarded"]
    n = 200
    socks = [socket.create_connection(("127.0.0.1", _port(h)), timeout=30) for _ in range(n)]
    try:
        for s in socks:
            s.sendall(b"POST /recommend HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        assert len(_latencies(h.url, 10)) == 10  # answered while the 200 heads hang
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(_read_all, socks))  # each closed by the server, or TimeoutError
    finally:
        for s in socks:
            s.close()
    for raw in answers:
        status, _, body = _parse(raw)
        assert status == 408 and body == {
            "error": f"request headers not received within serve.http.header_timeout_s={HEADER_TIMEOUT_S:g} s",
            "field": "headers",
        }
    # A connection that sends nothing at all is closed too, without an answer.
    with socket.create_connection(("127.0.0.1", _port(h)), timeout=30) as s:
        assert _read_all(s) == b""


def test_framing_errors_and_unknown_paths_are_json_and_no_redirect_uses_host(servers):
    port = _port(servers["guarded"])
    status, headers, body = _parse(_raw(port, b"GARBAGE\r\n\r\n"))
    assert status == 400 and headers["content-type"] == "application/json"
    assert body["field"] == "http" and body["error"].startswith("malformed HTTP request"), body
    bad_chunk = (
        b"POST /recommend HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\nzz\r\n"
    )
    status, _, body = _parse(_raw(port, bad_chunk))
    assert status == 400 and body["field"] == "http", body
    # No websockets: an Upgrade request is answered as plain HTTP (and logs nothing per request).
    upgrade = (
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    status, _, body = _parse(_raw(port, upgrade))
    assert status == 200 and body["status"] == "ok"
    # Starlette's trailing-slash redirect built its Location from Host: off (issue 48: 307 to evil.example).
    req = (
        b"POST /recommend/ HTTP/1.1\r\nHost: evil.example\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(BODY)
    ) + BODY
    status, headers, body = _parse(_raw(port, req))
    assert status == 404 and "location" not in headers, (headers, body)
    assert body == {"error": "POST /recommend/: Not Found", "field": ""}


def test_connections_beyond_the_cap_get_503_json_and_idle_ones_are_closed(servers):
    h = servers["few"]
    held = [Client(h.url) for _ in range(3)]
    try:
        for c in held:
            assert c.request("GET", "/healthz")[0] == 200  # open and counted by the worker
        raw = _raw(_port(h), b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, body = _parse(raw)
        assert status == 503 and headers["retry-after"] == "1", raw
        assert "serve.http.max_connections=3" in body["error"] and body["field"] == ""
    finally:
        for c in held:
            c.close()
    time.sleep(0.5)  # the server sees the three closes
    assert len(_latencies(h.url, 3)) == 3
    # serve.http.keepalive_timeout_s=3: an idle keep-alive connection is closed by the server.
    with socket.create_connection(("127.0.0.1", _port(h)), timeout=30) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        raw = _read_all(s)  # the answer, then the server's close (TimeoutError if it kept it open)
        assert raw.startswith(b"HTTP/1.1 200"), raw[:200]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("http.max_header_bytes=0", r"serve\.http\.max_header_bytes: expected >= 256, got 0"),
        ("http.max_headers=0", r"serve\.http\.max_headers: expected >= 1, got 0"),
        ("http.max_connections=-1", r"serve\.http\.max_connections: expected >= 1, got -1"),
        ("http.header_timeout_s=0", r"serve\.http\.header_timeout_s: expected > 0, got 0"),
        ("http.keepalive_timeout_s=-1", r"serve\.http\.keepalive_timeout_s: expected > 0, got -1"),
        ("request_start_max_age_s=0", r"serve\.request_start_max_age_s: expected > 0, got 0"),
        ("request_start_max_ahead_s=-1", r"serve\.request_start_max_ahead_s: expected > 0, got -1"),
    ],
)
def test_nonsense_limits_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        serve_settings(override)
