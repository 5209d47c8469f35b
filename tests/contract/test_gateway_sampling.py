"""The sampling controls on both endpoints, streamed or not, reach the verifier in the
GenerateRequest's SamplingParams; the text-side ones (stop strings kept, special tokens,
echo) shape what the client sees; the legacy functions become tools (issue 48)."""
from __future__ import annotations

import json

import pytest
from test_gateway import (
    EOS,
    MODEL,
    FakeVerifier,
    gateway,
    responses,
    sse_events,
    stream_text,
)

from gateway.sampling_options import bad_words_ids

pytestmark = pytest.mark.contract
CONTROLS = {"presence_penalty": 0.5, "frequency_penalty": -0.25, "repetition_penalty": 1.3,
            "min_p": 0.05, "min_tokens": 2, "logit_bias": {"42": 5.5, "7": -100},
            "allowed_token_ids": [7, 42, 99, EOS], "bad_words": ["world", " foo bar"]}




def speaking(ids: list[int]):
    """Streams `ids` (+ EOS), two tokens a round."""
    async def script(fake, request, context):
        full = ids + [EOS]
        for resp in responses([full[i:i + 2] for i in range(0, len(full), 2)]):
            yield resp
    return script


@pytest.fixture()
def verifier(loop_thread):
    made = []

    def make(ids: list[int]) -> FakeVerifier:
        fake = FakeVerifier(speaking(ids))
        loop_thread.run(fake.start())
        made.append(fake)
        return fake

    yield make
    for fake in made:
        loop_thread.run(fake.server.stop(None))


def _post(client, chat: bool, stream: bool, **body):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    resp = client.post(path, json={"model": MODEL, "max_tokens": 16, "stream": stream,
                                   **prompt, **body})
    assert resp.status_code == 200, resp.text
    if stream:
        return stream_text(sse_events(resp.text), chat)
    choice = resp.json()["choices"][0]
    return choice["message"]["content"] if chat else choice["text"]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_controls_reach_the_verifier(redis_proc, tokenizer, prefix, verifier, chat, stream):
    fake = verifier(tokenizer.encode(" ok", add_special_tokens=False))
    with gateway(redis_proc, tokenizer, prefix, static_verifiers=(fake.address,)) as client:
        assert _post(client, chat, stream, **CONTROLS) == " ok"
    s = fake.requests[0].sampling
    assert s.presence_penalty == pytest.approx(0.5)
    assert s.frequency_penalty == pytest.approx(-0.25)
    assert s.repetition_penalty == pytest.approx(1.3)
    assert s.min_p == pytest.approx(0.05) and s.min_tokens == 2
    assert dict(s.logit_bias) == {42: pytest.approx(5.5), 7: pytest.approx(-100)}
    assert list(s.allowed_token_ids) == [7, 42, 99, EOS]
    words = [tuple(w.token_ids) for w in s.bad_words]
    assert words == list(bad_words_ids(["world", " foo bar"], tokenizer))


def test_bad_words_are_tokenized_as_vllm_does(tokenizer):
    """Each word as it starts the text and, where that spells other tokens, after a space."""
    enc = lambda text: tuple(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    assert bad_words_ids(["world"], tokenizer) == (enc("world"), enc(" world"))
    assert enc("world") != enc(" world")
    # a leading space is stripped first, so " world" is the same two sequences
    assert bad_words_ids([" world"], tokenizer) == (enc("world"), enc(" world"))


def test_defaults_leave_the_controls_off(redis_proc, tokenizer, prefix, verifier):
    fake = verifier(tokenizer.encode(" ok", add_special_tokens=False))
    with gateway(redis_proc, tokenizer, prefix, static_verifiers=(fake.address,)) as client:
        _post(client, False, False)
    s = fake.requests[0].sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p,
            s.min_tokens) == (0, 0, 0, 0, 0)  # repetition_penalty 0: proto3's unset, off
    assert not s.logit_bias and not s.allowed_token_ids and not s.bad_words


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_kept_with_include_stop_str_in_output(redis_proc, tokenizer, prefix,
                                                          verifier, stream):
    fake = verifier(tokenizer.encode(" one two three four", add_special_tokens=False))
    with gateway(redis_proc, tokenizer, prefix, static_verifiers=(fake.address,)) as client:
        assert _post(client, False, stream, stop=" three") == " one two"
        assert _post(client, False, stream, stop=" three",
                     include_stop_str_in_output=True) == " one two three"


