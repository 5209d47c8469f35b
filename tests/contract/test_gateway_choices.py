"""n > 1 and best_of against fake verifiers: one session per choice on the same verifier,
choice 0 first, seeds derived per choice, chunks interleaved by index, usage summed, and
best_of keeping the choices whose tokens are likeliest (issue 48)."""
from __future__ import annotations

import asyncio

import pytest
from test_gateway import (
    EOS,
    MODEL,
    STOP,
    FakeVerifier,
    chunked,
    gateway,
    make_app,
    sse_events,
    uvicorn_server,
    wait_for,
)

from gateway.sampling_options import choice_seed
from tandem.v1 import verify_pb2

pytestmark = pytest.mark.contract
WORDS = [" alpha", " bravo", " charlie", " delta"]
# Per-token logprob of each choice's text: best_of=4, n=2 keeps choices 1 then 2.
LOGPROB = [-3.0, -0.5, -1.0, -2.0]
REPEAT = 6  # each choice writes its word this often (two tokens a round)




@pytest.fixture()
def fakes(loop_thread):
    started: list[FakeVerifier] = []

    def make(script) -> FakeVerifier:
        fake = FakeVerifier(script)
        loop_thread.run(fake.start())
        started.append(fake)
        return fake

    yield make
    for fake in started:
        loop_thread.run(fake.server.stop(None))


def choice_of(request) -> int:
    head, _, tail = request.session_id.rpartition("-")
    return int(tail) if head.startswith(("cmpl-", "chatcmpl-")) and tail.isdigit() else 0


def by_choice(tokenizer, *, delay: float = 0.01):
    """Choice i writes WORDS[i] REPEAT times (two tokens a round), each token LOGPROB[i]."""
    async def script(fake, request, context):
        i = choice_of(request)
        ids = tokenizer.encode(WORDS[i] * REPEAT, add_special_tokens=False) + [EOS]
        total = 0
        rounds = chunked(ids, 2)
        for r, part in enumerate(rounds):
            await asyncio.sleep(delay)
            total += len(part)
            lps = [verify_pb2.TokenLogprob(token_id=t, logprob=LOGPROB[i]) for t in part]
            yield verify_pb2.GenerateResponse(
                token_ids=part, num_committed=total,
                totals=verify_pb2.SessionStats(rounds=r + 1, drafted_tokens=2 * (r + 1),
                                               accepted_tokens=r + 1),
                logprobs=lps if request.logprobs else [],
                finish_reason=STOP if r == len(rounds) - 1 else 0)
    return script


def tokens_of(tokenizer, i: int) -> int:
    return len(tokenizer.encode(WORDS[i] * REPEAT, add_special_tokens=False)) + 1


