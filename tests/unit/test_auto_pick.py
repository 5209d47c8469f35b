"""`auto`'s choice between the token history's proposal and the Medusa heads'
(verify_service/policy/auto.py): by expected tokens per ms, each with its own correction, and
the heads asked only when the round verifies no history drafts."""
import pytest
from test_probe_pool import running_seq

from tandem.engine.block_manager import BlockManager
from tandem.sampling_params import SamplingParams
from tandem.spec import DraftToken, Method
from tandem.spec.cost import CostModel, StepCost, best_rate, choose_tree_size
from verify_service.config import SchedulerConfig
from verify_service.policy import auto
from verify_service.policy.feedback import learn_acceptance
from verify_service.policy.scheduler import ScheduledSeq, Scheduler
from verify_service.session.params import GenerateParams
from verify_service.session.sequence import LocalProposal, Sequence

pytestmark = pytest.mark.unit

CURVE = {1: 20.0, 2: 28.0, 4: 36.0, 8: 54.0, 16: 88.0}  # ms by new tokens (this CPU's)
TREE = (0.6, 0.3, 0.25, 0.2, 0.1, 0.1)  # the heads' held-out reach, node by node
CHAIN = (0.6, 0.3, 0.15)


def _setup(tree=True):
    sched = Scheduler(BlockManager(64, 16), SchedulerConfig(max_spec_tokens=8),
                      CostModel(dict(CURVE)), tree_reach=TREE, chain_reach=CHAIN)
    seq = Sequence(GenerateParams(session_id="s", prompt=(1, 2, 3), committed=(),
                                  sampling=SamplingParams(temperature=0.0), max_new_tokens=64,
                                  stop_token_ids=frozenset(), method=Method.AUTO, tree=tree))
    seq.local.in_verifier = True
    return sched, seq


def _heads(sched, seq, n=6):
    """The heads' proposal, as the engine files it after a step."""
    drafts, parents = [DraftToken(100 + i) for i in range(n)], (-1, -1, 0, 1, 0, 2)[:n]
    seq.local.proposals[Method.MEDUSA] = auto.heads_proposal(sched, seq, drafts, parents)


def _history(seq, source, reach, first=7):
    seq.local.offer(source, LocalProposal([DraftToken(first + i) for i in range(len(reach))],
                                          None, list(reach)))


def test_the_heads_fill_a_round_the_history_has_nothing_for():
    sched, seq = _setup()
    _heads(sched, seq)
    auto.pick(sched, seq)
    assert seq.local.source is Method.MEDUSA and seq.local.proposals == {}
    assert [d.token_id for d in seq.drafts] == list(range(100, 106))
    assert seq.draft_parents == (-1, -1, 0, 1, 0, 2)
    assert sched.reach(seq) == pytest.approx(TREE)


def test_a_confident_history_match_beats_the_heads():
    sched, seq = _setup()
    _history(seq, Method.SUFFIX, [0.95] * 8)
    _heads(sched, seq)
    auto.pick(sched, seq)
    assert seq.local.source is Method.SUFFIX and seq.draft_parents is None
    assert [d.token_id for d in seq.drafts] == list(range(7, 15))


def test_a_weak_history_match_loses_to_the_heads_and_the_rates_decide():
    sched, seq = _setup()
    _history(seq, Method.NGRAM, [0.2])
    _heads(sched, seq)
    assert best_rate(TREE, 8, sched.cost) > best_rate([0.2], 8, sched.cost)
    auto.pick(sched, seq)
    assert seq.local.source is Method.MEDUSA


def test_a_long_proposal_does_not_win_on_its_sum_when_it_costs_more_than_it_brings():
    sched, seq = _setup()
    _history(seq, Method.SUFFIX, [0.9, 0.85, 0.8])
    # sums higher; other tokens (one proposal that starts with the other is taken whole)
    _history(seq, Method.NGRAM, [0.9, 0.5, 0.4, 0.3, 0.3, 0.3, 0.3, 0.3], first=50)
    proposals = seq.local.proposals
    assert sum(proposals[Method.NGRAM].reach) > sum(proposals[Method.SUFFIX].reach)
    auto.pick(sched, seq)
    assert seq.local.source is Method.SUFFIX


