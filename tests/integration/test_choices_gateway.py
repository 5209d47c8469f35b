"""n > 1 through the gateway on the real target (issue 48): with n = 4 at T = 0.8 the four
choices' first tokens are distributed as an n = 1 request's, which is the target's own
distribution at that temperature (computed here exactly); the choices of one request are
independent of each other; and the sampling controls sent by the official `openai` client
(vLLM's extensions in extra_body) are honoured by the verifier. A real verifier and draft
worker on loopback gRPC, Redis, the gateway app."""
from __future__ import annotations

import math
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from chi_square import chi_square
from inproc import gateway_cluster

from draft_service.config import DraftConfig
from kernels.sampling import logits_to_probs
from tandem.engine.model_runner import ModelRunner, SeqChunk
from verify_service.config import VerifierConfig

pytestmark = pytest.mark.integration
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "My favourite colour is"
T = 0.8
REQUESTS = 80  # n = 4 each: 320 first tokens


@pytest.fixture(scope="module")
def client(target_model, tokenizer):
    def verifier(draft_port):
        return VerifierConfig(kv_cache_mb=32, calibrate_reps=0, layer_skip="off", medusa="off",
                              draft_addresses=(f"127.0.0.1:{draft_port}",),
                              suffix_cache_tokens=0)

    with gateway_cluster(DraftConfig(port=0), verifier, target_model, tokenizer, MODEL) as c:
        yield c


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return tokenizer.encode(PROMPT, add_special_tokens=False)


