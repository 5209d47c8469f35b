"""N-gram prompt lookup: matching, longest-n-first, most recent match, periodic continuation,
a copy resumed past one added token."""
import pytest

from tandem.proposers.ngram import (
    RESUME_FIRST,
    NgramProposer,
    confidences,
    ngram_lookup,
    propose_copy,
    resume_confidences,
    resume_match,
)
from tandem.spec import DraftRequest, Method, Proposer

pytestmark = pytest.mark.unit


def test_proposes_what_followed_the_match():
    # ... 1 2 3 4 5 ... 1 2 3 -> 4 5 6
    seq = [9, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]
    assert ngram_lookup(seq, 3, 3) == [4, 5, 6]


def test_longest_ngram_wins_over_a_later_shorter_match():
    # Suffix [1, 2]: the 2-gram matches at index 0 (-> 7); the 1-gram [2] matches later (-> 9).
    seq = [1, 2, 7, 5, 2, 9, 1, 2]
    assert ngram_lookup(seq, 2, 1) == [7]
    assert ngram_lookup(seq, 1, 1) == [9]


def test_most_recent_match_is_used():
    seq = [5, 1, 5, 2, 5, 3, 5]
    assert ngram_lookup(seq, 1, 1) == [3]


def test_no_match_proposes_nothing():
    assert ngram_lookup([1, 2, 3, 4], 3, 4) == []
    assert ngram_lookup([7], 3, 4) == []


def test_periodic_text_is_continued_past_the_end():
    # The most recent match of [1, 2] is one period back; copying continues the period.
    assert ngram_lookup([1, 2, 1, 2], 2, 5) == [1, 2, 1, 2, 1]
    assert ngram_lookup([4, 4, 4], 1, 3) == [4, 4, 4]


def test_min_ngram_size_and_validation():
    seq = [1, 2, 9, 2]
    assert ngram_lookup(seq, 3, 2) == [9, 2]
    assert ngram_lookup(seq, 3, 2, min_ngram_size=2) == []
    with pytest.raises(ValueError):
        ngram_lookup(seq, 0, 2)
    with pytest.raises(ValueError):
        ngram_lookup(seq, 2, 0)
    with pytest.raises(ValueError):
        NgramProposer(max_ngram_size=0)


def test_input_is_not_modified():
    seq = [1, 2, 1]
    ngram_lookup(seq, 2, 3)
    assert seq == [1, 2, 1]


def test_proposer_batches_and_respects_limits():
    prop = NgramProposer(max_ngram_size=3, max_spec_tokens=2)
    assert isinstance(prop, Proposer) and prop.method == Method.NGRAM
    reqs = [
        DraftRequest(session_key=1, token_ids=[1, 2, 3, 4, 1, 2], num_committed=6, max_tokens=8),
        DraftRequest(session_key=2, token_ids=[1, 2, 3], num_committed=3, max_tokens=8),
        DraftRequest(session_key=3, token_ids=[1, 2, 3, 4, 1, 2], num_committed=6, max_tokens=1),
        # per-request n: a 1-gram lookup finds the latest [2] -> 5, a 2-gram finds [1 2] -> 3
        DraftRequest(session_key=4, token_ids=[1, 2, 3, 2, 5, 1, 2], num_committed=7, max_tokens=1,
                     max_ngram_size=1),
    ]
    results = prop.propose(reqs)
    assert [[t.token_id for t in r.tokens] for r in results] == [[3, 4], [], [3], [5]]
    assert all(t.q_ids == () and t.q_probs == () for r in results for t in r.tokens)
    assert all(r.error is None for r in results)
    prop.release(1)  # stateless: a no-op


def _naive(tokens, max_n, k):
    """The textbook lookup, kept simple: the reference for the packed-bytes search."""
    for n in range(min(max_n, len(tokens) - 1), 0, -1):
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i:i + n] == tokens[-n:]:
                out = list(tokens)
                for j in range(k):
                    out.append(out[i + n + j])
                return out[len(tokens):]
    return []


