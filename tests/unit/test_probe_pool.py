"""Issue 49: a draft worker method's probes follow how fresh its pooled evidence is, not how many
sessions it has (verify_service/policy/batch.py), and a session asked for no drafts has no
link until a probe (or its k) asks; it is opened a round before its probe
(verify_service/drafts/waits.py run_ahead), so the probe does not wait for the worker's prefill."""
import pytest
from test_draft_churn import Link
from test_verifier_logic import make_sched, params

from tandem.spec import Method
from verify_service.drafts.side import DraftSide
from verify_service.drafts.waits import missing, run_ahead
from verify_service.policy.batch import FRESH_TRIALS, AcceptancePool
from verify_service.policy.scheduler import EXPLORE_EVERY
from verify_service.session.sequence import Sequence

pytestmark = pytest.mark.unit


def low_pool(pool: AcceptancePool, rounds: int = 50) -> None:
    for _ in range(rounds):
        pool.learn(Method.DRAFT_MODEL, 4, 0)  # a method whose drafts do not pay


def running_seq(sched, session_id="s"):
    seq = Sequence(params(session_id, max_new=200))
    sched.add(seq)
    sched.update_from_output(sched.schedule().scheduled[0], 0)  # the prefill
    seq.commit([], 42)
    return seq


def test_the_pool_ages_per_step_its_rate_kept_until_under_one_trial():
    pool = AcceptancePool()
    for _ in range(3):
        pool.learn(Method.DRAFT_MODEL, 4, 1)
    rate = pool.rate(Method.DRAFT_MODEL)
    assert rate == pytest.approx(0.5) and pool.fresh(Method.DRAFT_MODEL)
    for _ in range(100):
        pool.age()
    assert pool.rate(Method.DRAFT_MODEL) == pytest.approx(rate)  # weight, not rate
    assert not pool.fresh(Method.DRAFT_MODEL)
    for _ in range(400):
        pool.age()
    assert pool.rate(Method.DRAFT_MODEL) is None  # the sessions' prior again


def test_a_fresh_pool_skips_probes_and_the_first_round_is_no_probe():
    sched = make_sched()
    seq = running_seq(sched)
    low_pool(sched.pool)
    seq.stats.rounds = 0
    assert sched.desired_k(seq, 1) == 0  # the first decode round: no probe of its own
    seq.stats.rounds = EXPLORE_EVERY - 1
    assert sched.desired_k(seq) == 0  # the pool knows: the probe is skipped
    while sched.pool.fresh(Method.DRAFT_MODEL):
        sched.pool.age()  # steps without drafts
    assert sched.desired_k(seq) == 1  # stale: this session's probe round probes
    sched._caps = {seq.session_id: 0}
    assert sched.desired_k(seq) == 1  # and the plan does not cut it


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
    while sched.pool.fresh(Method.DRAFT_MODEL):
        sched.pool.age()  # stale: probes are due
    seq.stats.rounds = EXPLORE_EVERY - 2  # the next round is plain, the one after a probe
    assert sched.desired_k(seq) == 0 and sched.desired_k(seq, 1) == 1
    assert run_ahead(seq, sched, side) == 2  # the link opens now, asking what the probe will
    assert missing(seq, sched, side) <= 0  # this round waits for nothing
    side.links[seq.session_id] = Link()  # linked: the round before a probe asks nothing more
    assert run_ahead(seq, sched, side) == 0
    seq.stats.rounds += 1
    assert run_ahead(seq, sched, side) == 2 and missing(seq, sched, side) == 1
