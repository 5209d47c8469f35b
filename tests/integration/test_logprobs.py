"""Logprobs from the verifier: the target's raw log-probabilities of the tokens it emits,
the same with speculation on or off (greedy), and matching a plain forward over the text."""
import pytest
import torch
from inproc import run_sessions

from tandem.engine.model_runner import ModelRunner, SeqChunk
from tandem.sampling_params import SamplingParams
from tandem.spec import Method

pytestmark = pytest.mark.integration

PROMPT = "List the days of the week: Monday, Tuesday,"


def _reference(model, prompt, generated, top):
    """log_softmax of one plain forward over prompt + generated, at each generated token."""
    ids = prompt + generated
    runner = ModelRunner(model, -(-len(ids) // 16) + 1, 16)
    logits = runner.forward([SeqChunk(ids, 0, list(range(runner.num_blocks)),
                                      num_logits=len(generated) + 1)])[:-1]
    lp = logits.float().log_softmax(-1)
    chosen = lp[torch.arange(len(generated)), torch.tensor(generated)]
    return chosen, lp.topk(top, dim=-1)


def _session_logprobs(model, method, proposers, prompt, sampling, top):
    rounds = []
    tokens, drafted, _, _ = run_sessions(model, proposers, method, [prompt], sampling, 20,
                                         logprobs=top, rounds=rounds)
    lps = [lp for out in rounds[0] for lp in out.logprobs]
    assert [lp.token_id for lp in lps] == tokens[0]  # one entry per token, in order
    return tokens[0], lps, drafted


@pytest.mark.parametrize("method", [Method.NONE, Method.NGRAM, Method.DRAFT_MODEL])
def test_logprobs_are_the_targets_with_and_without_speculation(target_model, tokenizer, method):
    from tandem.proposers.draft_model import DraftModelProposer
    from tandem.proposers.ngram import NgramProposer

    prompt = tokenizer(PROMPT).input_ids
    proposers = {Method.NGRAM: NgramProposer(),
                 Method.DRAFT_MODEL: DraftModelProposer(ModelRunner(target_model, 64, 16))}
    tokens, lps, drafted = _session_logprobs(target_model, method, proposers, prompt,
                                             SamplingParams(temperature=0.0), 3)
    # n-gram drafts are instant; the self-draft's arrive when the host keeps up (not asserted)
    assert method is not Method.NGRAM or drafted > 0
    chosen, (top_v, top_i) = _reference(target_model, prompt, tokens, 3)
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in lps]), chosen,
                               atol=1e-3, rtol=1e-4)
    assert [[t for t, _ in lp.top] for lp in lps] == top_i.tolist()
    torch.testing.assert_close(torch.tensor([[v for _, v in lp.top] for lp in lps]), top_v,
                               atol=1e-3, rtol=1e-4)
    # greedy: each token is its position's most likely one
    assert all(lp.token_id == lp.top[0][0] for lp in lps)


def test_sampled_tokens_get_raw_model_logprobs(target_model, tokenizer):
    """Sampled sessions (which would carry rows between rounds without logprobs) report the
    raw distribution's logprob, not the temperature-scaled one; top 0 gives no alternatives."""
    from tandem.proposers.ngram import NgramProposer

    prompt = tokenizer(PROMPT).input_ids
    tokens, lps, _ = _session_logprobs(target_model, Method.NGRAM,
                                       {Method.NGRAM: NgramProposer()}, prompt,
                                       SamplingParams(temperature=1.3, seed=11), 0)
    chosen, _ = _reference(target_model, prompt, tokens, 1)
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in lps]), chosen,
                               atol=1e-3, rtol=1e-4)
    assert all(lp.top == () for lp in lps)
