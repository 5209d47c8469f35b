"""API keys held as digests, keys files, per-key quotas: the real app against a real Redis.

A fake verifier (tests/contract/test_gateway.py's) streams a short text, so a request that
passes authentication and its quotas is a 200 with real `usage` numbers.
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import socket
import uuid

import pytest
import redis.asyncio as aioredis
from fastapi.testclient import TestClient
from test_gateway import MODEL, FakeVerifier, LoopThread, continue_text, make_app

from gateway.app import create_app
from gateway.auth import ApiKey, digest_of, load_keys_file, match_key, parse_keys_file
from gateway.config import GatewayConfig

pytestmark = pytest.mark.contract

SECRET = "sk-alpha-0123456789"
REPLY = "Hi there"  # what the fake verifier says
BODY = {"model": MODEL, "prompt": "x", "max_tokens": 5}


@pytest.fixture(scope="module")
def verifier(tokenizer):
    """One fake verifier for the module: every call streams the same two tokens + EOS."""
    loop = LoopThread()
    fake = FakeVerifier(continue_text(tokenizer.encode(REPLY, add_special_tokens=False)))
    loop.run(fake.start())
    yield fake.address
    loop.run(fake.server.stop(None))
    loop.close()


@pytest.fixture()
def prefix() -> str:
    return f"auth{uuid.uuid4().hex[:8]}"


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def app_for(redis_proc, tokenizer, prefix, verifier, **kw):
    return make_app(redis_proc, tokenizer, prefix, static_verifiers=(verifier,), **kw)


# ---- keys and the config ---------------------------------------------------------------------


def test_valid_keys_pass_and_others_get_401(redis_proc, tokenizer, prefix, verifier):
    keys = (SECRET, ApiKey(digest_of("sk-beta"), "beta"), "sha256:" + digest_of("sk-gamma"))
    with TestClient(app_for(redis_proc, tokenizer, prefix, verifier, api_keys=keys)) as client:
        for good in (SECRET, "sk-beta", "sk-gamma"):
            assert client.get("/v1/models", headers=bearer(good)).status_code == 200
        done = client.post("/v1/completions", json=BODY, headers=bearer(SECRET))
        assert done.status_code == 200 and done.json()["choices"][0]["text"] == REPLY
        for headers in (bearer("sk-wrong"), bearer(SECRET + "x"), bearer(digest_of(SECRET)),
                        bearer("sha256:" + digest_of(SECRET)), {"Authorization": SECRET},
                        {"Authorization": f"Basic {SECRET}"}, {}):
            resp = client.post("/v1/completions", json=BODY, headers=headers)
            assert resp.status_code == 401, headers
            assert resp.json()["error"]["type"] == "authentication_error"
            assert resp.headers["www-authenticate"] == "Bearer"


def test_the_config_keeps_digests_only():
    config = GatewayConfig(api_keys=(SECRET, "sk-second"), model_name=MODEL)
    assert all(isinstance(k, ApiKey) for k in config.api_keys)
    assert [k.digest for k in config.api_keys] == [digest_of(SECRET), digest_of("sk-second")]
    dumped = repr(config) + repr(dataclasses.asdict(config)) + repr(vars(config))
    assert SECRET not in dumped and "sk-second" not in dumped
    # rebuilding from the fields (as `tandem gateway` does) keeps the same keys
    again = GatewayConfig(**{**vars(config), "tokenizer_hash": "abc"})
    assert again.api_keys == config.api_keys
    assert dataclasses.replace(config, port=1).api_keys == config.api_keys
    assert config.auth_enabled and not GatewayConfig().auth_enabled


@pytest.mark.parametrize("keys, words", [
    (("a,b",), ["without commas"]), (("",), ["non-empty"]), (("a b",), ["spaces"]),
    ("single-string", ["not one string"]), (("same", "same"), ["same key"]),
    ((ApiKey("0" * 64, "x"), ApiKey("1" * 64, "x")), ["named 'x'"]),
])
def test_the_config_rejects_bad_keys(keys, words):
    with pytest.raises(ValueError) as exc:
        GatewayConfig(api_keys=keys)
    for w in words:
        assert w in str(exc.value)


def test_matching_compares_every_key(monkeypatch):
    import gateway.auth as auth

    keys = [ApiKey(digest_of(f"k{i}"), f"n{i}") for i in range(5)]
    calls = []
    real = auth.hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    assert match_key("k0", keys) is keys[0]
    assert match_key("k4", keys) is keys[4]
    assert match_key("nope", keys) is None
    assert len(calls) == 15  # no early exit, whichever key matched


# ---- keys files and `tandem keys hash` -----------------------------------------------------


def test_a_hashed_keys_file_works_end_to_end(redis_proc, tokenizer, prefix, verifier, tmp_path,
                                             monkeypatch, capsys):
    from tools.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO(SECRET + "\n"))
    assert main(["keys", "hash", "--name", "team-a", "--rpm", "7", "--tpm", "900"]) == 0
    line = capsys.readouterr().out.strip()
    assert line == f"sha256:{digest_of(SECRET)} team-a rpm=7 tpm=900" and SECRET not in line
    path = tmp_path / "keys.txt"
    path.write_text(f"# tandem API keys\n\n{line}\nsha256:{digest_of('sk-ops')}  # ops\n")
    keys = load_keys_file(path)
    assert [(k.name, k.rpm, k.tpm) for k in keys] == [("team-a", 7, 900),
                                                      (f"key-{digest_of('sk-ops')[:8]}", None, 0)]
    config = _cli_config(monkeypatch, tmp_path, path)
    assert config.api_keys == keys
    app = create_app(dataclasses.replace(config, redis_prefix=prefix,
                                         static_verifiers=(verifier,), model_name=MODEL),
                     redis=aioredis.Redis.from_url(redis_proc.url), tokenizer=tokenizer)
    with TestClient(app) as client:
        assert client.post("/v1/completions", json=BODY,
                           headers=bearer(SECRET)).status_code == 200
        assert client.get("/v1/models", headers=bearer("sk-ops")).status_code == 200
        assert client.get("/v1/models", headers=bearer("team-a")).status_code == 401


def _cli_config(monkeypatch, tmp_path, keys_file) -> GatewayConfig:
    """`tandem gateway` with TANDEM_API_KEYS_FILE set, as a Deployment would run it."""
    from gateway.cli import build_config, register

    monkeypatch.setenv("TANDEM_API_KEYS_FILE", str(keys_file))
    monkeypatch.delenv("TANDEM_API_KEYS", raising=False)
    parser = argparse.ArgumentParser(prog="tandem")
    register(parser.add_subparsers(dest="command"))
    return build_config(parser.parse_args(["gateway"]), "redis://127.0.0.1:1/0", tmp_path)


HEX = digest_of("sk-file")


@pytest.mark.parametrize("text, words", [
    ("sk-plain-key-in-the-file\n", ["line 1", "sha256:<64 hex digits>", "tandem keys hash"]),
    ("sha256:abc123\n", ["line 1", "64 hex"]),
    (f"\n# c\nsha256:{HEX} ops rpm=ten\n", ["line 3", "rpm must be a whole number", "'ten'"]),
    (f"sha256:{HEX} ops rpm=-1\n", ["rpm must be a whole number"]),
    (f"sha256:{HEX} burst=5\n", ["unknown option 'burst'", "rpm=N or tpm=N"]),
    (f"sha256:{HEX} tpm=1 tpm=2\n", ["tpm is given twice"]),
    (f"sha256:{HEX} one two\n", ["two names"]),
    (f"sha256:{HEX} bad/name\n", ["name 'bad/name'"]),
    (f"sha256:{HEX} a\nsha256:{HEX.upper()} b\n", ["'b' is the same key as 'a'"]),
    (f"sha256:{HEX} a\nsha256:{digest_of('x')} a\n", ["named 'a'"]),
    ("# nothing here\n\n", ["no API keys"]),
])
def test_keys_file_errors_are_clear(tmp_path, text, words):
    path = tmp_path / "keys.txt"
    path.write_text(text)
    with pytest.raises(ValueError) as exc:
        load_keys_file(path)
    message = str(exc.value)
    assert str(path) in message
    for w in words:
        assert w in message, (w, message)
    assert "sk-plain-key" not in message  # a plain key written by mistake is not echoed


def test_an_unreadable_keys_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read the API keys file"):
        load_keys_file(tmp_path / "missing.txt")
    assert parse_keys_file(f"sha256:{HEX}")[0].digest == HEX


# ---- per-key quotas ----------------------------------------------------------------------------


def test_per_key_rpm_overrides_the_global_limit(redis_proc, tokenizer, prefix, verifier):
    now = [1000.0]  # minute window [960, 1020): 20 s left
    keys = (ApiKey(digest_of("sk-a"), "a", rpm=1), ApiKey(digest_of("sk-b"), "b"),
            ApiKey(digest_of("sk-c"), "c", rpm=0))
    app = app_for(redis_proc, tokenizer, prefix, verifier, api_keys=keys, rate_limit_rpm=2,
                  clock=lambda: now[0])
    with TestClient(app) as client:
        def post(key):
            return client.post("/v1/completions", json=BODY, headers=bearer(key))

        assert post("sk-a").status_code == 200
        limited = post("sk-a")
        assert limited.status_code == 429 and limited.headers["retry-after"] == "20"
        err = limited.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
        assert "1 requests per minute" in err["message"]
        assert [post("sk-b").status_code for _ in range(3)] == [200, 200, 429]  # the global 2
        assert [post("sk-c").status_code for _ in range(4)] == [200] * 4  # rpm=0: unlimited
        now[0] = 1021.0
        assert post("sk-a").status_code == 200  # a new window


def test_per_key_token_quota(redis_proc, tokenizer, prefix, verifier):
    now = [2000.0]  # window [1980, 2040): 40 s left
    keys = (ApiKey(digest_of("sk-t"), "t", tpm=10), ApiKey(digest_of("sk-u"), "u", tpm=10))
    app = app_for(redis_proc, tokenizer, prefix, verifier, api_keys=keys, clock=lambda: now[0])
    with TestClient(app) as client:
        first = client.post("/v1/completions", json=BODY, headers=bearer("sk-t"))
        assert first.status_code == 200
        used = first.json()["usage"]["total_tokens"]
        reply_tokens = len(tokenizer.encode(REPLY, add_special_tokens=False)) + 1  # + EOS
        assert used == first.json()["usage"]["prompt_tokens"] + reply_tokens
        runs = 1
        while runs * used < 10:  # under the quota: still served
            assert client.post("/v1/completions", json=BODY,
                               headers=bearer("sk-t")).status_code == 200
            runs += 1
        over = client.post("/v1/completions", json=BODY, headers=bearer("sk-t"))
        assert over.status_code == 429 and over.headers["retry-after"] == "40"
        assert f"{runs * used} of 10 tokens per minute" in over.json()["error"]["message"]
        # another key is unaffected; a streamed answer is counted too
        streamed = client.post("/v1/completions", json={**BODY, "stream": True},
                               headers=bearer("sk-u"))
        assert streamed.status_code == 200 and "[DONE]" in streamed.text
        runs_u = 1
        while runs_u * used < 10:
            client.post("/v1/completions", json=BODY, headers=bearer("sk-u"))
            runs_u += 1
        assert client.post("/v1/completions", json=BODY,
                           headers=bearer("sk-u")).status_code == 429
        now[0] = 2041.0
        assert client.post("/v1/completions", json=BODY, headers=bearer("sk-t")).status_code \
            == 200


def test_quotas_fail_open_while_redis_is_down(tokenizer, verifier):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    config = GatewayConfig(redis_url=f"redis://127.0.0.1:{dead}/0", model_name=MODEL,
                           static_verifiers=(verifier,), redis_timeout_s=0.3,
                           api_keys=(ApiKey(digest_of("sk-q"), "q", rpm=1, tpm=1),))
    app = create_app(config, redis=aioredis.Redis(port=dead, socket_connect_timeout=0.1),
                     tokenizer=tokenizer)
    with TestClient(app) as client:
        for _ in range(3):
            assert client.post("/v1/completions", json=BODY,
                               headers=bearer("sk-q")).status_code == 200
        assert client.get("/v1/models", headers=bearer("sk-other")).status_code == 401
