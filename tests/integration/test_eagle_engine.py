"""EAGLE through the real engine step: the verifier ships hidden states with its commits to a
real DraftWorker serving an EagleProposer (in process, no gRPC), which drafts from them.
Greedy output is identical to plain decoding; sampled output follows the target's joint
distribution; a draft that dies mid-stream changes nothing."""
from collections import Counter

import numpy as np
import pytest
from inproc import dear_verify, run_sessions, target_joint_top2

from tandem.engine.generate import LocalGenerator
from tandem.engine.model_runner import ModelRunner
from tandem.models import ModelPaths
from tandem.proposers.eagle import EagleProposer
from tandem.sampling_params import SamplingParams
from tandem.spec import Method

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def proposer(eagle_dir):
    return EagleProposer.load(ModelPaths(eagle_dir), 64 << 20, 16)


def run(target_model, proposer, prompts, sampling, max_new, die_after=None, stop=(),
        batch=64, cost=None):
    return run_sessions(target_model, {Method.EAGLE: proposer}, Method.EAGLE, prompts,
                        sampling, max_new, die_after, stop, batch, cost=cost)


def test_greedy_eagle_is_identical_to_plain_and_fails_open(target_model, tokenizer, proposer):
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                             add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
               for t in ("Name three rivers.", "Why is the sky blue?", "Count to ten.")]
    greedy = SamplingParams(temperature=0.0)
    eos = (tokenizer.eos_token_id,)
    plain = LocalGenerator(ModelRunner(target_model, 128, 16)).generate(
        [list(p) for p in prompts], greedy, 24, eos)
    got, drafted, accepted, link = run(target_model, proposer, prompts, greedy, 24, stop=eos)
    assert got == plain
    assert drafted > 0 and link.features_rows >= sum(len(p) for p in prompts)
    # The draft worker dies after a few proposals: the output does not change.
    got, _, _, link = run(target_model, proposer, prompts, greedy, 24, die_after=5, stop=eos)
    assert got == plain and not link.alive


@pytest.mark.parametrize("batch,chunk", [(1, 0), (3, 16)])
def test_eagle_takes_prefix_cache_hits_and_chunks_with_kept_features(target_model, tokenizer,
                                                                     proposer, batch, chunk):
    """A verifier that keeps features: EAGLE prompts sharing a system prompt are served from
    the prefix cache (batch 1: each after the last) or computed in chunks beside decoding
    sessions (batch 3), and the draft still gets every position's features: the same text
    as plain decoding, the same acceptance as with every prompt computed whole."""
    system = "You are a terse assistant. Answer in one short sentence, no lists, no preamble."
    prompts = [tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": t}],
        add_generation_prompt=True, tokenize=True, return_dict=False)
        for t in ("Name three rivers.", "Why is the sky blue?", "Count to ten.")]
    greedy, eos = SamplingParams(temperature=0.0), (tokenizer.eos_token_id,)
    plain = LocalGenerator(ModelRunner(target_model, 128, 16)).generate(
        [list(p) for p in prompts], greedy, 16, eos)
    whole, fwd_whole = [], []
    want = run_sessions(target_model, {Method.EAGLE: proposer}, Method.EAGLE, prompts, greedy,
                        16, stop=eos, batch=batch, forwarded=whole)
    got = run_sessions(target_model, {Method.EAGLE: proposer}, Method.EAGLE, prompts, greedy,
                       16, stop=eos, batch=batch, prefill_chunk_tokens=chunk,
                       features_cached=True, forwarded=fwd_whole)
    assert want[0] == got[0] == plain
    assert got[2] > 0  # drafts accepted
    for i, p in enumerate(prompts):  # every prompt position's features, the same values
        sent = [got[3].features[f"s{i}"].get(j) for j in range(len(p))]
        assert None not in sent
        ref = [want[3].features[f"s{i}"][j] for j in range(len(p))]
        a, b = (np.frombuffer(b"".join(x), np.float16).astype(np.float32) for x in (sent, ref))
        np.testing.assert_allclose(a, b, atol=0.02, rtol=0.02)
    if chunk:  # a prompt beside decoding sessions went in pieces of at most `chunk` tokens
        assert max(fwd_whole) < max(whole)
    else:  # the shared system prompt was computed once: prefill forwards (the ones longer
        # than a decode round's k + 1 <= 5 tokens; how many drafts the rounds verify varies
        # with the drafts' arrival, and would drown the saving) hold a block less per prompt
        def prefilled(fwd):
            return sum(t for t in fwd if t > 5)

        assert prefilled(fwd_whole) <= prefilled(whole) - 16 * (len(prompts) - 1)


