"""An optional shared secret and the variant pinned by a digest held outside its directory (issue 48),
on real servers over real HTTP."""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import make_variant
from test_serve import Client, serve_settings

from reco.cli.serve import settings as cli_settings
from reco.config import ConfigError
from reco.serve.auth import exposed_without_secret
from reco.serve.process import ServerStartError, start_server
from reco.variant import sha256_file

pytestmark = pytest.mark.timeout(240)

ENV = "RECO_TEST_SERVE_SECRET"
BODY = json.dumps({"user_id": 7, "k": 3, "candidates": [5, 17, 300, 999, 42]}).encode()


def test_a_secret_guards_every_request_but_healthz_and_the_digest_pins_the_variant(
    tiny_data, tmp_path, monkeypatch
):
    vdir, dpath = make_variant(tiny_data, tmp_path, onnx=True)
    digest = sha256_file(vdir / "variant.json")
    monkeypatch.setenv(ENV, "s3cret")  # the server process inherits it
    cfg = serve_settings("keep_warm=false", f"secret_env={ENV}", f"expect_sha256={digest}")
    with start_server(vdir, dpath, cfg, work_dir=tmp_path / "srv") as h:
        c = Client(h.url)
        json_type = {"Content-Type": "application/json"}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            for method, path, body in (("POST", "/recommend", BODY), ("GET", "/metrics", None)):
                status, h_, data = c.request(method, path, body, {**json_type, **headers})
                assert status == 401 and h_["www-authenticate"] == "Bearer", (path, headers, data)
                assert json.loads(data)["field"] == "authorization"
        status, _, data = c.request(
            "POST", "/recommend", BODY, {**json_type, "Authorization": "Bearer s3cret"}
        )
        assert status == 200 and len(json.loads(data)["items"]) == 3
        assert c.request("GET", "/healthz")[0] == 200  # liveness stays open
        c.close()


@pytest.mark.parametrize(
    ("overrides", "env", "message"),
    [
        ([f"secret_env={ENV}"], "", rf"serve\.secret_env={ENV}: the environment variable is unset or empty"),
        (["expect_sha256=" + "0" * 64], "x", r"serve\.expect_sha256 \(--expect-sha256\): .* has SHA-256"),
    ],
)
def test_an_empty_secret_or_another_variant_stops_the_server(
    tiny_data, tmp_path, monkeypatch, overrides, env, message
):
    vdir, dpath = make_variant(tiny_data, tmp_path, onnx=True)
    monkeypatch.setenv(ENV, env)
    with pytest.raises(ServerStartError, match=message):
        start_server(vdir, dpath, serve_settings("keep_warm=false", *overrides), work_dir=tmp_path / "s")


def test_auth_settings_are_checked_and_an_exposed_server_warns():
    with pytest.raises(ConfigError, match=r"serve\.expect_sha256: expected 64 hex digits"):
        serve_settings("expect_sha256=abc")
    with pytest.raises(ConfigError, match=r"serve\.secret_env: expected the name of an environment variable"):
        serve_settings("secret_env='not a name'")
    with pytest.raises(ConfigError, match=r"only serve\.backend=reco checks them"):
        serve_settings("backend=triton", f"secret_env={ENV}")
    assert cli_settings([], expect_sha256="A" * 64).expect_sha256 == "A" * 64  # --expect-sha256
    cfg = serve_settings()
    assert exposed_without_secret(cfg) is None  # 127.0.0.1
    assert "0.0.0.0 binds beyond loopback" in exposed_without_secret(dataclasses.replace(cfg, host="0.0.0.0"))
    assert exposed_without_secret(dataclasses.replace(cfg, host="0.0.0.0", secret_env=ENV)) is None
