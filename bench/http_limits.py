"""What serve.http's limits cost per request, and what they buy against one abusive client (issue 48).

    python -m bench.http_limits [--requests 2000] [--rounds 5] [--slow 200] [--attack-requests 300]

Two uvicorn servers of one trivial ASGI app (a JSON answer, no model: only the HTTP layer differs), each
its own process: `plain` is uvicorn's httptools protocol as the service ran it before, `limited` the
protocol of reco/serve/connection.py with conf/serve/default.yaml's serve.http.

1. Per request: keep-alive GETs one after another, both servers interleaved in rounds; p50 and p99 of
   the client-side latency (pooled over rounds, with n) and the rounds' p50 range.
2. Under attack: a client streaming one endless header in 64 KiB pieces (reconnecting when cut off)
   and `--slow` connections holding half-sent heads; a normal client's p99 and worst latency meanwhile
   against its unloaded p99 (same server, same pacing, measured just before), requests unanswered
   within 10 s, and how many slow connections the server had closed by the end (at least 5 s after
   its header timeout).
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import orjson

from reco.cli.compose import compose
from reco.serve.config import serve_config
from reco.serve.process import free_port

REQUEST = b"GET /healthz HTTP/1.1\r\nHost: bench\r\n\r\n"
ANSWER_TIMEOUT_S = 10.0
ATTACK_S = 20.0  # the normal client's requests during the attack stop after this long
STREAM_PAUSE_S = 0.006  # between 64 KiB pieces: ~10 MB/s, so the plain server's header stays ~200 MB


async def app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    body = orjson.dumps({"status": "ok"})
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def serve(kind: str, port: int) -> None:
    import uvicorn

    from reco.serve.workers import uvicorn_options

    cfg = serve_config(compose([]).serve)
    options = uvicorn_options(cfg)
    if kind == "plain":
        options["http"] = "httptools"
    uvicorn.run(app, host="127.0.0.1", port=port, **options)


def _answer(s: socket.socket) -> None:
    """Read one response (headers + content-length body) from a keep-alive socket."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    length = int(
        next(x.split(b":")[1] for x in head.split(b"\r\n") if x.lower().startswith(b"content-length"))
    )
    while len(body) < length:
        body += s.recv(65536)


def latencies(port: int, n: int, budget_s: float = np.inf, every_s: float = 0.0) -> np.ndarray:
    """Up to n keep-alive requests, one every `every_s` (0: back to back), stopping after budget_s: seconds
    each (inf: not answered within ANSWER_TIMEOUT_S)."""
    out = np.empty(n)
    end = time.monotonic() + budget_s
    s = socket.create_connection(("127.0.0.1", port), timeout=ANSWER_TIMEOUT_S)
    for j in range(n):
        if time.monotonic() > end:
            out = out[:j]
            break
        time.sleep(every_s)
        t = time.perf_counter()
        try:
            s.sendall(REQUEST)
            _answer(s)
            out[j] = time.perf_counter() - t
        except (TimeoutError, OSError):
            out[j] = np.inf
            s.close()
            s = socket.create_connection(("127.0.0.1", port), timeout=ANSWER_TIMEOUT_S)
    s.close()
    return out


def _stream_header(port: int, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: bench\r\nX-Big: ")
                while not stop.is_set():
                    s.sendall(b"a" * 65536)
                    time.sleep(STREAM_PAUSE_S)
        except OSError:
            time.sleep(0.01)  # cut off by the server: reconnect


def attack(port: int, n_slow: int, n_req: int, header_timeout_s: float) -> dict:
    every_s = ATTACK_S / n_req  # spread over the attack: the header grows while they are asked
    base = latencies(port, n_req, every_s=every_s)
    slow = [socket.create_connection(("127.0.0.1", port), timeout=1) for _ in range(n_slow)]
    t0 = time.monotonic()
    for s in slow:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: bench\r\nX-Slow: ")
    stop = threading.Event()
    streamer = threading.Thread(target=_stream_header, args=(port, stop), daemon=True)
    streamer.start()
    loaded = latencies(port, n_req, ATTACK_S, every_s)
    stop.set()
    streamer.join(10)
    time.sleep(max(1.0, header_timeout_s + 5 - (time.monotonic() - t0)))
    closed = 0
    for s in slow:
        s.setblocking(False)
        try:
            while s.recv(65536):
                pass
            closed += 1  # EOF: the server closed it
        except BlockingIOError:
            pass  # still open
        except OSError:
            closed += 1
        s.close()
    ok = loaded[np.isfinite(loaded)]
    return {
        "unloaded_p99_ms": float(np.percentile(base, 99) * 1e3),
        "attack_p99_ms": float(np.percentile(ok, 99) * 1e3) if len(ok) else float("inf"),
        "attack_max_ms": float(ok.max() * 1e3) if len(ok) else float("inf"),
        "answered": len(ok),
        "unanswered": int((~np.isfinite(loaded)).sum()),
        "slow_closed": closed,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--slow", type=int, default=200)
    p.add_argument("--attack-requests", type=int, default=300)
    p.add_argument("--serve", choices=["plain", "limited"], help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.serve:
        serve(a.serve, a.port)
        return
    header_timeout_s = serve_config(compose([]).serve).http.header_timeout_s
    ports = {k: free_port() for k in ("plain", "limited")}
    procs = [
        subprocess.Popen([sys.executable, "-m", "bench.http_limits", "--serve", k, "--port", str(port)])
        for k, port in ports.items()
    ]
    try:
        for port in ports.values():
            _wait(port)
        times: dict[str, list[np.ndarray]] = {k: [] for k in ports}
        for _ in range(a.rounds):
            for k, port in ports.items():
                times[k].append(latencies(port, a.requests))
        print(f"\n1. per request (keep-alive GET, trivial app), {a.rounds} rounds x {a.requests}")
        print(f"{'protocol':<10}{'n':>8}{'p50 us':>10}{'p99 us':>10}{'round p50s us':>22}")
        for k, ts in times.items():
            t = np.concatenate(ts) * 1e6
            r = [np.median(x) * 1e6 for x in ts]
            print(
                f"{k:<10}{len(t):>8}{np.median(t):>10.1f}{np.percentile(t, 99):>10.1f}{min(r):>12.1f}-{max(r):.1f}"
            )
        print(
            f"\n2. under attack: one endless header streamed + {a.slow} half-sent heads, {a.attack_requests} requests"
        )
        print(
            f"{'protocol':<10}{'unloaded p99 ms':>17}{'attack p99 ms':>15}{'worst ms':>10}{'answered':>10}{'unanswered':>12}{'slow closed':>13}"
        )
        for k, port in ports.items():
            r = attack(port, a.slow, a.attack_requests, header_timeout_s)
            print(
                f"{k:<10}{r['unloaded_p99_ms']:>17.2f}{r['attack_p99_ms']:>15.2f}{r['attack_max_ms']:>10.1f}"
                f"{r['answered']:>10}{r['unanswered']:>12}{r['slow_closed']:>9}/{a.slow}"
            )
        print(
            f"(slow closed: counted at least {header_timeout_s + 5:g} s after they were opened; serve.http.header_timeout_s={header_timeout_s:g})"
        )
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)


def _wait(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            latencies(port, 1)
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"bench server on port {port} did not start")


if __name__ == "__main__":
    main()
