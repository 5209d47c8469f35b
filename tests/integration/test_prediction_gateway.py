"""Predicted Outputs through the gateway (gateway/prediction.py): a real verifier and draft
worker (gRPC on loopback), Redis, the OpenAI shapes. The text is the plain text; a prediction
that is the answer is mostly accepted and reported in usage.completion_tokens_details,
streamed (the usage chunk) and not, on both endpoints; bad shapes are 400s naming it."""
import json

import pytest
from inproc import gateway_cluster

from draft_service.config import DraftConfig
from verify_service.config import VerifierConfig

pytestmark = pytest.mark.integration
MODEL = "SmolLM2-135M-Instruct"
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
CHAT = {"model": MODEL, "max_tokens": 48, "temperature": 0,
        "messages": [{"role": "user", "content": f"Repeat this code exactly:\n\n{CODE}"}]}


@pytest.fixture(scope="module")
def client(target_model, tokenizer):
    def verifier(draft_port):
        # no suffix cache of earlier answers: the reference runs would teach it the answers
        return VerifierConfig(kv_cache_mb=32, calibrate_reps=0, layer_skip="off", medusa="off",
                              draft_addresses=(f"127.0.0.1:{draft_port}",),
                              suffix_cache_tokens=0)

    with gateway_cluster(DraftConfig(port=0), verifier, target_model, tokenizer, MODEL) as c:
        yield c


def _post(client, path, body):
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def plain(client):
    return _post(client, "/v1/chat/completions", {**CHAT, "speculation": {"method": "none"}})


@pytest.fixture(scope="module")
def poem(client):
    """A chat whose answer is nowhere in its prompt: only the prediction can draft it."""
    body = {**CHAT, "messages": [{"role": "user", "content": "Write a short poem about the sea."}]}
    out = _post(client, "/v1/chat/completions", {**body, "speculation": {"method": "none"}})
    return body, out


@pytest.mark.parametrize("method", ["none", "auto"])
def test_a_prediction_of_the_answer_is_accepted_and_reported(client, poem, method):
    body, plain = poem
    text = plain["choices"][0]["message"]["content"]
    assert "completion_tokens_details" not in plain["usage"]  # no prediction: as before
    for content in (text, [{"type": "text", "text": text[:20]}, {"type": "text",
                                                                  "text": text[20:]}]):
        got = _post(client, "/v1/chat/completions", {
            **body, "speculation": {"method": method},
            "prediction": {"type": "content", "content": content}})
        assert got["choices"][0]["message"]["content"] == text
        details = got["usage"]["completion_tokens_details"]
        took, n = details["accepted_prediction_tokens"], got["usage"]["completion_tokens"]
        assert details["rejected_prediction_tokens"] >= 0
        assert got["speculation"]["accepted_tokens"] >= took >= 0.6 * n, details


def test_auto_takes_suffix_or_the_prediction_whichever_promises_more(client, plain):
    """The code is in the prompt too: suffix and the prediction both match; each round auto
    takes one, and most of the answer is drafted either way."""
    text = plain["choices"][0]["message"]["content"]
    got = _post(client, "/v1/chat/completions", {
        **CHAT, "speculation": {"method": "auto"},
        "prediction": {"type": "content", "content": text}})
    assert got["choices"][0]["message"]["content"] == text
    assert got["speculation"]["accepted_tokens"] >= 0.6 * got["usage"]["completion_tokens"]
    assert "accepted_prediction_tokens" in got["usage"]["completion_tokens_details"]


def test_streamed_usage_reports_the_prediction(client, plain):
    text = plain["choices"][0]["message"]["content"]
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True},
            "speculation": {"method": "none"},
            "prediction": {"type": "content", "content": text.replace("sub", "mul")}}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    streamed = "".join(c["choices"][0]["delta"].get("content") or ""
                       for c in chunks if c["choices"])
    assert streamed == text
    usage = chunks[-1]["usage"]
    details = usage["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 0.4 * usage["completion_tokens"]
    assert details["rejected_prediction_tokens"] > 0  # "mul" where the answer says "sub"


def test_completions_take_a_prediction_too(client):
    body = {"model": MODEL, "prompt": f"{CODE}\n{CODE}", "max_tokens": 24, "temperature": 0}
    plain = _post(client, "/v1/completions", {**body, "speculation": {"method": "none"}})
    text = plain["choices"][0]["text"]
    got = _post(client, "/v1/completions", {
        **body, "speculation": {"method": "none"},
        "prediction": {"type": "content", "content": text}})
    assert got["choices"][0]["text"] == text
    assert got["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0


@pytest.mark.parametrize("prediction", [
    "just a string", {"content": "no type"}, {"type": "text", "content": "wrong type"},
    {"type": "content"}, {"type": "content", "content": 42},
    {"type": "content", "content": [{"type": "image_url", "image_url": "x"}]},
    {"type": "content", "content": [{"text": "no type"}]},
    {"type": "content", "content": "x", "extra": 1}])
def test_bad_prediction_shapes_are_400s_naming_it(client, prediction):
    r = client.post("/v1/chat/completions", json={**CHAT, "prediction": prediction})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("prediction"), r.json()


def test_a_prediction_longer_than_the_context_is_a_400(client):
    r = client.post("/v1/chat/completions", json={
        **CHAT, "prediction": {"type": "content", "content": "word " * 9000}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prediction" and err["code"] == "context_length_exceeded"
