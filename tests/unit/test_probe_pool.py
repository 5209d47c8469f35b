"""Issue 49: a draft worker method's periodic probes follow how fresh its pooled evidence is, not
how many sessions it has (verify_service/policy/batch.py probe_round), while each session still
drafts on its first decode round (its own evidence is none) unless it shares a planned step;
a session asked for no drafts has no link until a probe (or its k) asks, and is opened a round
before its probe (verify_service/drafts/waits.py run_ahead), so the probe does not wait for
the worker's prefill."""
import pytest
from test_draft_churn import Link
from test_verifier_logic import make_sched, params

from tandem.spec import Method
from tandem.spec.cost import StepCost
from verify_service.drafts.side import DraftSide
from verify_service.drafts.waits import missing, run_ahead
from verify_service.policy.batch import FRESH_TRIALS, AcceptancePool
from verify_service.policy.scheduler import EXPLORE_EVERY
from verify_service.session.sequence import Sequence

pytestmark = pytest.mark.unit


def low_pool(pool: AcceptancePool, rounds: int = 50, method=Method.DRAFT_MODEL) -> None:
    for _ in range(rounds):
        pool.learn(method, 4, 0)  # a method whose drafts do not pay


def running_seq(sched, session_id="s", method=Method.DRAFT_MODEL):
    seq = Sequence(params(session_id, max_new=200, method=method))
    sched.add(seq)
    sched.update_from_output(sched.schedule().scheduled[0], 0)  # the prefill
    seq.commit([], 42)
    return seq


def stale(sched, seq) -> None:
    while sched.pool.fresh(seq.params.method):
        sched.pool.age([seq])  # its steps without drafts


def test_the_pool_ages_per_step_of_its_sessions_its_rate_kept_until_under_one_trial():
    pool, seq = AcceptancePool(), Sequence(params())
    for _ in range(3):
        pool.learn(Method.DRAFT_MODEL, 4, 1)
    rate = pool.rate(Method.DRAFT_MODEL)
    assert rate == pytest.approx(0.5) and pool.fresh(Method.DRAFT_MODEL)
    for _ in range(100):
        pool.age([])  # steps without its sessions: nothing ages
    assert pool.fresh(Method.DRAFT_MODEL)
    for _ in range(100):
        pool.age([seq])
    assert pool.rate(Method.DRAFT_MODEL) == pytest.approx(rate)  # weight, not rate
    assert not pool.fresh(Method.DRAFT_MODEL)
    for _ in range(400):
        pool.age([seq])
    assert pool.rate(Method.DRAFT_MODEL) is None  # the sessions' prior again


def test_a_method_nobody_uses_does_not_age_in_the_steps_of_another():
    sched = make_sched()
    low_pool(sched.pool, 5)
    low_pool(sched.pool, 5, Method.MTP)
    before = sched.pool.sums[Method.DRAFT_MODEL]
    running_seq(sched, "m", Method.MTP)
    for _ in range(300):
        sched.schedule()  # steps with only an MTP session decoding
    assert sched.pool.sums[Method.DRAFT_MODEL] == before and sched.pool.fresh(Method.DRAFT_MODEL)
    assert not sched.pool.fresh(Method.MTP)  # the method in use aged


def test_a_session_drafts_on_its_first_decode_round_whatever_its_pool_says():
    """The lossless tests' short sessions (MTP's distribution test: 3 tokens each) must verify
    drafts: an empty pool prices them at the prior, a fresh low one still probes round 1."""
    sched = make_sched()
    seq = running_seq(sched)
    seq.stats.rounds = 0
    assert sched.desired_k(seq, 1) > 1  # empty pool: the prior, drafts pay
    low_pool(sched.pool)
    assert sched.pool.fresh(Method.DRAFT_MODEL)
    assert sched.desired_k(seq, 1) == 1  # fresh and low: round 1 probes one draft
    stale(sched, seq)
    assert sched.desired_k(seq, 1) == 1  # stale: it probes too
    seq.stats.rounds, seq.stats.drafted, seq.est.acceptance_ema = 1, 1, 0.0  # it was rejected
    assert sched.desired_k(seq) == 0  # once: round 2 is no probe


def test_beside_other_sessions_the_first_round_is_no_probe():
    """A batch plan prices the step: it cut that probe, so its Open (the worker's prefill of
    the prompt) bought nothing; the pool's periodic probes keep its evidence. A burst's
    sessions count before any of them decodes (they are admitted, then opened)."""
    sched = make_sched()
    seq = running_seq(sched)
    low_pool(sched.pool)
    seq.stats.rounds = 0
    sched.add(Sequence(params("other")))  # waiting: not in a plan yet
    side = DraftSide({seq.session_id: seq}, 100, 4, 8)
    assert sched.desired_k(seq, 1) == 1  # no step curve: no plan, it probes
    sched.step_cost = StepCost({1: 10.0, 2: 10.5, 4: 11.0, 8: 12.0, 16: 14.0})
    assert sched.desired_k(seq, 1) == 0 and run_ahead(seq, sched, side, 1) == 0  # no Open
    stale(sched, seq)
    assert sched.desired_k(seq, 1) == 0  # stale too: its periodic probes bring the evidence
    sched.abort("other")
    assert sched.desired_k(seq, 1) == 1  # alone: it probes


def test_periodic_probes_follow_the_pools_age_not_the_session():
    sched = make_sched()
    seq = running_seq(sched)
    low_pool(sched.pool)
    seq.stats.rounds = EXPLORE_EVERY - 1
    assert sched.desired_k(seq) == 0  # the pool knows: the probe is skipped
    stale(sched, seq)
    assert sched.desired_k(seq) == 1  # stale: this session's probe round probes
    sched._caps = {seq.session_id: 0}
    assert sched.desired_k(seq) == 1  # and the plan does not cut it
    seq.stats.rounds += 1
    assert sched.desired_k(seq) == 0  # only in its probe round


def test_a_probe_refreshes_the_pool_for_every_session_of_its_method():
    sched = make_sched()
    seqs = [running_seq(sched, f"s{i}") for i in range(2)]
    low_pool(sched.pool, 3)  # under FRESH_TRIALS
    assert not sched.pool.fresh(Method.DRAFT_MODEL)
    for _ in range(int(FRESH_TRIALS)):
        sched.pool.learn(Method.DRAFT_MODEL, 1, 0)  # one session's probes
    seqs[1].stats.rounds = EXPLORE_EVERY - 1
    assert sched.desired_k(seqs[1]) == 0  # the other's probe is not needed


def test_a_session_with_no_link_asks_a_round_before_its_probe_and_waits_only_in_it():
    sched = make_sched()
    seq = running_seq(sched)
    side = DraftSide({seq.session_id: seq}, 100, 4, 8)
    low_pool(sched.pool)
    stale(sched, seq)  # probes are due
    seq.stats.rounds = EXPLORE_EVERY - 2  # the next round is plain, the one after a probe
    assert sched.desired_k(seq) == 0 and sched.desired_k(seq, 1) == 1
    assert run_ahead(seq, sched, side) == 2  # the link opens now, asking what the probe will
    assert missing(seq, sched, side) <= 0  # this round waits for nothing
    side.links[seq.session_id] = Link()  # linked: the round before a probe asks nothing more
    assert run_ahead(seq, sched, side) == 0
    seq.stats.rounds += 1
    assert run_ahead(seq, sched, side) == 2 and missing(seq, sched, side) == 1
