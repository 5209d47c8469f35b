"""Issue 49: a draft worker's probes and Opens beside other sessions (policy/batch.py).
A probe whose drafts had not come by its round stays open for them a few rounds and verifies
them when they come, never waited for; where a batch plan prices the step, no probe is waited
for; and a session admitted beside others asks its worker for nothing before a plan has sized
it (its Open would have the worker prefill and draft what the plan then cuts)."""
import pytest
from test_draft_churn import Link
from test_probe_pool import low_pool, running_seq, stale
from test_verifier_logic import drafts, make_sched, params

from tandem.spec import Method
from tandem.spec.cost import StepCost
from verify_service.drafts.side import DraftSide
from verify_service.drafts.waits import missing, run_ahead
from verify_service.policy.batch import PROBE_GRACE, late_probe
from verify_service.policy.scheduler import EXPLORE_EVERY
from verify_service.session.sequence import Sequence

pytestmark = pytest.mark.unit
CURVE = {1: 10.0, 2: 10.5, 4: 11.0, 8: 12.0, 16: 14.0}


def _round(sched, seq, token=42):
    """One scheduled round of the session, its drafts rejected: how many it verified."""
    (s,) = [s for s in sched.schedule().scheduled if s.seq is seq]
    sched.update_from_output(s, 0)
    seq.commit([], token)
    seq.stats.rounds += 1
    return s.num_drafts


def _probe_due(sched, planned=True):
    """A draft-model session whose round probes; `planned`: beside another session, under a
    batch plan (else alone)."""
    seq = running_seq(sched)
    if planned:
        running_seq(sched, "other", Method.NONE)
        sched.step_cost = StepCost(dict(CURVE))
    side = DraftSide({seq.session_id: seq}, 100, 4, 8)
    side.links[seq.session_id] = Link()
    low_pool(sched.pool)
    stale(sched, seq)  # its method's evidence is old: probes are due
    seq.stats.rounds = EXPLORE_EVERY - 1  # this round probes
    return seq, side


def test_a_probe_whose_drafts_are_late_verifies_them_when_they_come():
    sched = make_sched()
    seq, side = _probe_due(sched)
    assert sched.desired_k(seq) == 1 and not late_probe(seq)
    assert _round(sched, seq) == 0  # none had come: the probe stays open
    assert seq.sched.probe_until == EXPLORE_EVERY - 1 + PROBE_GRACE and late_probe(seq)
    assert sched.desired_k(seq) == 1 and run_ahead(seq, sched, side) == 2  # still asking
    assert missing(seq, sched, side) == 0  # and not waited for
    drafts(seq, [7])  # they came
    assert _round(sched, seq, token=8) == 1  # verified (rejected), the pool told
    assert not late_probe(seq) and sched.desired_k(seq) == 0  # closed


def test_an_open_probe_closes_after_its_grace_rounds():
    sched = make_sched()
    seq, _ = _probe_due(sched)
    for _ in range(PROBE_GRACE + 1):  # the probe's round and its grace, nothing came
        assert sched.desired_k(seq) == 1
        assert _round(sched, seq) == 0
    assert not late_probe(seq) and sched.desired_k(seq) == 0


def test_beside_others_a_probe_is_not_waited_for():
    sched = make_sched()
    seq, side = _probe_due(sched, planned=False)
    assert missing(seq, sched, side) == 1  # alone: its probe waits for its draft
    other = running_seq(sched, "other")
    sched.step_cost = StepCost(dict(CURVE))  # a batch plan prices the step
    stale(sched, seq)
    assert sched.desired_k(seq) == 1 and missing(seq, sched, side) == 0
    assert missing(other, sched, side) <= 0


def test_alone_a_late_probe_opens_no_window_and_its_next_round_waits():
    # A drafter slower than a step (layer skip reading a prompt) would otherwise never be
    # waited for again, and never verify a draft.
    sched = make_sched()
    seq, side = _probe_due(sched, planned=False)
    assert _round(sched, seq) == 0  # none had come
    assert not late_probe(seq) and seq.sched.probe_until == -1


def test_admitted_beside_others_a_worker_session_asks_for_nothing_before_a_plan():
    sched = make_sched()
    sched.step_cost = StepCost(dict(CURVE))
    first = running_seq(sched, "first")
    seq = Sequence(params("new", method=Method.DRAFT_MODEL))
    sched.add(seq)
    side = DraftSide({seq.session_id: seq, first.session_id: first}, 100, 4, 8)
    assert sched.pool.rate(Method.DRAFT_MODEL) is None  # no evidence: the prior would draft
    assert sched.desired_k(seq, 1) == 0 and run_ahead(seq, sched, side, 1) == 0  # no Open
    sched.abort("first")
    assert sched.desired_k(seq, 1) > 0  # alone: no plan, its own k
