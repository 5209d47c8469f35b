"""No silent drops (issue 48): every request field OpenAI's chat and completions APIs and
vLLM's extensions define is honoured, accepted as a no-op, or refused with a 400 naming it.

No verifier runs here: a request that passes every check ends in 503, which is how the walk
tells "accepted" from "refused". docs/reference/api.md's table lists the same fields.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from fastapi.testclient import TestClient

from gateway import schemas
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.fields import DEFAULT_ONLY, NO_OP, known_fields
from tandem.redis_server import start_redis

pytestmark = pytest.mark.unit
MODEL = "SmolLM2-135M-Instruct"
OK, NO = "accepted", "refused"
FN = {"name": "f", "parameters": {"type": "object"}}
TOOL = {"type": "function", "function": FN}

# (field, a value that is not its default, answer); `with_` adds what the field needs.
BOTH = [
    ("model", MODEL, OK), ("max_tokens", 4, OK), ("temperature", 0.5, OK), ("top_p", 0.5, OK),
    ("seed", 1, OK), ("stop", ["x"], OK), ("stream", True, OK), ("n", 2, OK),
    ("presence_penalty", 0.5, OK), ("frequency_penalty", -0.5, OK),
    ("logit_bias", {"42": 3}, OK), ("response_format", {"type": "json_object"}, OK),
    ("stream_options", {"include_usage": True}, OK),
    # vLLM's sampling extras
    ("top_k", 5, OK), ("min_p", 0.1, OK), ("repetition_penalty", 1.1, OK),
    ("stop_token_ids", [5], OK), ("include_stop_str_in_output", True, OK),
    ("ignore_eos", True, OK), ("min_tokens", 1, OK), ("skip_special_tokens", False, OK),
    ("allowed_token_ids", [5, 6], OK), ("bad_words", ["xyz"], OK),
    ("structured_outputs", {"regex": "a+"}, OK), ("guided_json", {"type": "object"}, OK),
    ("guided_regex", "a+", OK), ("guided_choice", ["a", "b"], OK),
    ("guided_grammar", 'start: "a"', OK), ("speculation", {"method": "ngram"}, OK),
    # no-ops: who asks, what to keep, billing and scheduling hints
    ("user", "u-1", OK), ("metadata", {"k": "v"}, OK), ("store", True, OK),
    ("service_tier", "auto", OK), ("prompt_cache_key", "k", OK),
    ("safety_identifier", "s", OK), ("priority", 3, OK), ("request_id", "r-1", OK),
    ("cache_salt", "salt", OK), ("guided_decoding_backend", "xgrammar", OK),
    # default values of fields served only at their default
    ("use_beam_search", False, OK), ("length_penalty", 1.0, OK),
    ("spaces_between_special_tokens", True, OK), ("modalities", ["text"], OK),
    ("prompt_logprobs", None, OK),
    # ... and anything else
    ("use_beam_search", True, NO), ("length_penalty", 0.8, NO),
    ("spaces_between_special_tokens", False, NO), ("truncate_prompt_tokens", 8, NO),
    ("prompt_logprobs", 1, NO), ("return_tokens_as_token_ids", True, NO),
    ("return_token_ids", True, NO), ("logits_processors", ["x"], NO),
    ("vllm_xargs", {"a": 1}, NO), ("kv_transfer_params", {}, NO),
    ("structural_tag", "{}", NO), ("guided_whitespace_pattern", " ", NO),
    ("reasoning_effort", "low", NO), ("verbosity", "low", NO),
    ("web_search_options", {}, NO), ("audio", {"voice": "alloy", "format": "wav"}, NO),
    ("modalities", ["text", "audio"], NO), ("prompt_embeds", "AAAA", NO),
    ("temprature", 0.5, NO), ("foo", 1, NO),
]
CHAT = [
    ("max_completion_tokens", 4, OK), ("logprobs", True, OK), ("parallel_tool_calls", False, OK),
    ("tools", [TOOL], OK), ("functions", [FN], OK), ("echo", False, OK),
    ("add_generation_prompt", True, OK), ("continue_final_message", False, OK),
    ("add_special_tokens", False, OK),
    ("echo", True, NO), ("add_generation_prompt", False, NO),
    ("continue_final_message", True, NO), ("add_special_tokens", True, NO),
    ("documents", [{"text": "d"}], NO), ("chat_template", "{{ x }}", NO),
    ("chat_template_kwargs", {"enable_thinking": False}, NO),
    ("mm_processor_kwargs", {}, NO), ("best_of", 2, OK), ("suffix", "x", NO),
]
WITH = {"top_logprobs": {"logprobs": True}, "tool_choice": {"tools": [TOOL]},
        "function_call": {"functions": [FN]}}
CHAT += [("top_logprobs", 2, OK), ("tool_choice", "none", OK),
         ("function_call", {"name": "f"}, OK)]
COMPLETIONS = [
    ("prompt", "Hello", OK), ("best_of", 2, OK), ("echo", True, OK), ("logprobs", 2, OK),
    ("suffix", "", OK), ("add_special_tokens", True, OK),
    ("suffix", " and then", NO), ("add_special_tokens", False, NO),
    ("max_completion_tokens", 4, NO), ("tools", [TOOL], NO), ("functions", [FN], NO),
]

# Predicted Outputs (another change) adds `prediction`; walked once a model declares it.
for _model, _walk in ((schemas.ChatCompletionRequest, CHAT),
                      (schemas.CompletionRequest, COMPLETIONS)):
    if "prediction" in _model.model_fields:
        _walk.append(("prediction", {"type": "content", "content": "Hi"}, OK))


@pytest.fixture(scope="module")
def client(tokenizer):
    with start_redis() as proc:
        config = GatewayConfig(redis_url=proc.url, redis_prefix="fields", model_name=MODEL)
        app = create_app(config, redis=aioredis.Redis.from_url(proc.url), tokenizer=tokenizer)
        with TestClient(app) as c:
            yield c


def _body(chat: bool, name: str, value) -> dict:
    base = ({"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Hi"})
    return {"model": MODEL, "max_tokens": 4, **base, **WITH.get(name, {}), name: value}


def _check(client, chat: bool, name: str, value, answer: str) -> None:
    resp = client.post("/v1/chat/completions" if chat else "/v1/completions",
                       json=_body(chat, name, value))
    if answer == OK:
        assert resp.status_code == 503, (name, value, resp.text)  # passed every check
        return
    assert resp.status_code == 400, (name, value, resp.text)
    err = resp.json()["error"]
    assert err["param"] == name and name in err["message"], err
    if name not in DEFAULT_ONLY["chat" if chat else "completions"]:
        assert err["message"] == f"Unrecognized request argument supplied: {name}"


@pytest.mark.parametrize(("name", "value", "answer"), BOTH + CHAT,
                         ids=[f"{n}={v!r}" for n, v, _ in BOTH + CHAT])
def test_chat_field(client, name, value, answer):
    _check(client, True, name, value, answer)


@pytest.mark.parametrize(("name", "value", "answer"), BOTH + COMPLETIONS,
                         ids=[f"{n}={v!r}" for n, v, _ in BOTH + COMPLETIONS])
def test_completions_field(client, name, value, answer):
    _check(client, False, name, value, answer)


BAD_VALUES = [
    ("logit_bias", {"999999": 1}), ("logit_bias", {"x": 1}), ("logit_bias", {"5": 101}),
    ("logit_bias", {str(i): 1 for i in range(301)}), ("allowed_token_ids", []),
    ("allowed_token_ids", [10**7]), ("min_tokens", 5), ("presence_penalty", 2.5),
    ("frequency_penalty", -3), ("repetition_penalty", 0), ("min_p", 1.5), ("bad_words", [""]),
    ("n", 17), ("best_of", 17), ("n", 0), ("stream_options", {"continuous_usage_stats": True}),
    ("stream_options", {"include_usag": True}),
]


@pytest.mark.parametrize(("name", "value"), BAD_VALUES,
                         ids=[f"{n}={str(v)[:20]}" for n, v in BAD_VALUES])
def test_bad_values_are_400_naming_the_field(client, name, value):
    resp = client.post("/v1/completions", json=_body(False, name, value))
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"].startswith(name), resp.json()


def test_echo_with_logprobs_and_best_of_below_n_are_refused(client):
    for extra, param in (({"echo": True, "logprobs": 1}, "echo"),
                         ({"n": 3, "best_of": 2}, "best_of"),
                         ({"best_of": 3, "stream": True}, "best_of")):
        resp = client.post("/v1/completions", json={**_body(False, "model", MODEL), **extra})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_the_docs_table_names_every_field():
    text = (Path(__file__).parents[2] / "docs/reference/api.md").read_text()
    first_cells = re.findall(r"^\| (`[^|]+)\|", text, flags=re.M)
    documented = {name for cell in first_cells for name in re.findall(r"`([a-z_]+)`", cell)}
    fields = (known_fields(schemas.ChatCompletionRequest)
              | known_fields(schemas.CompletionRequest) | NO_OP
              | set(DEFAULT_ONLY["chat"]) | set(DEFAULT_ONLY["completions"]))
    assert fields - documented == set()
    walked = {n for n, _, _ in BOTH + CHAT + COMPLETIONS}
    assert fields - walked - {"messages"} == set()  # the walk covers them all too
