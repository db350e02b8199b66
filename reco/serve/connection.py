"""Limits below the application: what one HTTP connection may cost a worker (serve.http).

uvicorn's httptools protocol puts no bound on a request's head: httptools accumulates a header's value
until its line ends, so one client streaming a single endless header held the event loop for everyone
(a 179 MB header was accepted; /healthz took ~3.7 s meanwhile), and a connection holding a half-sent
head stayed open forever (slowloris). The application cannot help: it only sees a request once its head
is complete. So the guards sit in the protocol, before the parser builds anything:

- serve.http.max_header_bytes: the bytes of the request line and headers are counted as they arrive,
  before they reach the parser; more -> 431 and the connection closed.
- serve.http.max_headers: more header fields -> 431.
- serve.http.header_timeout_s: a head not complete this long after its first byte (or, on a fresh
  connection, after connect) -> 408 (nothing at all received: just closed).
- serve.http.keepalive_timeout_s: an idle keep-alive connection is closed (uvicorn's timeout_keep_alive).
- serve.http.max_connections: open connections per worker; one more is answered 503 and closed.

Framing errors (a malformed request line, bad chunking) are answered with the same JSON error body as
the application's (`{"error", "field"}`) instead of uvicorn's plain-text "Invalid HTTP request
received.". Every refusal here is counted in reco_http_refused_total{reason}.
"""

from __future__ import annotations

import asyncio
import http
from typing import ClassVar

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from reco.serve.config import HttpConfig

LINGER_S = 2.0  # after a refusal: how long the client's further bytes are read and discarded, at most
REFUSED_REASONS = ("header_bytes", "header_count", "header_timeout", "max_connections", "malformed")


def error_body(field: str, message: str) -> bytes:
    """The JSON body of every error the service answers: `{"error": message, "field": field}`."""
    return orjson.dumps({"error": message, "field": field})


def raw_error(status: int, field: str, message: str, headers: dict[str, str] | None = None) -> bytes:
    """A complete HTTP/1.1 error response (JSON body, `Connection: close`) to write on a transport."""
    body = error_body(field, message)
    head = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    head += ["content-type: application/json", f"content-length: {len(body)}", "connection: close"]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


