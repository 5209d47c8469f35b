"""A proposer's per-session correction (tandem.spec.cost.update_source_scale): a ratio of
decayed sums, so one lucky round of a tiny expectation cannot undo many rounds of evidence,
and it converges to what the proposer's drafts really reach."""
import random

import pytest

from tandem.spec.cost import update_source_scale, update_tree_scale

pytestmark = pytest.mark.unit


def test_a_lucky_round_of_tiny_expectation_barely_moves_the_scale():
    evidence, scale = None, 1.0
    for _ in range(12):  # a one-token n-gram match on chat: expected 0.33, never accepted
        evidence, scale = update_source_scale(evidence, scale, 0.33, 0)
    low = scale
    assert low < 0.25
    evidence, scale = update_source_scale(evidence, scale, 0.33, 1)  # then one hit
    ema = update_tree_scale(low, 0.33 * low, 1)  # the per-round EMA it replaced
    assert scale < 0.55 and ema > scale + 0.2
    for _ in range(12):  # and misses again: back down within a few rounds
        evidence, scale = update_source_scale(evidence, scale, 0.33, 0)
    assert scale < 0.25


def test_converges_to_accepted_over_expected():
    rng = random.Random(0)
    evidence, scale = None, 1.0
    for _ in range(400):  # each draft's real chance is 0.4 of what the proposer said (0.9)
        expected = 0.9 * 4
        accepted = sum(rng.random() < 0.36 for _ in range(4))
        evidence, scale = update_source_scale(evidence, scale, expected, accepted)
    assert scale == pytest.approx(0.4, abs=0.12)


def test_prior_counts_first_and_bounds_hold():
    evidence, scale = update_source_scale(None, 0.5, 0.0, 0)  # nothing expected: the prior
    assert scale == pytest.approx(0.5)
    for _ in range(50):
        evidence, scale = update_source_scale(evidence, scale, 0.01, 3)
    assert scale == 4.0
    for _ in range(80):
        evidence, scale = update_source_scale(evidence, scale, 5.0, 0)
    assert scale == 0.05
