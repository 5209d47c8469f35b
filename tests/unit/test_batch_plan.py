"""The batch dimension of the cost model: a step's drafts must pay for the batch, not just
for their own session (StepCost, plan_batch, Scheduler.plan)."""
import pytest

from tandem.engine.block_manager import BlockManager
from tandem.sampling_params import SamplingParams
from tandem.spec import DraftToken, Method
from tandem.spec.cost import CostModel, StepCost, expected_tokens, plan_batch
from verify_service.config import SchedulerConfig
from verify_service.policy.scheduler import Scheduler
from verify_service.session.params import GenerateParams
from verify_service.session.sequence import SeqStatus, Sequence

pytestmark = pytest.mark.unit

FLAT = {1: 30.0, 2: 30.2, 4: 30.4, 8: 30.8, 16: 31.6, 32: 33.2, 64: 36.4}  # memory-bound
# Compute-bound past a few rows: every token costs about 4 ms on top of 30.
STEEP = {1: 30.0, 2: 31.0, 4: 33.0, 8: 45.0, 16: 80.0, 32: 150.0, 64: 290.0}


def test_plan_matches_the_single_session_rule_for_one_session():
    # One session alone: argmax_k E(k) / cost(k + 1), as choose_k.
    a, cost = 0.8, StepCost(STEEP)
    gains = [[a ** (j + 1) for j in range(8)]]
    (k,) = plan_batch(gains, cost.cost)
    rates = [expected_tokens(a, j) / cost.cost(j + 1) for j in range(9)]
    assert k == max(range(9), key=lambda j: (rates[j], -j))


def test_a_compute_bound_batch_drops_the_unlikely_drafts_first():
    # 16 sessions: on a flat curve every draft pays; on a steep one only the near-sure ones.
    gains = [[0.95, 0.9], [0.5, 0.25]] + [[0.6, 0.36, 0.2]] * 14
    flat = plan_batch(gains, StepCost(FLAT).cost)
    steep = plan_batch(gains, StepCost(STEEP).cost)
    assert flat == [2, 2] + [3] * 14
    assert steep[0] == 2 and steep[1:] == [0] * 15


def test_a_session_drafts_in_order():
    # A tree's nodes go parents first: a later, likelier node never comes without the earlier.
    counts = plan_batch([[0.1, 0.99], [0.5]], StepCost(FLAT).cost)
    assert counts[0] in (0, 2) and counts[1] == 1


def test_no_gains_no_drafts():
    assert plan_batch([[], []], StepCost(FLAT).cost) == [0, 0]


def test_step_cost_rescales_its_prior_by_the_measured_steps():
    cost = StepCost(STEEP)
    assert cost.cost(24) == pytest.approx((80 + 150) / 2)  # interpolated
    assert cost.cost(96) == pytest.approx(290 + 140 / 32 * 32)  # last slope beyond
    assert cost.cost(1) == 30.0 and not StepCost().known
    cost.observe(32, 300.0)  # steps here run twice the calibrated forward (overheads)
    assert cost.cost(32) == 300.0 and cost.cost(64) == pytest.approx(580.0)
    cost.observe(32, 200.0)
    assert cost.cost(32) == pytest.approx(0.8 * 300 + 0.2 * 200)
    # A noisy sample one token up does not make that token free for a plan anchored at 32.
    cost.observe(33, 150.0)
    assert cost.cost(33) < cost.cost(32)
    assert cost.cost(33, anchor=32) == pytest.approx(280 * (150 + 140 / 32) / 150)
    # Rows dearer than the curve says (tree masks, heads): the steps that ran say so.
    calibrated_only = cost.cost(40, anchor=32)  # 280 + 8 tokens at the curve's 8.2 ms
    assert calibrated_only == pytest.approx(280 + 8 * 140 / 32 * 280 / 150)
    for t in (34, 36, 38, 40):
        for _ in range(20):
            cost.observe(t, 280 + 20 * (t - 32))
    assert cost.cost(40, anchor=32) > calibrated_only + 8 * 5
    # Calibration noise: a dip in the curve is flattened, never a cheaper larger step.
    assert StepCost({1: 30.0, 16: 80.0, 17: 70.0, 32: 150.0}).cost(17) == 80.0


def _running(sched, n, method=Method.DRAFT_MODEL, ema=0.6):
    seqs = []
    for i in range(n):
        seq = Sequence(GenerateParams(
            session_id=f"s{i}", prompt=(1, 2, 3), committed=(),
            sampling=SamplingParams(temperature=0.0), max_new_tokens=50,
            stop_token_ids=frozenset({0}), method=method))
        sched.add(seq)
        seqs.append(seq)
    sched.schedule()  # the prefills
    for seq in seqs:
        sched.update_from_output(sched_prefill(seq), 0)
        seq.commit([], 5)
        seq.est.acceptance_ema = ema
        seq.drafts = [DraftToken(t) for t in (6, 7, 8, 9)]
    return seqs


def sched_prefill(seq):
    from verify_service.policy.scheduler import ScheduledSeq
    return ScheduledSeq(seq, list(seq.tokens), 0, 0, True)


@pytest.mark.parametrize("curve,expect_drafts", [(FLAT, True), (STEEP, False)])
def test_scheduler_cuts_k_when_the_batch_step_is_compute_bound(curve, expect_drafts):
    cost = CostModel({1: 30.0, 2: 30.5, 3: 31.0, 4: 31.5, 5: 32.0})  # alone, k pays
    sched = Scheduler(BlockManager(256, 4), SchedulerConfig(max_spec_tokens=4), cost,
                      step_cost=StepCost(curve))
    seqs = _running(sched, 16)
    assert all(s.sched.status is SeqStatus.RUNNING for s in seqs)
    out = sched.schedule()
    drafted = [s.num_drafts for s in out.scheduled]
    assert len(drafted) == 16
    if expect_drafts:
        assert all(k >= 2 for k in drafted)
    else:
        assert drafted == [0] * 16
        assert all(sched.desired_k(s) == 0 for s in seqs)  # nor asked of the draft worker


def test_one_session_alone_keeps_its_single_session_k():
    cost = CostModel({1: 30.0, 2: 30.5, 3: 31.0, 4: 31.5, 5: 32.0})
    sched = Scheduler(BlockManager(64, 4), SchedulerConfig(max_spec_tokens=4), cost,
                      step_cost=StepCost(STEEP))
    (seq,) = _running(sched, 1, ema=0.9)
    (s,) = sched.schedule().scheduled
    assert s.num_drafts == 4
