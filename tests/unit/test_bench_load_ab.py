"""The load A/B's arm order (tools/bench/load_ab.py), without a cluster: every arm goes first
equally often, and no arm always follows the same one (what an arm leaves behind, a busy
draft worker or a learnt step curve, must not always land on one neighbour)."""
import pytest

from tools.bench.load_ab import arm_order

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("n", [2, 3, 6])
def test_each_arm_goes_first_equally_often_and_follows_more_than_one(n):
    arms = [f"m{i}" for i in range(n)]
    orders = [arm_order(arms, rep) for rep in range(2 * n)]
    assert all(sorted(o) == arms for o in orders)  # every arm once per rep
    firsts = [o[0] for o in orders]
    assert all(firsts.count(a) == 2 for a in arms)
    if n > 2:
        for a in arms:
            before = {o[o.index(a) - 1] for o in orders if o.index(a) > 0}
            assert len(before) >= 2, a