@pytest.fixture(scope="module")
def first_token_dist(target_model, tokenizer, prompt_ids) -> dict[str, float]:
    """The target's distribution of the first token's text at T (no other control): n = 1's.
    By text, as logprobs name the tokens (ids that spell the same text are one outcome)."""
    logits = ModelRunner(target_model, 8, 16).forward(
        [SeqChunk(prompt_ids, 0, list(range(len(prompt_ids) // 16 + 1)))])
    probs = logits_to_probs(logits[-1:], torch.tensor([T]), torch.tensor([0]),
                            torch.tensor([1.0]))[0]
    dist: dict[str, float] = {}
    for t, p in enumerate(probs.tolist()):
        if p > 0:
            text = tokenizer.decode([t])
            dist[text] = dist.get(text, 0.0) + p
    return dist


def _first_tokens(client, prompt_ids, n: int, seed: int) -> list[str]:
    """Each choice's first token (seeded: choice i samples with choice_seed(seed, i))."""
    r = client.post("/v1/completions", json={
        "model": MODEL, "prompt": prompt_ids, "max_tokens": 1, "temperature": T, "n": n,
        "seed": seed, "logprobs": 0})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    return [c["logprobs"]["tokens"][0] for c in choices]


def test_n4_choices_are_distributed_as_n1_and_independent(client, prompt_ids,
                                                           first_token_dist):
    # seeded, so the test is deterministic: seeds 1000.. and the seeds derived per choice
    # (a token is the target's sample under noise keyed by seed and position, so asking 8 at
    # a time, as the verifier batches them, draws the same ones)
    with ThreadPoolExecutor(8) as pool:
        firsts = list(pool.map(lambda r: _first_tokens(client, prompt_ids, 4, 1000 + r),
                               range(REQUESTS)))
    pooled = Counter(t for row in firsts for t in row)
    stat, crit = chi_square(dict(pooled), first_token_dist)
    print(f"n=4 pooled first tokens: chi2 {stat:.2f} (0.1% critical {crit:.2f}), "
          f"{sum(pooled.values())} samples, top {pooled.most_common(5)}")
    assert stat < crit, (stat, crit, pooled.most_common(8))
    for i in range(4):  # each choice on its own, choice 0 (prefilled) and the cached ones
        stat_i, crit_i = chi_square(dict(Counter(row[i] for row in firsts)), first_token_dist)
        assert stat_i < crit_i, (i, stat_i, crit_i)
    # independent choices: two of one request agree with probability sum p^2
    agree = sum(row[0] == row[1] for row in firsts) + sum(row[2] == row[3] for row in firsts)
    p2 = sum(p * p for p in first_token_dist.values())
    mean, sd = 2 * REQUESTS * p2, math.sqrt(2 * REQUESTS * p2 * (1 - p2))
    assert abs(agree - mean) < 4.5 * sd, (agree, mean, sd)


# ---- the official client: every control it sends is honoured -------------------------------
TEXT = "The cat sat on the mat. The cat sat on the mat. The dog sat on the log."
REPEAT = [{"role": "user", "content": f"Repeat this text exactly, three times:\n\n{TEXT}"}]


@pytest.fixture(scope="module")
def oai(client):
    from openai import OpenAI

    return OpenAI(base_url=f"{client.base_url}/v1", api_key="unused", http_client=client,
                  max_retries=0)


def _chat(oai, method="none", messages=REPEAT, extra=None, **kw):
    """(text, token strings, usage) of a greedy chat; vLLM's fields go in extra_body."""
    kw = {"max_tokens": 24, "temperature": 0} | kw
    out = oai.chat.completions.create(
        model=MODEL, messages=messages, logprobs=True,
        extra_body={"speculation": {"method": method}} | (extra or {}), **kw)
    choice = out.choices[0]
    return choice.message.content, [c.token for c in choice.logprobs.content], out.usage


@pytest.fixture(scope="module")
def plain(oai):
    return _chat(oai)


def test_penalties_from_the_official_client_are_exact_under_speculation(oai, plain):
    penal = dict(frequency_penalty=0.5, presence_penalty=0.3, extra={"repetition_penalty": 1.2})
    want = _chat(oai, "none", **penal)
    assert want[0] != plain[0]  # the penalties change the text
    for method in ("auto", "suffix"):
        assert _chat(oai, method, **penal)[0] == want[0], method
    streamed = oai.chat.completions.create(
        model=MODEL, messages=REPEAT, max_tokens=24, temperature=0, stream=True,
        frequency_penalty=0.5, presence_penalty=0.3,
        extra_body={"repetition_penalty": 1.2, "speculation": {"method": "auto"}})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want[0]


def test_bans_and_biases_from_the_official_client(oai, plain, tokenizer):
    text, tokens, _ = plain
    assert " cat" in tokens
    cat = tokenizer.encode(" cat", add_special_tokens=False)
    first = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(tokens[0]))
    got = _chat(oai, "auto", logit_bias={str(first[0]): -100})[1]
    assert got[0] != tokens[0]  # logit_bias -100 on plain's first token
    got = _chat(oai, "auto", extra={"bad_words": ["cat"]})[1]
    assert " cat" not in got and "cat" not in got and " dog" in got
    allowed = sorted({*tokenizer.encode(TEXT, add_special_tokens=False), *cat})
    got = _chat(oai, "auto", extra={"allowed_token_ids": allowed})[1]
    spelled = {tokenizer.decode([t]) for t in allowed}
    assert set(got) <= spelled, set(got) - spelled


def test_lengths_from_the_official_client(oai):
    yes = [{"role": "user", "content": "Answer with one word: is water wet?"}]
    short = _chat(oai, messages=yes)[2].completion_tokens
    assert short < 10
    assert _chat(oai, "auto", messages=yes, extra={"min_tokens": 12})[2].completion_tokens >= 12
    assert _chat(oai, messages=REPEAT, max_completion_tokens=5)[2].completion_tokens == 5


def test_sampling_extensions_from_the_official_client_on_completions(oai):
    """top_k, min_p and a seed: the same text with and without speculation; stop kept."""
    outs = [oai.completions.create(
        model=MODEL, prompt=TEXT, max_tokens=16, temperature=0.9, seed=7,
        extra_body={"top_k": 20, "min_p": 0.05, "speculation": {"method": m}}).choices[0].text
        for m in ("none", "auto")]
    assert outs[0] == outs[1]
    kept = oai.completions.create(
        model=MODEL, prompt=TEXT, max_tokens=16, temperature=0, stop=[" sat"], echo=True,
        extra_body={"include_stop_str_in_output": True}).choices[0].text
    assert kept.startswith(TEXT) and kept.endswith(" sat")
