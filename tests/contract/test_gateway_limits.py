"""The gateway's request body limit: a larger body is 413 in OpenAI's error format, whether its
size is declared (Content-Length) or only found while reading it (chunked), before auth and
parsing; smaller ones go on as usual and the app keeps serving.

No verifier exists here: a request that passes every check ends in 503, which is how these
tests tell "accepted" from "refused". A real redis-server backs the app.
"""
from __future__ import annotations

import argparse
import json

import pytest
import redis.asyncio as aioredis
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.config import GatewayConfig
from tandem.redis_server import start_redis

pytestmark = pytest.mark.contract

MODEL = "SmolLM2-135M-Instruct"
LIMIT = 2048
KEY = "sk-limits"


@pytest.fixture(scope="module")
def client(tokenizer):
    with start_redis() as proc:
        config = GatewayConfig(redis_url=proc.url, redis_prefix="limits", model_name=MODEL,
                               api_keys=(KEY,), max_request_bytes=LIMIT)
        app = create_app(config, redis=aioredis.Redis.from_url(proc.url), tokenizer=tokenizer)
        with TestClient(app, headers={"Authorization": f"Bearer {KEY}"}) as c:
            yield c


def body(size: int) -> bytes:
    """A valid completion request of exactly `size` bytes (padded inside the prompt)."""
    base = {"model": MODEL, "prompt": "", "max_tokens": 4}
    pad = size - len(json.dumps(base).encode())
    assert pad >= 0
    return json.dumps({**base, "prompt": "a" * pad}).encode()


def assert_413(resp) -> None:
    assert resp.status_code == 413, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] == "request_too_large"
    assert str(LIMIT) in err["message"]


def test_a_body_at_the_limit_is_served(client):
    resp = client.post("/v1/completions", content=body(LIMIT),
                       headers={"Content-Type": "application/json"})
    assert resp.status_code == 503, resp.text  # passed every check; no verifier to run it


def test_a_declared_oversize_body_is_413_and_the_gateway_keeps_serving(client):
    assert_413(client.post("/v1/completions", content=body(LIMIT + 1)))
    assert_413(client.post("/v1/chat/completions", content=b"x" * (10 * LIMIT)))
    assert client.post("/v1/completions", content=b"{").status_code == 400  # parsed again
    assert client.post("/v1/completions", content=body(100)).status_code == 503


def test_a_chunked_oversize_body_is_413(client):
    def chunks():  # no Content-Length: counted while it is read
        for _ in range(8):
            yield b"x" * (LIMIT // 4)

    assert_413(client.post("/v1/completions", content=chunks()))
    small = iter([body(200)])
    assert client.post("/v1/completions", content=small).status_code == 503


def test_the_limit_comes_before_authentication(client):
    resp = client.post("/v1/completions", content=body(LIMIT + 1),
                       headers={"Authorization": "Bearer wrong"})
    assert_413(resp)
    resp = client.post("/v1/completions", content=body(100),
                       headers={"Authorization": "Bearer wrong"})
    assert resp.status_code == 401


def test_the_limit_is_configured_by_flag_or_environment(monkeypatch, tmp_path):
    from gateway.cli import build_config, register

    parser = argparse.ArgumentParser(prog="tandem")
    register(parser.add_subparsers(dest="command"))
    monkeypatch.delenv("TANDEM_GATEWAY_MAX_REQUEST_BYTES", raising=False)
    default = build_config(parser.parse_args(["gateway"]), "redis://x:1/0", tmp_path)
    assert default.max_request_bytes == GatewayConfig.max_request_bytes == 4 << 20
    args = parser.parse_args(["gateway", "--max-request-bytes", "65536"])
    assert build_config(args, "redis://x:1/0", tmp_path).max_request_bytes == 65536
    monkeypatch.setenv("TANDEM_GATEWAY_MAX_REQUEST_BYTES", "1000")
    parser = argparse.ArgumentParser(prog="tandem")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["gateway"])
    assert build_config(args, "redis://x:1/0", tmp_path).max_request_bytes == 1000
    with pytest.raises(ValueError, match="max_request_bytes"):
        GatewayConfig(max_request_bytes=0)


@pytest.mark.parametrize("raw", [b"[" * 1500, b'{"prompt": ' + b"[" * 1500,
                                 b'{"messages": [' + b"[" * 1500 + b"]" * 100])
def test_deeply_nested_json_is_400_not_500(client, raw):
    resp = client.post("/v1/completions", content=raw,
                       headers={"Content-Type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert "nested" in resp.json()["error"]["message"]
    assert client.post("/v1/completions", content=body(256),
                       headers={"Content-Type": "application/json"}).status_code == 503
