"""Gateway input validation: every bad request is a 400 (or 401) naming what was wrong.

No verifier exists here: a request that passes validation ends in 503, which is how the
tests tell "rejected by validation" from "accepted". A real redis-server backs the app.
"""
from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.app import create_app
from gateway.config import GatewayConfig
from tandem.redis_server import start_redis

pytestmark = pytest.mark.unit

MODEL = "SmolLM2-135M-Instruct"
CONTEXT = 64
KEYS = ("key-one", "key-two")


@pytest.fixture(scope="session")
def redis_proc():
    with start_redis() as proc:
        yield proc


@pytest.fixture(scope="module")
def client(redis_proc, tokenizer):
    config = GatewayConfig(redis_url=redis_proc.url, redis_prefix="validation",
                           api_keys=KEYS, model_name=MODEL, context_length=CONTEXT)
    app = create_app(config, redis=aioredis.Redis.from_url(redis_proc.url), tokenizer=tokenizer)
    with TestClient(app, headers={"Authorization": f"Bearer {KEYS[1]}"}) as c:
        yield c


def _completion(**kw) -> dict:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **kw}


def _chat(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            **kw}


def _assert_400(resp, *words: str) -> None:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    for w in words:
        assert w in err["message"], (w, err["message"])


BAD_COMPLETIONS = [
    ("missing prompt", {"model": MODEL}, ["prompt"]),
    ("empty prompt", _completion(prompt=""), ["prompt"]),
    ("empty prompt list", _completion(prompt=[]), ["prompt"]),
    ("batched prompts", _completion(prompt=["a", "b"]), ["prompt"]),
    ("token id out of vocab", _completion(prompt=[1, 10**7]), ["prompt"]),
    ("unknown model", _completion(model="gpt-4"), ["model", "gpt-4"]),
    ("prompt beyond context", _completion(prompt="word " * 200), ["prompt", "context"]),
    ("max_tokens 0", _completion(max_tokens=0), ["max_tokens"]),
    ("max_tokens negative", _completion(max_tokens=-3), ["max_tokens"]),
    ("prompt + max_tokens beyond context", _completion(max_tokens=CONTEXT), ["max_tokens",
                                                                             "context"]),
    ("temperature < 0", _completion(temperature=-0.5), ["temperature"]),
    ("temperature > 2", _completion(temperature=2.5), ["temperature"]),
    ("top_p 0", _completion(top_p=0), ["top_p"]),
    ("top_p > 1", _completion(top_p=1.5), ["top_p"]),
    ("top_k < 0", _completion(top_k=-1), ["top_k"]),
    ("unknown speculation method", _completion(speculation={"method": "lookahead"}),
     ["speculation.method"]),
    ("typical acceptance off medusa", _completion(speculation={
        "method": "ngram", "typical_acceptance": {}}), ["typical_acceptance", "medusa"]),
    ("posterior_threshold 0", _completion(speculation={
        "method": "medusa", "typical_acceptance": {"posterior_threshold": 0}}),
     ["posterior_threshold"]),
    ("posterior_alpha > 1", _completion(speculation={
        "method": "medusa", "typical_acceptance": {"posterior_alpha": 2.0}}),
     ["posterior_alpha"]),
    ("num_speculative_tokens > max", _completion(speculation={"num_speculative_tokens": 17}),
     ["speculation.num_speculative_tokens", "16"]),
    ("num_speculative_tokens < 0", _completion(speculation={"num_speculative_tokens": -1}),
     ["speculation.num_speculative_tokens"]),
    ("unknown speculation field", _completion(speculation={"k": 3}), ["speculation.k"]),
    ("tree for a chains-only method", _completion(speculation={
        "method": "ngram", "draft_shape": "tree"}), ["speculation.draft_shape", "eagle"]),
    ("unknown draft shape", _completion(speculation={"method": "eagle",
                                                     "draft_shape": "forest"}),
     ["speculation.draft_shape"]),
    ("n above 16", _completion(n=17), ["n", "16"]),
    ("n = 0", _completion(n=0), ["n"]),
    ("max_tokens as a string", _completion(max_tokens="10"), ["max_tokens"]),
    ("max_tokens as a float", _completion(max_tokens=1.5), ["max_tokens"]),
    ("temperature as a string", _completion(temperature="hot"), ["temperature"]),
    ("stream as a string", _completion(stream="yes"), ["stream"]),
    ("stop as a number", _completion(stop=5), ["stop"]),
    ("empty stop string", _completion(stop=[""]), ["stop"]),
    ("seed negative", _completion(seed=-1), ["seed"]),
    ("stop_token_ids out of vocab", _completion(stop_token_ids=[10**7]), ["stop_token_ids"]),
    ("logprobs above 20", _completion(logprobs=21), ["logprobs"]),
    ("logprobs negative", _completion(logprobs=-1), ["logprobs"]),
    ("logprobs as a bool", _completion(logprobs=True), ["logprobs"]),
    ("best_of below n", _completion(n=3, best_of=2), ["best_of", "n"]),
    ("best_of above n streamed", _completion(best_of=3, stream=True), ["best_of", "stream"]),
]


@pytest.mark.parametrize(("body", "words"), [c[1:] for c in BAD_COMPLETIONS],
                         ids=[c[0] for c in BAD_COMPLETIONS])
