"""Issue 49: under a batch plan a periodic probe verifies its draft past the plan's cut only
where that draft could pay before the session's own correction (verify_service/policy/batch.py
probe_pays): at 32 sessions on a compute-bound step a row costs nearly what it makes, and the
probes were most of the drafted rows; with a few sessions (or alone) probes run as before."""
import pytest
from test_probe_pool import low_pool, running_seq, stale
from test_verifier_logic import make_sched, params

from tandem.spec import Method
from tandem.spec.cost import StepCost
from verify_service.policy.batch import probe_pays
from verify_service.policy.scheduler import EXPLORE_EVERY
from verify_service.session.sequence import Sequence

pytestmark = pytest.mark.unit

BOUND = StepCost({1: 10.0, 2: 20.0, 4: 40.0, 8: 80.0, 16: 160.0, 32: 320.0, 64: 640.0})
FLAT = StepCost({1: 10.0, 2: 10.2, 4: 10.5, 8: 11.0, 16: 12.0, 32: 14.0, 64: 18.0})


def history_seq(sched, reach, session_id="h"):
    seq = running_seq(sched, session_id, Method.NGRAM)
    seq.local.in_verifier, seq.local.source = True, Method.NGRAM
    seq.draft_reach = list(reach)
    return seq


def test_the_bar_is_a_rows_cost_over_a_tokens():
    seq = Sequence(params(method=Method.NGRAM))
    seq.local.in_verifier, seq.draft_reach = True, [0.6]
    assert not probe_pays(seq, BOUND, 32)  # a row costs a token: bar 1
    assert probe_pays(seq, FLAT, 32)  # rows nearly free: bar ~0.01
    seq.draft_reach = []
    assert not probe_pays(seq, FLAT, 32)  # no proposal: nothing to test


def test_a_history_probe_past_the_cut_only_where_its_draft_could_pay():
    sched = make_sched()
    seq = history_seq(sched, [0.6, 0.5])
    other = history_seq(sched, [], "other")
    seq.est.source_scale[Method.NGRAM] = 0.05  # its correction says drafts do not pay
    seq.stats.rounds = EXPLORE_EVERY - 1  # a probe round
    assert sched.desired_k(seq) >= 1  # no step curve, no plan: it probes
    sched.step_cost, sched._caps = BOUND, {seq.session_id: 0, other.session_id: 0}
    assert sched.desired_k(seq) == 0  # compute-bound: its prior cannot clear the bar
    sched.step_cost = FLAT
    assert sched.desired_k(seq) >= 1  # rows nearly free: the probe tests the correction
    seq.stats.rounds += 1
    assert sched.desired_k(seq) == 0  # only in its probe round


def test_a_worker_probe_under_a_compute_bound_plan_is_skipped():
    sched = make_sched()
    seq = running_seq(sched)
    running_seq(sched, "other")
    low_pool(sched.pool)
    stale(sched, seq)
    seq.stats.rounds = EXPLORE_EVERY - 1
    sched._caps = {seq.session_id: 0}
    sched.step_cost = FLAT
    assert sched.desired_k(seq) == 1  # a stale pool on a cheap step: it probes
    sched.step_cost = BOUND
    assert sched.desired_k(seq) == 0  # even the prior (0.7) cannot pay a compute-bound row


def test_a_worker_probe_hopes_for_its_pools_rate_not_the_prior():
    # At 4 sessions (bar ~0.5) a draft model its pool has at ~0.2 probed on the prior (0.7):
    # each probe made the whole step wait for the worker.
    half = StepCost({1: 10.0, 2: 15.0, 4: 20.0, 5: 22.5, 8: 30.0, 16: 50.0, 32: 90.0})
    sched = make_sched()
    seq = running_seq(sched)
    for _ in range(3):
        sched.pool.learn(Method.DRAFT_MODEL, 4, 0)  # three rounds, nothing accepted
    assert not sched.pool.fresh(Method.DRAFT_MODEL)
    assert not probe_pays(seq, half, 4, sched.pool)  # hopes (0 + 1) / (3 + 1) = 0.25 < 0.5
    assert probe_pays(seq, half, 4)  # without the pool: the prior 0.7
    assert probe_pays(seq, FLAT, 4, sched.pool)  # a cheap row: still worth a probe
    for _ in range(20):
        sched.pool.learn(Method.DRAFT_MODEL, 4, 4)  # the method pays after all
    assert probe_pays(seq, half, 4, sched.pool)
