"""Who may ask, and what is served: an optional shared secret, and the variant checked against a digest
held outside its directory.

The SHA-256 digests in variant.json sit beside the files they cover: they catch corruption, not
tampering (whoever can rewrite a file can rewrite its digest). `serve.expect_sha256` (`--expect-sha256`)
is the digest of variant.json itself, kept elsewhere (a deploy manifest, a CI log); variant.json holds
every artifact's digest, which the server verifies at start, so one external digest pins them all. The
server refuses to start when it does not match.

`serve.secret_env` names an environment variable holding a shared secret (never the secret itself: the
settings are written to files and logs); every request but GET /healthz (liveness probes, the process's
own start check) must then send `Authorization: Bearer <secret>`, else 401. Configured but unset or
empty, the server refuses to start. Without it the server warns when it binds beyond loopback: anyone who
reaches the port can query the model.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from pathlib import Path

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from reco.serve.config import ServeConfig
from reco.serve.connection import error_body
from reco.serve.features import ServeConfigError
from reco.variant import sha256_file

OPEN_PATHS = frozenset({"/healthz"})  # answered without the secret: liveness, not data


def check_expected_digest(variant_dir: str, cfg: ServeConfig) -> None:
    """Raise ServeConfigError naming serve.expect_sha256 when variant.json's digest is not the expected one."""
    if cfg.expect_sha256 is None:
        return
    manifest = Path(variant_dir) / "variant.json"
    got = sha256_file(manifest) if manifest.exists() else "(no variant.json)"
    if got != cfg.expect_sha256.lower():
        raise ServeConfigError(
            f"serve.expect_sha256 (--expect-sha256): {manifest} has SHA-256 {got}, expected "
            f"{cfg.expect_sha256.lower()}: not the variant this server was told to serve"
        )


def shared_secret(cfg: ServeConfig) -> bytes | None:
    """The shared secret from the environment variable serve.secret_env names, or None when it is off.

    Raises:
        ServeConfigError naming serve.secret_env when the variable is unset or empty.
    """
    if cfg.secret_env is None:
        return None
    value = os.environ.get(cfg.secret_env, "")
    if not value.strip():
        raise ServeConfigError(
            f"serve.secret_env={cfg.secret_env}: the environment variable is unset or empty (expected the "
            "shared secret clients send as `Authorization: Bearer <secret>`; or serve.secret_env=null)"
        )
    return value.encode()


def exposed_without_secret(cfg: ServeConfig) -> str | None:
    """A warning when the server binds beyond loopback without a shared secret, else None."""
    if cfg.secret_env is not None:
        return None
    try:
        loopback = ipaddress.ip_address(cfg.host).is_loopback
    except ValueError:
        loopback = cfg.host == "localhost"
    if loopback:
        return None
    return (
        f"serve.host={cfg.host} binds beyond loopback without serve.secret_env: anyone who reaches the "
        "port can query the model and read /metrics"
    )


class RequireSecret:
    """ASGI middleware: 401 unless `Authorization: Bearer <secret>` (compared in constant time)."""

    def __init__(self, app: ASGIApp, secret: bytes) -> None:
        self.app = app
        self.expected = b"Bearer " + secret

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            got = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(got, self.expected):
                body = error_body(
                    "authorization",
                    "missing or wrong shared secret: send `Authorization: Bearer <secret>` (serve.secret_env)",
                )
                resp = Response(body, 401, {"WWW-Authenticate": "Bearer"}, media_type="application/json")
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)
