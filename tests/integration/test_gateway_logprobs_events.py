"""logprobs / top_logprobs through the gateway, on both endpoints, streamed and not, and the
per-round speculation events: a real verifier and n-gram draft worker (gRPC on loopback),
Redis, the OpenAI shapes."""
import json

import pytest
from inproc import gateway_cluster

from draft_service.config import DraftConfig
from verify_service.config import VerifierConfig

pytestmark = pytest.mark.integration
MODEL = "SmolLM2-135M-Instruct"
CHAT = {"model": MODEL, "max_tokens": 16, "temperature": 0,
        "messages": [{"role": "user", "content": "Name the days of the week."}]}


@pytest.fixture(scope="module")
def client(target_model, tokenizer):
    def verifier(draft_port):
        return VerifierConfig(kv_cache_mb=32, calibrate_reps=0, layer_skip="off", medusa="off",
                              draft_addresses=(f"127.0.0.1:{draft_port}",))

    with gateway_cluster(DraftConfig(port=0), verifier, target_model, tokenizer, MODEL) as c:
        yield c


def _chat(client, method, **extra):
    r = client.post("/v1/chat/completions", json={**CHAT, **extra,
                                                  "speculation": {"method": method}})
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_logprobs_are_the_same_with_speculation_on_and_off(client):
    out = {m: _chat(client, m, logprobs=True, top_logprobs=2) for m in ("none", "ngram")}
    content = {m: b["choices"][0]["logprobs"]["content"] for m, b in out.items()}
    for m, entries in content.items():
        choice = out[m]["choices"][0]
        assert len(entries) == out[m]["usage"]["completion_tokens"]
        assert "".join(e["token"] for e in entries).strip() == choice["message"]["content"]
        for e in entries:
            assert e["bytes"] == list(e["token"].encode()) and e["logprob"] <= 0
            assert len(e["top_logprobs"]) == 2
            assert e["top_logprobs"][0]["token"] == e["token"]  # greedy: the top one
    assert [e["token"] for e in content["ngram"]] == [e["token"] for e in content["none"]]
    for a, b in zip(content["ngram"], content["none"]):
        assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-3)
    assert out["ngram"]["speculation"]["drafted_tokens"] > 0


def test_without_logprobs_the_field_is_null(client):
    assert _chat(client, "none")["choices"][0]["logprobs"] is None


def test_streamed_chunks_carry_their_tokens_logprobs(client):
    whole = _chat(client, "ngram", logprobs=True)["choices"][0]["logprobs"]["content"]
    with client.stream("POST", "/v1/chat/completions", json={
            **CHAT, "stream": True, "logprobs": True,
            "speculation": {"method": "ngram"}}) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    streamed = [e for c in chunks for ch in c["choices"] if ch["logprobs"]
                for e in ch["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in whole]
    assert all(e["top_logprobs"] == [] for e in streamed)


def test_completions_legacy_logprobs_shape(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "One, two, three,",
                                             "max_tokens": 8, "temperature": 0, "logprobs": 3})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    n = r.json()["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
    assert all(len(top) == 3 and tok in top for tok, top in zip(lp["tokens"], lp["top_logprobs"]))


@pytest.mark.parametrize("body,param", [
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({**CHAT, "logprobs": 1}, "logprobs"),
])
def test_bad_logprobs_requests_are_400_naming_the_field(client, body, param):
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_speculation_events_stream_one_chunk_per_round(client):
    with client.stream("POST", "/v1/chat/completions", json={
            **CHAT, "stream": True, "stream_options": {"include_usage": True},
            "speculation": {"method": "ngram", "events": True}}) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    rounds = [c["speculation_round"] for c in chunks if "speculation_round" in c]
    assert all(c["choices"] == [] for c in chunks if "speculation_round" in c)
    final = chunks[-1]
    assert [e["round"] for e in rounds] == sorted(e["round"] for e in rounds)
    assert sum(e["committed"] for e in rounds) == final["usage"]["completion_tokens"]
    assert sum(e["drafted"] for e in rounds) == final["speculation"]["drafted_tokens"]
    assert all(0 <= e["accepted"] <= e["drafted"] and e["verify_ms"] > 0 for e in rounds)
    # without asking, no such chunks
    with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        assert not any("speculation_round" in line for line in r.iter_lines())


def test_speculation_events_need_a_stream(client):
    r = client.post("/v1/chat/completions", json={**CHAT, "speculation": {"events": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculation.events"
