"""Never slower under load (issue 49): the batch plan verifies only the drafts that pay for
the whole step, from measured costs: the rows they add, the wait for a draft worker's drafts,
and the acceptance their method delivers; a method that loses is off for that step."""
import pytest

from tandem.engine.block_manager import BlockManager
from tandem.sampling_params import SamplingParams
from tandem.spec import DraftToken, Method
from tandem.spec.cost import CostModel, StepCost, plan_batch
from verify_service.config import SchedulerConfig
from verify_service.policy.batch import AcceptancePool, chain_acceptance
from verify_service.policy.scheduler import ScheduledSeq, Scheduler
from verify_service.session.params import GenerateParams
from verify_service.session.sequence import Sequence

pytestmark = pytest.mark.unit

FLAT = {1: 30.0, 2: 30.2, 4: 30.4, 8: 30.8, 16: 31.6, 32: 33.2, 64: 36.4}  # memory-bound
# This host's int8 target, timed at start-up: past 16 tokens every row costs ~9 ms.
MEASURED = {1: 46.2, 4: 95.8, 8: 136.9, 16: 216.8, 32: 359.7, 64: 702.2}
SOLO = CostModel({1: 30.0, 2: 30.5, 3: 31.0, 4: 31.5, 5: 32.0})  # alone, k pays


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
        sched.update_from_output(ScheduledSeq(seq, list(seq.tokens), 0, 0, True), 0)
        seq.commit([], 5)
        seq.est.acceptance_ema = ema
        seq.drafts = [DraftToken(t) for t in (6, 7, 8, 9)]
    return seqs


def _scheduler(curve, wait_ms=0.0, spec=4):
    cost = StepCost(curve)
    cost.wait_ms = wait_ms
    return Scheduler(BlockManager(512, 4), SchedulerConfig(max_spec_tokens=spec), SOLO,
                     step_cost=cost)


def test_drafts_that_cost_the_batch_more_than_they_save_are_not_verified():
    # 16 sessions on the measured compute-bound curve: a draft adds a 9 ms row to a 217 ms
    # step, so it must bring 0.66 tokens; at acceptance 0.5 none does.
    sched = _scheduler(MEASURED)
    seqs = _running(sched, 16, ema=0.5)
    out = sched.schedule()
    assert [s.num_drafts for s in out.scheduled] == [0] * 16
    assert all(sched.desired_k(s) == 0 for s in seqs)  # nor asked of the draft worker


def test_the_wait_for_a_draft_worker_counts_though_the_rows_are_free():
    # A memory-bound step: rows are free, drafts at 0.6 pay... unless the step waits 40 ms
    # for them, which only the sessions that draft make it pay.
    drafting = _scheduler(FLAT)
    _running(drafting, 16)
    assert all(s.num_drafts > 0 for s in drafting.schedule().scheduled)
    waiting = _scheduler(FLAT, wait_ms=40.0)
    _running(waiting, 16)
    assert [s.num_drafts for s in waiting.schedule().scheduled] == [0] * 16


def test_a_method_whose_acceptance_is_high_keeps_its_drafts_at_low_load():
    sched = _scheduler(MEASURED, wait_ms=10.0)
    _running(sched, 2, ema=0.95)
    assert all(s.num_drafts >= 2 for s in sched.schedule().scheduled)


def test_a_losing_method_is_off_for_the_step_while_a_winning_one_keeps_its_drafts():
    # Session 0-3: a token-history method drafted in the verifier (no wait), near-sure;
    # 4-19: a draft worker's chains at 0.6, each asked session adding its share of 60 ms.
    gains = [[0.95, 0.9, 0.85]] * 4 + [[0.6, 0.36, 0.22]] * 16
    entry = [0.0] * 4 + [60.0 / 20] * 16
    groups = ["ngram"] * 4 + ["draft_model"] * 16
    counts = plan_batch(gains, StepCost(FLAT).cost, entry, groups)
    assert counts[:4] == [3] * 4 and counts[4:] == [0] * 16
    # Without the wait, both methods' drafts pay on a memory-bound step.
    assert all(plan_batch(gains, StepCost(FLAT).cost, None, groups))


def test_a_fresh_session_prices_its_method_by_what_the_others_measured():
    pool = AcceptancePool()
    for _ in range(40):  # the method's sessions so far: 1 of 3 drafts per round
        pool.learn(Method.DRAFT_MODEL, 3, 1)
    sched = _scheduler(MEASURED)
    sched.pool = pool
    seqs = _running(sched, 16, ema=0.7)  # the prior alone would pay on this curve
    assert chain_acceptance(seqs[0], pool) == pytest.approx(0.5)
    assert [s.num_drafts for s in sched.schedule().scheduled] == [0] * 16
    seqs[0].stats.drafted = 64  # a session with its own evidence trusts it
    assert chain_acceptance(seqs[0], pool) == pytest.approx(0.7)


def test_the_step_learns_its_wait_per_batch_asked_apart_from_the_forward():
    cost = StepCost(MEASURED)
    cost.asked_share = 0.25  # a quarter of the batch was asked: 10 ms is 40 per whole batch
    cost.observe(20, 250.0, 10.0)
    assert cost.wait_ms == pytest.approx(40.0) and cost.observed == {20: 250.0}
    cost.asked_share = 0.0  # nobody asked: a wait (there should be none) teaches nothing
    cost.observe(16, 220.0, 5.0)
    assert cost.wait_ms == pytest.approx(40.0)


def test_the_scheduler_says_who_the_step_waited_for():
    sched = _scheduler(FLAT)
    _running(sched, 4, ema=0.9)
    sched.schedule()
    # the first step: no plan had seen them, and beside others a worker session asks for
    # nothing until one has (batch.py unplanned_cap)
    assert sched.step_cost.asked_share == 0.0
    sched._caps = {"s0": 0, "s1": 0, "s2": 0, "s3": 2}  # a plan that asks one of four
    sched.schedule()
    assert sched.step_cost.asked_share == 0.25


def test_one_session_alone_prices_its_method_by_the_pool_too():
    # A lone fresh draft-model session at the 0.7 prior would draft; its method's sessions so
    # far delivered 0.2 per token, which does not pay for a round's dearer forward.
    cost = CostModel({1: 30.0, 2: 40.0, 3: 50.0, 4: 60.0, 5: 70.0})
    sched = Scheduler(BlockManager(64, 4), SchedulerConfig(max_spec_tokens=4), cost,
                      step_cost=StepCost(MEASURED))
    (seq,) = _running(sched, 1, ema=0.7)
    assert sched.desired_k(seq) > 0
    for _ in range(40):
        sched.pool.learn(Method.DRAFT_MODEL, 4, 0 if _ % 4 else 1)
    assert sched.desired_k(seq) == 0