def test_matches_the_textbook_lookup_on_random_sequences():
    import random

    rng = random.Random(0)
    # Ids like 0x0100_0001 make byte patterns that also occur straddling two ids, which the
    # packed search must skip.
    alphabets = [[1, 2, 3], [0x01000001, 0x00000100, 0x01010101, 1], list(range(49152))]
    for trial in range(600):
        alphabet = alphabets[trial % 3]
        seq = [rng.choice(alphabet[:rng.randint(1, 6)] if trial % 3 == 2 else alphabet)
               for _ in range(rng.randint(1, 40))]
        for max_n in (1, 3):
            assert ngram_lookup(seq, max_n, 4) == _naive(seq, max_n, 4), (seq, max_n)


def test_straddling_byte_match_is_skipped():
    # The only byte-level occurrence of the last id straddles the first two ids.
    a, b = 0x02000000, 0x00000001  # bytes 00 00 00 02 | 01 00 00 00
    straddle = 0x00010200  # bytes 00 02 01 00: found at offset 2, not a real token match
    assert ngram_lookup([a, b, 7, straddle], 1, 1) == []


# ---- a copy resumed past one added token (resume_match, propose_copy) --------------------------
SOURCE = [20, 21, 22, 23, 24, 25, 26, 27, 28]  # the text being copied (in the prompt)


def test_a_copy_resumes_past_one_inserted_token():
    # The output copied 20..23, then added 99 (a comma) where the source goes on with 24.
    seq = [*SOURCE, 5, 20, 21, 22, 23, 99]
    assert ngram_lookup(seq, 3, 3) == []  # 99 occurs nowhere earlier: the lookup has nothing
    ids, held, scores = propose_copy(seq, 3, 3)
    assert ids == [24, 25, 26] and held == 4
    assert scores == resume_confidences(4, 3)
    assert scores[0] == pytest.approx(RESUME_FIRST * 4 / 6)  # a guess at first, then the copy's
    assert resume_match(seq, 3, 3) == ([24, 25, 26], 4)


def test_a_one_token_match_gives_way_to_a_resumed_copy():
    # 99 also occurs earlier (then 7): a one-token match, chance next to a copy of four.
    seq = [99, 7, *SOURCE, 5, 20, 21, 22, 23, 99]
    assert ngram_lookup(seq, 3, 2) == [7, 20]
    assert propose_copy(seq, 3, 2)[0] == [24, 25]


def test_a_longer_match_is_kept_over_a_resume():
    # [23, 99] happened before (then 8): a two-token match is the lookup's, not a resume's.
    seq = [23, 99, 8, *SOURCE, 5, 20, 21, 22, 23, 99]
    ids, held, scores = propose_copy(seq, 3, 2)
    assert ids == [8, 20] and held == 2 and scores == confidences(2, 2)


def test_no_resume_without_a_copy_of_three_before_the_added_token():
    seq = [*SOURCE, 5, 22, 23, 99]  # only two tokens copied before 99
    assert resume_match(seq, 3, 3) == ([], 0)
    assert propose_copy(seq, 3, 3)[0] == []
    assert resume_match([20, 21, 99], 3, 3) == ([], 0)  # too short to say anything
    # min_ngram_size: a resumed copy must hold at least that many tokens too
    seq = [*SOURCE, 5, 20, 21, 22, 23, 99]
    assert resume_match(seq, 5, 3, min_ngram_size=5) == ([], 0)
    assert resume_match(seq, 5, 3, min_ngram_size=4)[0] == [24, 25, 26]


def test_the_proposer_drafts_the_resumed_copy_with_its_estimates():
    seq = [*SOURCE, 5, 20, 21, 22, 23, 99]
    (res,) = NgramProposer(max_ngram_size=3).propose(
        [DraftRequest(session_key="s", token_ids=seq, num_committed=len(seq), max_tokens=4)])
    assert [d.token_id for d in res.tokens] == [24, 25, 26, 27]
    assert list(res.scores) == pytest.approx(resume_confidences(4, 4))