class _Refuse(Exception):
    """Raised from a parser callback to stop parsing; data_received answers it and closes."""

    def __init__(self, status: int, reason: str, field: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason, self.field, self.message = status, reason, field, message


CONTINUE = b"HTTP/1.1 100 "  # uvicorn's interim answer to `Expect: 100-continue`


class HeadWithBody:
    """The transport one response is written to: uvicorn writes a response's head (status line and
    headers) and its body in two calls, i.e. two send syscalls and two TCP segments for an answer of a
    few hundred bytes; this holds the first write and sends it with the next (one send, one segment;
    bench.overhead measures the server CPU it saves). A close sends a held write first."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.held: bytes | None = None
        self.first = True

    def write(self, data: bytes) -> None:
        if self.first and not data.startswith(CONTINUE):  # an interim 100 goes out at once
            self.first, self.held = False, data
            return
        if self.held is not None:
            data, self.held = self.held + data, None
        self.transport.write(data)

    def close(self) -> None:
        if self.held is not None:
            self.transport.write(self.held)
            self.held = None
        self.transport.close()

    def __getattr__(self, name: str):  # everything else is the connection's transport's
        return getattr(self.transport, name)


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with serve.http's limits (the class attributes come from
    `protocol_class`; one instance per connection)."""

    limits: ClassVar[HttpConfig]
    retry_after: ClassVar[str]
    on_refused: ClassVar = staticmethod(lambda reason: None)  # counts a refusal by reason

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.in_head = True  # between requests or inside a request's head (not its body)
        self.head_bytes = 0  # raw bytes received during this head (before the parser sees them)
        self.head_exact = 0  # bytes of its request line and headers as parsed (pipelined requests)
        self.n_headers = 0
        self.head_timer: asyncio.TimerHandle | None = None
        self.refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            # Answered at once, before any request byte is read (lingering close, as every refusal).
            self._refuse(
                _Refuse(
                    503,
                    "max_connections",
                    "",
                    f"server busy: {len(self.connections) - 1} connections open to this worker "
                    f"(serve.http.max_connections={self.limits.max_connections})",
                ),
                {"Retry-After": self.retry_after},
            )
            return
        self._arm_head_timer()  # a connection that never sends its request is closed too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        self._unset_keepalive_if_required()
        if self.in_head:
            # Counted before the parser sees them: httptools keeps a header's value until its line ends, so
            # a limit applied to what it hands over would come after the damage (memory, O(n^2) copies).
            self.head_bytes += len(data)
            if self.head_timer is None:
                self._arm_head_timer()  # the first byte of the next request on a keep-alive connection
        try:
            self.parser.feed_data(data)
            if self.in_head and self.head_bytes > self.limits.max_header_bytes:
                raise self._too_large()
        except _Refuse as e:
            self._refuse(e)
        except httptools.HttpParserUpgrade:
            pass  # no websockets (uvicorn ws="none"): the request went to the app as plain HTTP
        except httptools.HttpParserError as e:
            # A _Refuse raised in a parser callback arrives wrapped (HttpParserCallbackError, its context).
            cause = e.__context__
            self._refuse(
                cause
                if isinstance(cause, _Refuse)
                else _Refuse(400, "malformed", "http", f"malformed HTTP request: {e}")
            )

    def send_400_response(self, msg: str) -> None:
        self._refuse(_Refuse(400, "malformed", "http", f"malformed HTTP request: {msg}"))

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.in_head, self.head_exact, self.n_headers = True, 0, 0

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self.head_exact += len(url)
        if self.head_exact > self.limits.max_header_bytes:
            raise self._too_large()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.n_headers += 1
        self.head_exact += len(name) + len(value) + 4  # ": " and CRLF
        if self.n_headers > self.limits.max_headers:
            raise _Refuse(
                431,
                "header_count",
                "headers",
                f"more than serve.http.max_headers={self.limits.max_headers} header fields",
            )
        if self.head_exact > self.limits.max_header_bytes:
            raise self._too_large()
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self.in_head = False
        self.head_bytes = 0
        self._disarm_head_timer()
        before = self.cycle
        super().on_headers_complete()
        # HEAD: uvicorn writes no body at all, so a held head would never go out
        if self.cycle is not before and self.scope["method"] != "HEAD":
            self.cycle.transport = HeadWithBody(self.transport)

    def on_message_complete(self) -> None:
        self.in_head = True  # the next request's head starts here (its timer at its first byte)
        super().on_message_complete()

    def _too_large(self) -> _Refuse:
        return _Refuse(
            431,
            "header_bytes",
            "headers",
            f"request line and headers over serve.http.max_header_bytes={self.limits.max_header_bytes} bytes",
        )

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self.head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_timed_out(self) -> None:
        self.head_timer = None
        if self.refused or not self.in_head or self.transport.is_closing():
            return
        if self.head_bytes == 0 and (self.cycle is None or self.cycle.response_complete):
            # Nothing of a request arrived: an idle connection, closed without an answer nobody asked for.
            self.on_refused("header_timeout")
            self.transport.close()
            return
        self._refuse(
            _Refuse(
                408,
                "header_timeout",
                "headers",
                f"request headers not received within serve.http.header_timeout_s={self.limits.header_timeout_s:g} s",
            )
        )

    def _refuse(self, e: _Refuse, headers: dict[str, str] | None = None) -> None:
        """Answer `e` (JSON), stop reading requests from this connection and close it."""
        if self.refused or self.transport.is_closing():
            return
        self.refused = True
        self._disarm_head_timer()
        self.on_refused(e.reason)
        if self.cycle is not None and not self.cycle.response_complete:
            # A framing error inside a body: the application's cycle is told the client is gone (it writes
            # nothing more); a response already under way is cut, never interleaved with ours.
            self.cycle.disconnected = True
            self.cycle.message_event.set()
            if self.cycle.response_started:
                self.transport.close()
                return
        self.transport.write(raw_error(e.status, e.field, e.message, headers))
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        # A lingering close (as nginx's): closing with the client's bytes still unread sends a reset, which
        # can destroy the answer before the client reads it. So the write side is shut, what still arrives
        # is discarded unparsed, and the connection closes at the client's EOF or after LINGER_S.
        self.transport.write_eof()
        self.head_timer = self.loop.call_later(LINGER_S, self.transport.close)


def protocol_class(limits: HttpConfig, retry_after_s: int, on_refused=None) -> type[HttpToolsProtocol]:
    """The protocol class to hand uvicorn (`http=`), with these limits.

    Args:
        limits: serve.http.
        retry_after_s: the Retry-After of the 503 beyond max_connections (serve.retry_after_s).
        on_refused: called with the reason (REFUSED_REASONS) of every refusal, e.g. a metric's inc.
    Returns:
        A LimitedHttpToolsProtocol subclass.
    """
    attrs = {"limits": limits, "retry_after": str(retry_after_s)}
    if on_refused is not None:
        attrs["on_refused"] = staticmethod(on_refused)
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), attrs)