def test_bad_completion_is_400(client, body, words):
    _assert_400(client.post("/v1/completions", json=body), *words)


BAD_CHATS = [
    ("missing messages", {"model": MODEL}, ["messages"]),
    ("empty messages", _chat(messages=[]), ["messages"]),
    ("messages as a string", _chat(messages="hi"), ["messages"]),
    ("unknown role", _chat(messages=[{"role": "robot", "content": "x"}]), ["messages[0].role"]),
    ("image content", _chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), ["messages[0].content"]),
    ("user message without content", _chat(messages=[{"role": "user"}]),
     ["messages[0]", "content is required"]),
    ("system content null", _chat(messages=[{"role": "system", "content": None},
                                            {"role": "user", "content": "x"}]),
     ["messages[0]", "content is required"]),
    ("max_completion_tokens 0", _chat(max_completion_tokens=0), ["max_completion_tokens"]),
    ("max_completion_tokens beyond context", _chat(max_completion_tokens=CONTEXT),
     ["max_completion_tokens", "context"]),
    ("n = 17", _chat(n=17), ["n"]),
    ("top_p > 1", _chat(top_p=2), ["top_p"]),
    ("temperature as a bool", _chat(temperature=True), ["temperature"]),
]


@pytest.mark.parametrize(("body", "words"), [c[1:] for c in BAD_CHATS],
                         ids=[c[0] for c in BAD_CHATS])
def test_bad_chat_is_400(client, body, words):
    _assert_400(client.post("/v1/chat/completions", json=body), *words)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_malformed_json_is_400(client, path):
    resp = client.post(path, content=b'{"model": "x", "prompt": ',
                       headers={"Content-Type": "application/json"})
    _assert_400(resp, "malformed JSON")
    _assert_400(client.post(path, json=[1, 2]), "JSON object")


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
def test_non_finite_json_numbers_are_400(client, literal):
    """Python's JSON parser takes NaN and Infinity; no field may."""
    for field in (b"temperature", b"top_p", b"max_tokens", b"seed"):
        resp = client.post("/v1/completions", content=b'{"model": "%s", "prompt": "hi", '
                           b'"%s": %s}' % (MODEL.encode(), field, literal),
                           headers={"Content-Type": "application/json"})
        _assert_400(resp)


@pytest.mark.parametrize(("path", "body"), [("/v1/completions", _completion()),
                                            ("/v1/chat/completions", _chat())])
def test_valid_request_passes_validation_and_gets_503_without_verifiers(client, path, body):
    resp = client.post(path, json=body)
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["code"] == "no_verifier_available"
    stream = client.post(path, json={**body, "stream": True})
    assert stream.status_code == 503


def test_missing_or_wrong_api_key_is_401(client):
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer nope"},
                    {"Authorization": f"Basic {KEYS[0]}"}):
        resp = client.post("/v1/completions", json=_completion(), headers=headers)
        assert resp.status_code == 401, resp.text
        err = resp.json()["error"]
        assert err["code"] == "invalid_api_key" and "API key" in err["message"]
    assert client.get("/v1/models", headers={"Authorization": ""}).status_code == 401
    # the other configured key works too (it gets past auth to the 503)
    ok = client.post("/v1/completions", json=_completion(),
                     headers={"Authorization": f"Bearer {KEYS[0]}"})
    assert ok.status_code == 503


def test_health_needs_no_key_and_models_lists_the_target(client):
    health = client.get("/health", headers={"Authorization": ""})
    assert health.status_code == 200
    assert health.json()["status"] == "ok" and health.json()["redis"] == "ok"
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]


def test_unknown_route_is_an_openai_error(client):
    resp = client.get("/v1/nothing")
    assert resp.status_code == 404
    assert "message" in resp.json()["error"]


def test_config_rejects_bad_values():
    for kw in ({"port": -1}, {"rate_limit_rpm": -5}, {"context_length": 0},
               {"static_verifiers": ("nohost",)}, {"api_keys": ("a,b",)},
               {"request_timeout_s": 0}, {"redis_url": "http://x"},
               {"default_speculative_tokens": 20, "max_spec_tokens": 16}):
        with pytest.raises(ValueError):
            GatewayConfig(**kw)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12)
_FIELDS = ("model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
           "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n", "speculation",
           "logprobs", "top_logprobs", "user", "echo", "extra")


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       changes=st.dictionaries(st.sampled_from(_FIELDS), _JSON, min_size=1, max_size=3),
       message=st.dictionaries(st.sampled_from(["role", "content", "name", "x"]), _JSON,
                               max_size=3))
def test_any_json_body_is_a_4xx_or_the_no_verifier_503(client, path, changes, message):
    """Random field values (and message shapes) never end in a 500: a 400 with an OpenAI
    error naming the problem, or validation passes and the request meets no verifier."""
    body = _chat() if path.endswith("chat/completions") else _completion()
    body.update(changes)
    if message and path.endswith("chat/completions") and "messages" not in changes:
        body["messages"] = [message]
    resp = client.post(path, json=body)
    assert resp.status_code in (400, 503), (resp.status_code, body, resp.text[:300])
    err = resp.json()["error"]
    assert err["message"] and set(err) == {"message", "type", "param", "code"}
