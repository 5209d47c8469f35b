"""Suffix decoding: the token index, longest-match voting, confidence-limited length, the
cross-request cache (bounded, per tenant) and the Proposer contract."""
import pytest

from draft_service.config import DraftConfig
from tandem.proposers.suffix import (
    SequenceCache,
    SuffixConfig,
    SuffixProposer,
    TokenLog,
    speculate,
)
from tandem.spec import DraftRequest, Learner, Method, Proposer

pytestmark = pytest.mark.unit


def log_of(*seqs, anchor=2):
    log = TokenLog(anchor)
    for s in seqs:
        log.extend(s)
        log.end_sequence()
    return log


def test_index_finds_every_occurrence_and_extends_across_appends():
    log = TokenLog(2)
    log.extend([1, 2, 3])
    log.extend([1, 2])  # the gram (3, 1) spans the two appends
    assert log.index[(1, 2)] == [2, 5]
    assert log.index[(3, 1)] == [4]
    assert log.candidates((1, 2), limit=10).tolist() == [2]  # position 5 has no continuation yet
    log.end_sequence()
    assert (2, -1) not in log.index and log.candidates((1, 2), limit=10).tolist() == [2]


def test_longest_match_wins_over_more_frequent_shorter_ones():
    # tail [7, 1, 2]: three occurrences of [1, 2] continue with 5, one of [7, 1, 2] with 9
    log = log_of([1, 2, 5, 0], [1, 2, 5, 0], [7, 1, 2, 9, 9], [1, 2, 5])
    spec = speculate(log, [4, 7, 1, 2], 4)
    assert spec.tokens == [9, 9, 9][: len(spec.tokens)] and spec.tokens[0] == 9
    assert spec.match_len == 3


def test_majority_continuation_and_confidence_cut():
    # after [1, 2]: 3 of 4 occurrences continue 3 4, one continues 8
    log = log_of([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 8, 8])
    spec = speculate(log, [1, 2], 4, spec_factor=4.0)
    # votes 3/4 each, no surer than a 2-token n-gram match: 2/4, then (2/4)^2
    assert spec.tokens == [3, 4] and spec.score == pytest.approx(0.5 + 0.25)
    # the same votes with a bar above 3/4 propose nothing
    assert speculate(log, [1, 2], 4, spec_factor=4.0, min_prob=0.8).tokens == []


def test_one_occurrence_is_as_sure_as_its_match_is_long():
    # One earlier occurrence votes 1.0 for all it continues with: a 3-token chat match was
    # priced as certain under load. A long match (a copy under way) stays near-sure.
    text = list(range(10, 60))
    short = speculate(log_of(text), [10, 11, 12], 3, spec_factor=1.0)
    long = speculate(log_of(text), text[:20], 3, spec_factor=1.0)
    assert short.tokens == [13, 14, 15] and short.probs == pytest.approx((3 / 5, 3 / 6, 3 / 7))
    assert long.tokens == text[20:23] and long.probs[0] == pytest.approx(20 / 22)


def test_length_follows_match_length():
    text = list(range(10, 40))
    log = log_of(text)
    short = speculate(log, [10, 11], 16, spec_factor=1.0)  # match 2 -> at most 2 drafts
    long = speculate(log, text[:8], 16, spec_factor=1.0)  # match 8 -> 8 drafts
    assert short.tokens == [12, 13]
    assert long.tokens == text[8:16] and long.match_len == 8


def test_no_match_and_short_context():
    log = log_of([1, 2, 3])
    assert speculate(log, [5, 6], 4).tokens == []
    assert speculate(log, [2], 4).tokens == []  # shorter than the anchor
    assert speculate(log, [1, 2], 0).tokens == []


def test_continuations_stop_at_sequence_ends():
    log = log_of([1, 2, 3], [4, 5, 6])
    assert speculate(log, [1, 2], 8, spec_factor=8.0).tokens == [3]


def test_cache_evicts_oldest_and_compacts():
    cache = SequenceCache(anchor=2, max_tokens=10)
    cache.add([1, 2, 3, 4])
    cache.add([5, 6, 7, 8])
    assert speculate(cache.log, [1, 2], 2, live_start=cache.live_start).tokens == [3, 4]
    cache.add([9, 10, 11, 12])  # 15 held > 10: the first sequence goes
    assert speculate(cache.log, [1, 2], 2, live_start=cache.live_start).tokens == []
    assert speculate(cache.log, [9, 10], 2, live_start=cache.live_start).tokens == [11, 12]
    for i in range(20):  # many evictions: the log is rebuilt, never grows without bound
        cache.add([100 + i, 200 + i, 300 + i])
    assert cache.held_tokens <= 10 and cache.log.length <= 2 * 10 + 4
    assert speculate(cache.log, [119, 219], 1, live_start=cache.live_start).tokens == [319]


