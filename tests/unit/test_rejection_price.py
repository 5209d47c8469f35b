"""Never slower under load (issue 49): in a shared step a rejected draft's row delays every
session beside it and saves nothing, so the batch plan prices that row a second time where a
draft is rejected (verify_service/policy/batch.py gains, draft_bar). At 4 sessions whose asks
end together, drafts kept at 0.6 (past the old bar of 0.5, a row's cost in tokens) cost ngram
and suffix 4-5% of plain's throughput: plain's steps ran 64 a batch whatever the others drafted."""
import asyncio

import pytest
from test_probe_pool import running_seq
from test_verifier_logic import make_sched, params

from tandem.spec import DraftToken, Method
from tandem.spec.cost import CostModel, StepCost
from verify_service.drafts.history import HistoryDrafts
from verify_service.engine import Engine, EngineConfig
from verify_service.policy.batch import draft_bar, drafts_may_pay, probe_pays, row_bar

pytestmark = pytest.mark.unit

# At 4 sessions a row costs half a token: (22.5 - 20) ms against 20 ms / 4 tokens.
HALF = StepCost({1: 10.0, 2: 15.0, 4: 20.0, 5: 22.5, 8: 30.0, 16: 50.0, 32: 90.0})
FLAT = StepCost({1: 10.0, 2: 10.2, 4: 10.5, 8: 11.0, 16: 12.0, 32: 14.0, 64: 18.0})
BOUND = StepCost({1: 10.0, 2: 20.0, 4: 40.0, 8: 80.0, 16: 160.0, 32: 320.0, 64: 640.0})


def history_batch(curve, reaches):
    """Decoding ngram sessions, one per entry of `reaches` (each draft's estimated reach)."""
    sched = make_sched(num_blocks=256)
    sched.cost = CostModel({1: 10.0, 2: 10.1, 3: 10.2, 4: 10.3, 5: 10.4})  # alone k pays
    seqs = [running_seq(sched, f"s{i}", Method.NGRAM) for i in range(len(reaches))]
    sched.step_cost = curve
    for seq, reach in zip(seqs, reaches):
        seq.local.in_verifier, seq.local.source = True, Method.NGRAM
        seq.drafts = [DraftToken(t) for t in range(5, 5 + len(reach))]
        seq.draft_reach = list(reach)
    return sched, seqs


def test_the_bar_prices_a_rejected_row_twice():
    assert row_bar(HALF, 4) == pytest.approx(0.5)
    assert draft_bar(HALF, 4) == pytest.approx(2 / 3)  # 0.5 for the row, 0.5 x (1 - r) more
    assert draft_bar(FLAT, 4) < 0.1  # rows nearly free (a GPU's small batch): hardly a bar
    assert draft_bar(BOUND, 32) == pytest.approx(1.0)  # a row costs a token: nothing pays


def test_a_shared_step_keeps_likely_drafts_and_drops_the_even_odds_ones():
    sched, seqs = history_batch(HALF, [[0.6] * 4, [0.95] * 4, [], []])
    counts = {s.seq.session_id: s.num_drafts for s in sched.schedule().scheduled}
    assert counts["s0"] == 0  # paid for its row (0.6 > 0.5), not for its rejection as well
    assert counts["s1"] == 4
    assert counts["s2"] == counts["s3"] == 0


def test_where_rows_are_nearly_free_even_odds_drafts_are_kept():
    sched, seqs = history_batch(FLAT, [[0.6] * 4, [0.4] * 4, [], []])
    counts = {s.seq.session_id: s.num_drafts for s in sched.schedule().scheduled}
    assert counts["s0"] == 4 and counts["s1"] == 4


def test_a_probe_needs_the_same_bar():
    sched, (seq, *_) = history_batch(HALF, [[0.6] * 4, [], [], []])
    assert not probe_pays(seq, HALF, 4)  # 0.6: over a row's cost, under draft_bar's 2/3
    seq.draft_reach = [0.7] * 4
    assert probe_pays(seq, HALF, 4)


def test_where_no_draft_can_pay_history_drafts_are_not_looked_up():
    async def main(curve):
        sched = make_sched(num_blocks=512)
        engine = Engine(None, sched, EngineConfig(), 100, history=HistoryDrafts(8))
        for i in range(32):
            engine.submit(params(f"s{i}", prompt=(1, 2, 3, 1, 2), max_new=50,
                                 method=Method.NGRAM))
        for s in sched.schedule().scheduled:  # the prefills
            sched.update_from_output(s, 0)
            s.seq.commit([], 3)  # ... 1, 2, 3: n-gram lookup proposes 1, 2, 3, ...
        sched.step_cost = curve
        return [bool(seq.local.proposals) for seq in engine._draft_locally()]

    assert drafts_may_pay(FLAT, 32) and asyncio.run(main(FLAT)) == [True] * 32
    assert not drafts_may_pay(BOUND, 32) and asyncio.run(main(BOUND)) == []
    assert drafts_may_pay(BOUND, 1)  # alone: its own cost curve sizes its drafts
