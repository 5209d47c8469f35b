"""A draft worker drafts its chain after the commit, so a round that verifies any of it waits
for it: a session alone sizes k with that wait (Scheduler.draft_ms, the draft side's measured
latencies: to the first draft after a commit, then per draft), on a cost curve of forwards
alone. Before, the wait was folded into the curve, shared with rounds that wait for nothing
and forgotten once unused, so a draft model that could not pay for its wait was tried again
and lost again every few hundred rounds (1 session, 64-token chat: 0.92-0.94 of plain)."""
import pytest
from test_verifier_logic import make_sched, params

from tandem.engine.block_manager import BlockManager
from tandem.spec.cost import CostModel
from verify_service.config import SchedulerConfig
from verify_service.drafts.waits import LATE_ROUNDS_NO_WAIT, draft_wait_limit_ms
from verify_service.policy.feedback import Latency
from verify_service.policy.scheduler import EXPLORE_EVERY, Scheduler
from verify_service.session.sequence import Sequence

pytestmark = pytest.mark.unit

CURVE = {1: 20.0, 2: 20.5, 3: 21.5, 4: 23.0, 5: 25.0, 6: 27.0, 7: 29.0, 8: 31.0, 9: 33.0}


def k_alone(acceptance: float, draft_ms: tuple[float, float]) -> int:
    """The k a draft-model session alone wants, past its first round's probe."""
    sched = Scheduler(BlockManager(64, 4), SchedulerConfig(max_spec_tokens=8),
                      CostModel(dict(CURVE)))
    sched.draft_ms = draft_ms
    seq = Sequence(params(max_new=64))  # a greedy draft-model session
    seq.stats.rounds = 5  # not the first round, nor a periodic probe
    seq.est.acceptance_ema = acceptance
    sched.add(seq)
    return sched.desired_k(seq)


def test_a_chain_that_cannot_pay_for_its_wait_is_not_verified():
    # Per-token acceptance 0.4: one draft gives 1.4 tokens; with no wait that pays
    # (1.4 / 20.5 ms > 1 / 20 ms), not when the first draft comes 10 ms after the commit
    # (1.4 / 30.5 ms).
    assert k_alone(0.4, (0.0, 0.0)) > 0
    assert k_alone(0.4, (10.0, 5.0)) == 0


def test_a_good_chain_pays_for_its_wait_and_the_gap_between_drafts_sizes_it():
    fast, slow = k_alone(0.8, (10.0, 1.0)), k_alone(0.8, (10.0, 8.0))
    assert fast > slow > 0


def test_a_session_no_longer_waited_for_is_waited_for_in_its_probe_rounds():
    """After LATE_ROUNDS_NO_WAIT late rounds the step stops waiting for the session's drafts,
    except in its periodic probe rounds: a worker that was slow only at first catches up."""
    class Side:  # a DraftSide stand-in: linked, measured delays fixed
        arrival, first = Latency(4.0), Latency(10.0)

        def linked(self, seq):
            return True

    sched = make_sched(max_spec_tokens=8)
    seq = Sequence(params())
    sched.running = [seq]
    seq.est.acceptance_ema = 0.95  # k > 0 wanted, no draft here
    seq.stats.rounds = 3
    assert draft_wait_limit_ms(sched.running, sched, Side(), 25.0) > 0
    seq.est.late_rounds = LATE_ROUNDS_NO_WAIT
    assert draft_wait_limit_ms(sched.running, sched, Side(), 25.0) == 0.0
    seq.stats.rounds = EXPLORE_EVERY - 1  # its probe round
    assert draft_wait_limit_ms(sched.running, sched, Side(), 25.0) > 0