def req(session_key, ids, committed=None, max_tokens=8, tenant=""):
    return DraftRequest(session_key=session_key, token_ids=ids,
                        num_committed=len(ids) if committed is None else committed,
                        max_tokens=max_tokens, tenant=tenant)


def test_proposer_learns_from_finished_sessions():
    prop = SuffixProposer(SuffixConfig(anchor=2))
    assert isinstance(prop, Proposer) and isinstance(prop, Learner)
    assert prop.method is Method.SUFFIX
    answer = [50, 51, 52, 53, 54, 55, 56, 57]
    question = [1, 2, 3, 4]
    assert prop.propose([req("a", question)])[0].tokens == []  # nothing known yet
    prop.release("a")
    prop.learn("", question + answer)  # the worker hands over the finished text
    drafts = prop.propose([req("b", question, max_tokens=6)])[0].tokens
    assert [t.token_id for t in drafts] == answer[:4]  # match of 4 -> 4 drafts
    assert all(t.q_ids == () for t in drafts)  # one-hot
    # its own sequence: drafts beyond the committed part still match
    own = prop.propose([req("c", [9, 8, 7, 6, 9, 8], committed=5)])[0].tokens
    assert [t.token_id for t in own] == [7, 6]


def test_tenants_do_not_see_each_other():
    prop = SuffixProposer(SuffixConfig(anchor=2, per_tenant=True))
    prop.learn("x", [1, 2, 3, 4, 5, 6])
    assert prop.propose([req("b", [1, 2], tenant="y")])[0].tokens == []
    assert [t.token_id for t in prop.propose([req("c", [1, 2], tenant="x")])[0].tokens] == [3, 4]
    shared = SuffixProposer(SuffixConfig(anchor=2))
    shared.learn("x", [1, 2, 3, 4])
    assert [t.token_id for t in shared.propose([req("b", [1, 2], tenant="y")])[0].tokens] == [3, 4]


def test_release_of_unknown_key_and_no_cache():
    prop = SuffixProposer(SuffixConfig(anchor=2, cache_tokens=0))
    prop.release("nobody")
    prop.learn("", [1, 2, 3, 4])
    assert prop.propose([req("b", [1, 2])])[0].tokens == []


@pytest.mark.parametrize("bad", [dict(anchor=0), dict(min_prob=1.5), dict(spec_factor=0.0),
                                 dict(cache_tokens=-1), dict(max_match=1, anchor=3),
                                 dict(spec_factor=float("nan"))])
def test_config_validation(bad):
    with pytest.raises(ValueError):
        SuffixConfig(**bad)


def test_draft_config_validates_suffix_flags():
    with pytest.raises(ValueError, match="suffix_scope"):
        DraftConfig(suffix_scope="everyone")
    with pytest.raises(ValueError, match="min_prob"):
        DraftConfig(suffix_min_prob=2.0)
    assert DraftConfig().suffix_config().per_tenant  # the safe default
    assert not DraftConfig(suffix_scope="global").suffix_config().per_tenant


def test_least_recently_used_tenant_is_dropped():
    prop = SuffixProposer(SuffixConfig(anchor=2, per_tenant=True, max_tenants=2))
    for tenant in ("x", "y", "z"):
        prop.learn(tenant, [1, 2, 3])
    assert prop.propose([req("a", [1, 2], tenant="x")])[0].tokens == []
    assert [t.token_id for t in prop.propose([req("b", [1, 2], tenant="z")])[0].tokens] == [3]


def test_a_copy_resumes_past_one_added_token():
    # The output copied 20..23 and added 99 (a comma the source does not have): no occurrence
    # shares the anchor's tokens with the tail, so the lookup below the anchor resumes the copy.
    source = [20, 21, 22, 23, 24, 25, 26, 27, 28]
    prop = SuffixProposer(SuffixConfig(anchor=3, cache_tokens=0))
    (res,) = prop.propose([req("s", [*source, 5, 20, 21, 22, 23, 99], max_tokens=3)])
    assert [t.token_id for t in res.tokens] == [24, 25, 26]
    assert 0 < res.scores[0] < 0.5  # a guess: the session's rounds say what such guesses are worth
