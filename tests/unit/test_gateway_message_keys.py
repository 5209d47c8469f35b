"""Keys inside a `messages` item (or a content part) that the gateway does not read are
ignored, as vLLM ignores them: the prompt is the one without them (issue 48). Top-level
fields are another matter (tests/unit/test_gateway_fields.py: unknown ones are a 400), and
vLLM's `prompt_logprobs` is refused with a 400 that names it and says why."""
from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.schemas import ChatCompletionRequest, prompt_token_ids
from tandem.redis_server import start_redis

pytestmark = pytest.mark.unit
MODEL = "SmolLM2-135M-Instruct"
PLAIN = [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
         {"role": "assistant", "content": "Hello."},
         {"role": "user", "content": "Name a river."}]
# what clients send beside the keys read: OpenAI's response fields echoed back (refusal,
# annotations, audio), reasoning models' reasoning_content, Anthropic-style cache_control,
# a client's own bookkeeping
EXTRA = [{"role": "system", "content": "Be brief.", "cache_control": {"type": "ephemeral"}},
         {"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {}}],
          "id": "m-1", "timestamp": 1732760000},
         {"role": "assistant", "content": "Hello.", "refusal": None, "annotations": [],
          "audio": None, "reasoning_content": "The user greets.", "foo": {"bar": 1}},
         {"role": "user", "content": "Name a river.", "metadata": {"k": "v"}}]


@pytest.fixture(scope="module")
def client(tokenizer):
    with start_redis() as proc:
        config = GatewayConfig(redis_url=proc.url, redis_prefix="msgkeys", model_name=MODEL)
        app = create_app(config, redis=aioredis.Redis.from_url(proc.url), tokenizer=tokenizer)
        with TestClient(app) as c:
            yield c


def test_unknown_keys_in_messages_are_ignored(client, tokenizer):
    resp = client.post("/v1/chat/completions", json={"model": MODEL, "messages": EXTRA,
                                                     "max_tokens": 4})
    assert resp.status_code == 503, resp.text  # passed every check (no verifier runs here)
    plain = prompt_token_ids(ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": PLAIN}), tokenizer)
    extra = prompt_token_ids(ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": EXTRA}), tokenizer)
    assert extra == plain  # the same prompt: nothing of the ignored keys reaches it


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_prompt_logprobs_is_a_400_naming_it(client, path):
    body = ({"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path
            else {"prompt": "Hi"})
    resp = client.post(path, json={"model": MODEL, "max_tokens": 4, "prompt_logprobs": 1,
                                   **body})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "prompt_logprobs" and err["message"] == (
        "prompt_logprobs: not supported by this server (only its default null is accepted): "
        "the verifier computes no logprobs for prompt tokens"), err
    ok = client.post(path, json={"model": MODEL, "max_tokens": 4, "prompt_logprobs": None,
                                 **body})
    assert ok.status_code == 503, ok.text
