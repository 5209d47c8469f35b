"""Suffix decoding through the real engine step: a real DraftWorker serving a SuffixProposer
(in process, no gRPC) drafts from each session's own text and from earlier finished sessions.
Greedy output is identical to plain decoding, repeated answers are drafted from the cache,
sampled output follows the target's joint distribution, and a proposer that fails changes
nothing (fail-open)."""
from collections import Counter

import pytest
from inproc import fails_after, run_sessions, target_joint_top2

from tandem.engine.generate import LocalGenerator
from tandem.engine.model_runner import ModelRunner
from tandem.proposers.suffix import SuffixConfig, SuffixProposer
from tandem.sampling_params import SamplingParams
from tandem.spec import Method

pytestmark = pytest.mark.integration
GREEDY = SamplingParams(temperature=0.0)


# Raises from its third step on: the worker reports INTERNAL for the sessions.
FailingSuffix = fails_after(SuffixProposer, 2, "suffix index corrupted")


@pytest.fixture(scope="module")
def chats(tokenizer):
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                             add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
               for t in ("Name three rivers.", "Why is the sky blue?",
                         "Repeat exactly: red green blue red green blue red green blue")]
    return prompts, (tokenizer.eos_token_id,)


def test_greedy_suffix_is_identical_to_plain_drafts_repeats_and_fails_open(target_model, chats):
    prompts, eos = chats
    plain = LocalGenerator(ModelRunner(target_model, 128, 16)).generate(
        [list(p) for p in prompts], GREEDY, 32, eos)
    # Nothing cached: only the sessions' own text drafts (the third prompt repeats itself).
    suffix = SuffixProposer()
    got, drafted, accepted, _ = run_sessions(target_model, {Method.SUFFIX: suffix},
                                             Method.SUFFIX, prompts, GREEDY, 32, stop=eos)
    assert got == plain and drafted > 0
    # The first two questions asked again: their earlier answers draft nearly everything.
    for p, out in zip(prompts[:2], plain[:2]):
        suffix.learn("", list(p) + out)
    got, drafted_again, accepted_again, _ = run_sessions(
        target_model, {Method.SUFFIX: suffix}, Method.SUFFIX, prompts[:2], GREEDY, 32, stop=eos)
    assert got == plain[:2]
    assert accepted_again >= 0.8 * drafted_again and accepted_again >= 32
    # The proposer raises mid-stream: sessions go on without drafts, text unchanged.
    failing = FailingSuffix()
    got, _, _, _ = run_sessions(target_model, {Method.SUFFIX: failing}, Method.SUFFIX,
                                prompts, GREEDY, 32, stop=eos)
    assert got == plain and failing.calls > 2


def test_sampled_suffix_follows_the_target_joint_distribution(target_model, tokenizer):
    """Top-k 2 at T=1: the joint of the first two tokens matches the target's, with one-hot
    suffix drafts (a cached continuation) accepted or rejected by the rejection sampler."""
    prompt = tokenizer.encode("My favourite colour is")
    sampling = SamplingParams(temperature=1.0, top_k=2)
    joint = target_joint_top2(target_model, prompt)
    # Cache the *less* likely pair as a finished answer, so drafts are often rejected.
    drafted_pair = min(joint, key=joint.get)
    suffix = SuffixProposer(SuffixConfig(spec_factor=1.0))
    suffix.learn("", list(prompt) + list(drafted_pair) + [13])
    n = 500
    got, drafted, accepted, _ = run_sessions(target_model, {Method.SUFFIX: suffix},
                                             Method.SUFFIX, [prompt] * n, sampling, 3, batch=8)
    counts = Counter(tuple(t[:2]) for t in got)
    assert set(counts) <= set(joint), set(counts) - set(joint)
    tv = 0.5 * sum(abs(counts[o] / n - p) for o, p in joint.items())
    # E[TV] for an exact sampler ~ sqrt(4 / (2 pi n)) = 0.036; 2.5x margin.
    assert tv < 0.09, f"TV {tv:.3f}"
    assert drafted > n // 4 and 0 < accepted < drafted  # drafts were verified, some rejected
    # The bar has power: always accepting the drafted pair would be far off.
    assert 1.0 - joint[drafted_pair] > 0.09
