"""Greedy and sampled sessions price their rounds on apart single-session curves
(Scheduler.cost_of): a sampled row also pays its distribution and its keyed draw (about a ms
a row on this CPU), which a curve shared with greedy rounds would not show, so sampled
sessions would verify drafts that do not pay for themselves."""
from dataclasses import replace

import pytest
from test_verifier_logic import drafts, make_sched, params

from tandem.sampling_params import SamplingParams
from tandem.spec import Method
from verify_service.forward.step import StepTimings
from verify_service.policy.feedback import observe_cost
from verify_service.policy.scheduler import ScheduledSeq
from verify_service.session.sequence import Sequence

pytestmark = pytest.mark.unit
SAMPLED = SamplingParams(temperature=0.7, seed=7)


def _sampled(session_id, **kw):
    return Sequence(replace(params(session_id, **kw), sampling=SAMPLED))


def _round(sched, seq, tokens, ms):
    observe_cost(sched, [ScheduledSeq(seq, tokens, 4, len(tokens) - 1, False)], 0.0,
                 StepTimings(ms, 0.0))


def test_each_session_feeds_and_reads_its_own_curve():
    sched = make_sched()
    greedy = Sequence(params("g"))
    sampled = _sampled("s")
    assert sched.cost_of(greedy) is sched.cost and sched.cost_of(sampled) is sched.sampled_cost
    _round(sched, greedy, [5, 6, 7], 30.0)
    _round(sched, sampled, [5, 6, 7], 45.0)
    assert sched.cost.ms == {3: 30.0} and sched.sampled_cost.ms == {3: 45.0}


def test_a_sampled_session_drafts_less_where_its_rows_cost_more():
    sched = make_sched(max_spec_tokens=8)
    greedy = Sequence(params("g", method=Method.DRAFT_MODEL, max_new=100))
    sampled = _sampled("s", method=Method.DRAFT_MODEL, max_new=100)
    for seq in (greedy, sampled):
        seq.est.acceptance_ema = 0.5
        drafts(seq, [1] * 8)
    for q in range(1, 10):  # same forward; a sampled row adds 3 ms of its own
        sched.cost.observe(q, 20.0 + 1.0 * (q - 1))
        sched.sampled_cost.observe(q, 20.0 + 4.0 * (q - 1))
    assert 0 < sched._solo_k(sampled) < sched._solo_k(greedy)
