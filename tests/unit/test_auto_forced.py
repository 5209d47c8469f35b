"""Grammar-forced drafts (verify_service/policy/auto.py grammar_forced): a proposal that
already starts with the forced tokens keeps its drafts, with q one-hot at the forced
positions (the round verifies the forced token there whatever was sampled)."""
from types import SimpleNamespace

import pytest

from tandem.sampling_params import SamplingParams
from tandem.spec import DraftToken, Method
from verify_service.policy import auto
from verify_service.session.params import GenerateParams
from verify_service.session.sequence import Sequence

pytestmark = pytest.mark.unit


def _seq(forced: list[int]) -> Sequence:
    seq = Sequence(GenerateParams(session_id="s", prompt=(1, 2, 3), committed=(),
                                  sampling=SamplingParams(temperature=1.0), max_new_tokens=64,
                                  stop_token_ids=frozenset(), method=Method.AUTO))
    seq.grammar = SimpleNamespace(forced=forced)
    return seq


def sampled(token: int) -> DraftToken:
    return DraftToken(token, (token, token + 1), (0.6, 0.4))


def test_a_chain_that_starts_with_the_forced_tokens_gets_one_hot_q_there():
    seq = _seq([5, 6])
    seq.take_drafts([sampled(5), sampled(6), sampled(7)], None, [0.9, 0.8, 0.5])
    auto.grammar_forced(seq, 8)
    assert [d.token_id for d in seq.drafts] == [5, 6, 7]
    assert [d.q_ids for d in seq.drafts] == [(), (), (7, 8)]  # the worker's q after them
    assert seq.draft_reach == [0.9, 0.8, 0.5]


def test_a_chain_that_does_not_start_with_them_is_replaced():
    seq = _seq([5, 6])
    seq.take_drafts([sampled(5), sampled(9)], None, [0.9, 0.8])
    auto.grammar_forced(seq, 8)
    assert seq.drafts == [DraftToken(5), DraftToken(6)]


def test_only_the_forced_chain_part_of_a_tree_turns_one_hot():
    seq = _seq([5, 6])
    seq.take_drafts([sampled(5), sampled(6), sampled(6)], (-1, -1, 0), [0.9, 0.5, 0.4])
    auto.grammar_forced(seq, 8)
    assert [d.q_ids for d in seq.drafts] == [(), (6, 7), (6, 7)]
    assert seq.draft_parents == (-1, -1, 0)
