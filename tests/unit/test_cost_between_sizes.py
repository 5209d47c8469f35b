"""A single session's cost model prices the sizes start-up calibration skipped (7, 9-11,
13-16 tokens) off the sizes it measured, not off the built-in shape at q = 1."""
import pytest

from tandem.spec.cost import CostModel, choose_tree_size

pytestmark = pytest.mark.unit
# What a verifier here timed at start-up (calibration_counts(16)), ms by tokens per forward.
MEASURED = {1: 18.3, 2: 18.4, 3: 21.4, 4: 22.0, 5: 24.5, 6: 27.1, 8: 32.6, 12: 46.1, 17: 63.1}


def test_sizes_between_measured_ones_are_read_off_them():
    cost = CostModel(dict(MEASURED))
    curve = [cost.cost(q) for q in range(1, 21)]
    assert all(b >= a for a, b in zip(curve, curve[1:]))  # more tokens never cost less
    assert cost.cost(7) == pytest.approx((27.1 + 32.6) / 2)
    assert cost.cost(10) == pytest.approx((32.6 + 46.1) / 2)
    assert cost.cost(16) == pytest.approx(46.1 + 4 * (63.1 - 46.1) / 5)
    assert cost.cost(19) == pytest.approx(63.1 + 2 * (63.1 - 46.1) / 5)  # the last slope on
    assert {q: cost.cost(q) for q in MEASURED} == MEASURED  # measured sizes as measured


def test_a_new_measurement_moves_the_sizes_around_it():
    cost = CostModel(dict(MEASURED))
    before = cost.cost(10)
    for _ in range(30):
        cost.observe(12, 60.0)
    assert cost.cost(12) > 58.0
    assert cost.cost(10) == pytest.approx((32.6 + cost.cost(12)) / 2) and cost.cost(10) > before


def test_a_sure_chain_is_sized_to_the_cheapest_tokens_per_ms():
    """With every draft sure, 15 drafts (16 tokens) must not beat 16 (17 tokens): the old
    fallback priced 16 tokens at 53.1 ms, below 14 at 57.6 and 12 measured at 46.1 x 16/12."""
    cost = CostModel(dict(MEASURED))
    k = choose_tree_size([1.0] * 16, 16, cost)
    assert k == 16
    assert choose_tree_size([1.0] * 9, 9, cost) == 9  # 10 tokens: no longer priced at 52.9


def test_no_measurement_keeps_the_built_in_shape():
    cost = CostModel()
    assert cost.cost(1) == pytest.approx(30.0) and cost.cost(16) == pytest.approx(30.0 * 2.9)