def test_heads_that_over_promise_lose_their_scale_not_the_historys():
    sched, seq = _setup()
    seq.est.source_scale = {Method.SUFFIX: 1.0, Method.NGRAM: 1.0}
    _heads(sched, seq)
    auto.pick(sched, seq)
    reach = sched.reach(seq)
    n = choose_tree_size(reach, 8, sched.cost)
    s = ScheduledSeq(seq, [3, *range(n)], 2, n, False, n)
    for _ in range(6):  # nothing the heads propose is ever accepted
        learn_acceptance(seq, s, 0, reach, lambda _: False)
    assert seq.est.source_scale[Method.MEDUSA] < 0.5 and seq.est.source_scale[Method.SUFFIX] == 1.0
    assert seq.est.drafted_from == {Method.MEDUSA} and seq.est.tree_scale == 1.0
    assert auto.head_nodes(sched, seq) < choose_tree_size(TREE, 8, sched.cost)


def test_the_heads_run_only_after_the_history_missed_and_not_beside_its_drafts():
    sched, seq = _setup()
    for _ in range(auto.HEADS_AFTER_MISSES):
        assert not auto.wants_heads(seq, 0)  # a miss or two: copying may go on next round
        auto.pick(sched, seq)  # nothing proposed: one more miss
    assert auto.wants_heads(seq, 0)
    seq.local.source = Method.SUFFIX
    assert not auto.wants_heads(seq, 5)
    seq.local.source = Method.MEDUSA
    assert auto.wants_heads(seq, 3)
    _history(seq, Method.NGRAM, [0.9])
    auto.pick(sched, seq)  # the history matched again
    assert seq.local.history_misses == 0 and not auto.wants_heads(seq, 0)
    seq.params = GenerateParams(session_id="t", prompt=(1,), committed=(),
                                sampling=SamplingParams(), max_new_tokens=4,
                                stop_token_ids=frozenset(), method=Method.SUFFIX)
    assert not auto.wants_heads(seq, 0)


def test_chain_shaped_auto_sessions_use_the_heads_chain_estimates():
    sched, seq = _setup(tree=False)
    seq.local.proposals[Method.MEDUSA] = auto.heads_proposal(
        sched, seq, [DraftToken(5), DraftToken(6), DraftToken(8)], (-1, 0, 1))
    auto.pick(sched, seq)
    assert sched.reach(seq) == pytest.approx(CHAIN)


def test_heads_that_cannot_pay_for_their_own_pass_are_not_run():
    sched, seq = _setup()
    assert auto.head_nodes(sched, seq) > 0  # free heads: some nodes pay
    assert auto.head_nodes(sched, seq, heads_ms=40.0) == 0  # a pass dearer than a round
    seq.est.source_scale[Method.MEDUSA] = 0.1  # or heads this session found wrong
    assert auto.head_nodes(sched, seq) == 0


def test_under_a_batch_plan_heads_run_only_where_their_first_node_clears_the_bar():
    # 16 sessions on a compute-bound step: the plan would cut the heads' drafts after their
    # pass was paid (auto ran 10% under plain through the gateway, drafting nothing).
    sched, seq = _setup()
    sched.add(seq)
    for i in range(15):
        running_seq(sched, f"o{i}")
    sched.step_cost = StepCost({1: 10.0, 2: 20.0, 4: 40.0, 8: 80.0, 16: 160.0, 32: 320.0})
    assert auto.head_nodes(sched, seq) == 0  # bar 1: a 0.6 first node cannot pay
    sched.step_cost = StepCost({1: 10.0, 2: 10.2, 4: 10.5, 8: 11.0, 16: 12.0, 32: 14.0})
    assert auto.head_nodes(sched, seq) > 0  # rows nearly free: as alone