def test_sampled_eagle_follows_the_target_joint_distribution(target_model, tokenizer,
                                                             proposer):
    """Top-k 2: the joint of the first two tokens (4 outcomes) matches the target's. Three
    tokens are generated because a session's last token is never drafted (no room)."""
    prompt = tokenizer.encode("My favourite colour is")
    sampling = SamplingParams(temperature=1.0, top_k=2)
    joint = target_joint_top2(target_model, prompt)
    n = 600
    # Unseeded: rounds go through the rejection sampler with the head's sparse q (seeded ones
    # match keyed samples instead, tests/integration/test_verifier_engine.py); small batches
    # leave room to speculate; verification made dear, so no chain is priced out by its wait.
    got, drafted, accepted, _ = run(target_model, proposer, [prompt] * n, sampling, 3, batch=8,
                                    cost=dear_verify())
    counts = Counter(tuple(t[:2]) for t in got)
    assert set(counts) <= set(joint), set(counts) - set(joint)
    tv = 0.5 * sum(abs(counts[o] / n - p) for o, p in joint.items())
    # E[TV] for an exact sampler ~ sqrt(4 / (2 pi n)) = 0.033; 2.7x margin.
    assert tv < 0.09, f"TV {tv:.3f}"
    assert drafted > n // 4 and accepted < drafted  # drafts were verified, some rejected


# Verification made dear at every size (dear_verify), so the cost model never finds a tree too
# expensive next to its drafting wait: every round verifies the whole tree that arrived.


def test_eagle_trees_are_identical_to_plain_greedy_and_seeded(target_model, tokenizer,
                                                              proposer):
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                             add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
               for t in ("Name three rivers.", "Why is the sky blue?")]
    eos = (tokenizer.eos_token_id,)
    greedy = SamplingParams(temperature=0.0)
    plain = LocalGenerator(ModelRunner(target_model, 128, 16)).generate(
        [list(p) for p in prompts], greedy, 24, eos)
    got, drafted, accepted, link = run_sessions(
        target_model, {Method.EAGLE: proposer}, Method.EAGLE, prompts, greedy, 24, stop=eos,
        batch=1, max_spec_tokens=8, cost=dear_verify(), tree=True)
    assert got == plain
    assert link.siblings > 0 and drafted > 0 and accepted > 0  # trees really verified
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=5)
    want, *_ = run_sessions(target_model, {Method.EAGLE: proposer}, Method.NONE, prompts,
                            seeded, 24, stop=eos)
    got, drafted, accepted, link = run_sessions(
        target_model, {Method.EAGLE: proposer}, Method.EAGLE, prompts, seeded, 24, stop=eos,
        batch=1, max_spec_tokens=8, cost=dear_verify(), tree=True)
    assert got == want and link.siblings > 0 and accepted > 0


def test_sampled_eagle_trees_follow_the_target_joint_distribution(target_model, tokenizer,
                                                                  proposer):
    """As the chain test above, through recursive rejection over a tree's siblings."""
    prompt = tokenizer.encode("My favourite colour is")
    sampling = SamplingParams(temperature=1.0, top_k=2)
    joint = target_joint_top2(target_model, prompt)
    n = 400
    got, drafted, accepted, link = run_sessions(
        target_model, {Method.EAGLE: proposer}, Method.EAGLE, [prompt] * n, sampling, 3,
        batch=8, cost=dear_verify(), tree=True)
    counts = Counter(tuple(t[:2]) for t in got)
    assert set(counts) <= set(joint), set(counts) - set(joint)
    tv = 0.5 * sum(abs(counts[o] / n - p) for o, p in joint.items())
    assert tv < 0.1, f"TV {tv:.3f}"  # E[TV] of an exact sampler ~ 0.04 at n = 400
    assert link.siblings > n // 4 and drafted > n // 4 and accepted < drafted