@pytest.mark.parametrize("chat", [False, True])
def test_n_returns_one_choice_per_index_with_summed_usage(redis_proc, tokenizer, prefix,
                                                          fakes, chat):
    fake = fakes(by_choice(tokenizer))
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = ({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    with gateway(redis_proc, tokenizer, prefix, static_verifiers=(fake.address,)) as client:
        resp = client.post(path, json={"model": MODEL, "max_tokens": 32, "n": 3, "seed": 11,
                                       **body})
    assert resp.status_code == 200, resp.text
    out = resp.json()
    texts = [c["message"]["content"] if chat else c["text"] for c in out["choices"]]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert texts == [w * REPEAT for w in WORDS[:3]]
    assert all(c["finish_reason"] == "stop" for c in out["choices"])
    assert all(c["logprobs"] is None for c in out["choices"])
    prompt = len(fake.requests[0].prompt_token_ids)
    completion = sum(tokens_of(tokenizer, i) for i in range(3))
    assert out["usage"] == {"prompt_tokens": prompt, "completion_tokens": completion,
                            "total_tokens": prompt + completion}  # the prompt counted once
    assert out["speculation"]["rounds"] == sum(-(-tokens_of(tokenizer, i) // 2)
                                               for i in range(3))
    # one session per choice, the same prompt, each with its own seed
    reqs = sorted(fake.requests, key=choice_of)
    assert [r.session_id for r in reqs] == [out["id"], f"{out['id']}-1", f"{out['id']}-2"]
    assert {tuple(r.prompt_token_ids) for r in reqs} == {tuple(reqs[0].prompt_token_ids)}
    assert [r.sampling.seed for r in reqs] == [choice_seed(11, i) for i in range(3)]
    assert reqs[0].sampling.seed == 11 and len({r.sampling.seed for r in reqs}) == 3


def test_choice_zero_is_admitted_before_the_others(redis_proc, tokenizer, prefix, fakes):
    """The others start once choice 0's first round is in (its prompt is then cached)."""
    seen: list[tuple[int, int]] = []  # (choice, rounds choice 0 had sent when it began)
    sent = [0]

    async def script(fake, request, context):
        seen.append((choice_of(request), sent[0]))
        async for resp in by_choice(tokenizer, delay=0.05)(fake, request, context):
            if choice_of(request) == 0:
                sent[0] += 1
            yield resp

    fake = fakes(script)
    with gateway(redis_proc, tokenizer, prefix, static_verifiers=(fake.address,)) as client:
        resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "n": 3,
                                                    "max_tokens": 32})
    assert resp.status_code == 200, resp.text
    assert seen[0] == (0, 0)
    assert sorted(c for c, _ in seen[1:]) == [1, 2] and all(s >= 1 for _, s in seen[1:])


def test_seeded_choices_are_reproducible_and_differ_from_each_other():
    seeds = [choice_seed(5, i) for i in range(16)]
    assert seeds == [choice_seed(5, i) for i in range(16)]
    assert seeds[0] == 5 and len(set(seeds)) == 16
    assert all(0 <= s < 2**63 for s in seeds)
    assert choice_seed(6, 1) != seeds[1] and choice_seed(None, 3) is None


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_choices_interleave_by_index_and_end_with_the_usage(
        redis_proc, tokenizer, prefix, fakes, chat):
    fake = fakes(by_choice(tokenizer))
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = ({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    with gateway(redis_proc, tokenizer, prefix, static_verifiers=(fake.address,)) as client:
        resp = client.post(path, json={"model": MODEL, "max_tokens": 32, "n": 3,
                                       "stream": True, "stream_options": {"include_usage": True},
                                       **body})
    assert resp.status_code == 200, resp.text
    events = sse_events(resp.text)
    texts, finishes = ["", "", ""], {}
    for ev in events[:-1]:
        (choice,) = ev["choices"]
        i = choice["index"]
        texts[i] += (choice["delta"].get("content") or "") if chat else choice["text"]
        if choice["finish_reason"]:
            finishes[i] = choice["finish_reason"]
    assert texts == [w * REPEAT for w in WORDS[:3]]
    assert finishes == {0: "stop", 1: "stop", 2: "stop"}
    order = [ev["choices"][0]["index"] for ev in events[:-1]]
    firsts = [order.index(i) for i in range(3)]
    lasts = [len(order) - 1 - order[::-1].index(i) for i in range(3)]
    assert max(firsts) < min(lasts)  # interleaved, not one choice after the other
    usage = events[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == sum(
        tokens_of(tokenizer, i) for i in range(3))


def test_best_of_keeps_the_choices_with_the_highest_logprob(redis_proc, tokenizer, prefix,
                                                            fakes):
    fake = fakes(by_choice(tokenizer))
    with gateway(redis_proc, tokenizer, prefix, static_verifiers=(fake.address,)) as client:
        resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                    "max_tokens": 32, "n": 2, "best_of": 4})
        shown = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                     "max_tokens": 32, "best_of": 4,
                                                     "logprobs": 0})
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert len(fake.requests) == 8 and all(r.logprobs for r in fake.requests)
    # LOGPROB: choice 1 best, then 2 (the sum over their tokens), re-indexed from 0
    assert [c["text"] for c in out["choices"]] == [WORDS[1] * REPEAT, WORDS[2] * REPEAT]
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in out["choices"])  # ranked by, not shown
    assert out["usage"]["completion_tokens"] == sum(tokens_of(tokenizer, i) for i in range(4))
    (best,) = shown.json()["choices"]
    assert best["text"] == WORDS[1] * REPEAT
    assert best["logprobs"]["token_logprobs"] == [LOGPROB[1]] * tokens_of(tokenizer, 1)


def test_a_client_that_leaves_cancels_every_choice(redis_proc, tokenizer, prefix, fakes):
    import httpx

    fake = fakes(by_choice(tokenizer, delay=0.2))
    app = make_app(redis_proc, tokenizer, prefix, static_verifiers=(fake.address,))
    with uvicorn_server(app) as base, httpx.Client(base_url=base, timeout=10) as http:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 32, "n": 3, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: {")
            assert wait_for(lambda: len(fake.requests) == 3)  # all three are running
        assert wait_for(lambda: fake.cancelled == 3), "a choice's call outlived its client"


def test_the_official_client_reads_n_choices(redis_proc, tokenizer, prefix, fakes):
    import openai

    fake = fakes(by_choice(tokenizer))
    app = make_app(redis_proc, tokenizer, prefix, static_verifiers=(fake.address,))
    with uvicorn_server(app) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=20)
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2, seed=3,
            presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"42": 1}, max_tokens=32)
        assert [c.message.content for c in chat.choices] == [w * REPEAT for w in WORDS[:2]]
        texts = ["", ""]
        for chunk in client.completions.create(model=MODEL, prompt="Hi", n=2, stream=True,
                                               max_tokens=32):
            for c in chunk.choices:
                texts[c.index] += c.text
        assert texts == [w * REPEAT for w in WORDS[:2]]


def test_prediction_counts_are_summed_over_the_choices(redis_proc, tokenizer, prefix, fakes):
    async def script(fake, request, context):
        async for resp in by_choice(tokenizer)(fake, request, context):
            resp.totals.accepted_prediction_tokens = 2
            resp.totals.rejected_prediction_tokens = 1
            yield resp

    fake = fakes(script)
    with gateway(redis_proc, tokenizer, prefix, static_verifiers=(fake.address,)) as client:
        resp = client.post("/v1/completions", json={
            "model": MODEL, "prompt": "hi", "max_tokens": 32, "n": 3,
            "prediction": {"type": "content", "content": WORDS[0] * REPEAT}})
    assert resp.status_code == 200, resp.text
    assert all(r.prediction_token_ids for r in fake.requests)
    assert resp.json()["usage"]["completion_tokens_details"] == {
        "accepted_prediction_tokens": 6, "rejected_prediction_tokens": 3}