@pytest.mark.parametrize("stream", [False, True])
def test_special_tokens_shown_when_not_skipped(redis_proc, tokenizer, prefix, verifier, stream):
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    ids = tokenizer.encode(" a", add_special_tokens=False) + [special]
    fake = verifier(ids + tokenizer.encode(" b", add_special_tokens=False))
    with gateway(redis_proc, tokenizer, prefix, static_verifiers=(fake.address,)) as client:
        assert _post(client, True, stream) == " a b"
        assert _post(client, True, stream, skip_special_tokens=False) == " a<|im_start|> b"


@pytest.mark.parametrize("stream", [False, True])
def test_echo_puts_the_prompt_before_the_text(redis_proc, tokenizer, prefix, verifier, stream):
    fake = verifier(tokenizer.encode(" there", add_special_tokens=False))
    with gateway(redis_proc, tokenizer, prefix, static_verifiers=(fake.address,)) as client:
        assert _post(client, False, stream, echo=True) == "hi there"
        ids = tokenizer.encode("Hello", add_special_tokens=False)
        assert _post(client, False, stream, echo=True, prompt=ids) == "Hello there"
        # n = 2: each choice starts with the prompt
        resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "n": 2,
                                                    "echo": True, "stream": stream})
    if stream:
        texts = ["", ""]
        for ev in sse_events(resp.text):
            for c in ev["choices"]:
                texts[c["index"]] += c["text"]
    else:
        texts = [c["text"] for c in resp.json()["choices"]]
    assert texts == ["hi there", "hi there"]


def test_functions_are_served_as_tools(redis_proc, tokenizer, prefix, verifier):
    args = json.dumps({"city": "Oslo"})
    fake = verifier(tokenizer.encode(args, add_special_tokens=False))
    fn = {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    with gateway(redis_proc, tokenizer, prefix, static_verifiers=(fake.address,)) as client:
        resp = client.post("/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 32, "messages": [{"role": "user", "content": "w?"}],
            "functions": [fn], "function_call": {"name": "get_weather"}})
        both = client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "w?"}], "functions": [fn],
            "tools": [{"type": "function", "function": fn}]})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": args}
    assert fake.requests[0].HasField("grammar")  # the function's arguments constrain the text
    assert both.status_code == 400 and both.json()["error"]["param"] == "functions"


def test_a_legacy_function_turn_is_shown_as_a_tool_turn(redis_proc, tokenizer, prefix,
                                                        verifier):
    fake = verifier(tokenizer.encode(" ok", add_special_tokens=False))
    call = {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    legacy = [{"role": "user", "content": "w?"},
              {"role": "assistant", "content": None, "function_call": call},
              {"role": "function", "name": "get_weather", "content": "sunny"}]
    current = [{"role": "user", "content": "w?"},
               {"role": "assistant", "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": call}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    with gateway(redis_proc, tokenizer, prefix, static_verifiers=(fake.address,)) as client:
        for messages in (legacy, current):
            resp = client.post("/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 8, "messages": messages})
            assert resp.status_code == 200, resp.text
    old, new = (tuple(r.prompt_token_ids) for r in fake.requests)
    assert old == new and "Oslo" in tokenizer.decode(list(old))


@pytest.mark.parametrize("stream", [False, True])
def test_each_choice_reads_its_own_tool_call(redis_proc, tokenizer, prefix, verifier, stream):
    args = json.dumps({"city": "Oslo"})
    fake = verifier(tokenizer.encode(args, add_special_tokens=False))
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    with gateway(redis_proc, tokenizer, prefix, static_verifiers=(fake.address,)) as client:
        resp = client.post("/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 32, "messages": [{"role": "user", "content": "w?"}],
            "tools": [tool], "n": 2, "stream": stream,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert resp.status_code == 200, resp.text
    if not stream:
        choices = resp.json()["choices"]
        assert [c["index"] for c in choices] == [0, 1]
        for c in choices:
            assert c["finish_reason"] == "tool_calls"
            assert [t["function"] for t in c["message"]["tool_calls"]] == [
                {"name": "get_weather", "arguments": args}]
        return
    argued, finishes = ["", ""], {}
    for ev in sse_events(resp.text):
        for c in ev["choices"]:
            for delta in c["delta"].get("tool_calls") or ():
                argued[c["index"]] += delta["function"].get("arguments") or ""
            if c["finish_reason"]:
                finishes[c["index"]] = c["finish_reason"]
    assert argued == [args, args] and finishes == {0: "tool_calls", 1: "tool_calls"}
