"""Suffix decoding's lookup against a plain reference written from its definition: on random
corpora with many repeats, ties and sequence ends, `speculate` proposes the same tokens, with
the same probabilities and match length, as a loop that measures every occurrence's match
and votes column by column (the served code does both vectorised / in lists, for speed), each
probability no surer than an n-gram match of the same length."""
import math
import random
from collections import Counter

import pytest

from tandem.proposers.ngram import confidences
from tandem.proposers.suffix import _SEP, TokenLog, speculate

pytestmark = pytest.mark.unit


def reference(log: TokenLog, context, max_tokens, max_match, min_prob, spec_factor, live_start):
    buf, a = log.tokens.tolist(), log.anchor
    if max_tokens < 1 or len(context) < a:
        return [], [], 0
    tail = list(context[-a:])
    starts = [p for p in range(a, len(buf)) if buf[p - a:p] == tail
              and p - a >= live_start and buf[p] != _SEP]  # p: the continuation's start

    def match(p):
        n = a
        while n < min(max_match, len(context)) and p - 1 - n >= live_start \
                and buf[p - 1 - n] == context[-1 - n]:
            n += 1
        return n
    if not starts:
        return [], [], 0
    best = max(match(p) for p in starts)
    limit = min(max_tokens, max(1, math.ceil(spec_factor * best)))
    rows = [(buf[p:p + limit] + [_SEP] * limit)[:limit] for p in starts if match(p) == best]
    tokens, probs, prob = [], [], 1.0
    for j in range(limit):
        col = [r[j] for r in rows]
        votes = Counter(v for v in col if v != _SEP)
        if not votes:
            break
        top = max(votes.values())
        tied = {v for v, c in votes.items() if c == top}
        token = min(tied) if len(tied) == 1 else [v for v in col if v in tied][-1]
        prob *= top / len(col)
        if prob < min_prob:
            break
        tokens.append(token)
        probs.append(prob)
        rows = [r for r in rows if r[j] == token]
    return tokens, [min(p, c) for p, c in zip(probs, confidences(best, len(probs)))], best


@pytest.mark.parametrize("seed", range(40))
def test_speculate_matches_the_reference(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 12])  # small vocabularies: many occurrences, long matches, ties
    log = TokenLog(rng.choice([1, 2, 3]))
    for _ in range(rng.randint(1, 4)):
        log.extend([rng.randrange(vocab) for _ in range(rng.randint(0, 300))])
        log.end_sequence()
    live_start = rng.choice([0, 0, log.length // 3])
    context = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
    knobs = dict(max_match=rng.choice([3, 8, 32]), min_prob=rng.choice([0.0, 0.1, 0.5]),
                 spec_factor=rng.choice([0.5, 1.0, 2.0]))
    k = rng.choice([0, 1, 4, 16])
    got = speculate(log, context, k, max_candidates=10_000, live_start=live_start, **knobs)
    want = reference(log, context, k, live_start=live_start, **knobs)
    assert (got.tokens, got.match_len) == (want[0], want[2])
    assert list(got.probs) == pytest.approx(want[1])
    assert got.score == pytest.approx(sum(want[1]))
