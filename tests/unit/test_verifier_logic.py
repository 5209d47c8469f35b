"""Sequence commit/epoch rules, adaptive k, and the torch-free scheduler."""
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.engine.block_manager import BlockManager
from tandem.sampling_params import SamplingParams
from tandem.spec import DraftToken, Method
from tandem.spec.cost import (
    CostModel,
    choose_k,
    expected_tokens,
    leviathan_speedup,
    update_acceptance,
)
from verify_service.config import SchedulerConfig
from verify_service.policy.feedback import Latency
from verify_service.policy.scheduler import Scheduler
from verify_service.session.params import GenerateParams
from verify_service.session.sequence import SeqStatus, Sequence

pytestmark = pytest.mark.unit
GREEDY = SamplingParams(temperature=0.0)


def params(session_id="s", prompt=(1, 2, 3), max_new=10, method=Method.DRAFT_MODEL, **kw):
    return GenerateParams(session_id=session_id, prompt=tuple(prompt), committed=(),
                          sampling=GREEDY, max_new_tokens=max_new,
                          stop_token_ids=frozenset({0}), method=method, **kw)


def drafts(seq, tokens):
    seq.drafts = [DraftToken(t) for t in tokens]


def test_scheduler_module_has_no_torch():
    import tandem.spec.cost  # noqa: F401
    import verify_service.policy.scheduler  # noqa: F401
    import verify_service.session.sequence  # noqa: F401

    for mod in ("verify_service.policy.scheduler", "verify_service.session.sequence",
                "tandem.spec.cost", "tandem.engine.block_manager"):
        src = Path(sys.modules[mod].__file__).read_text()
        assert "import torch" not in src
    # Nor through what they import (the shared vocabulary included).
    code = ("import sys, verify_service.policy.scheduler, verify_service.session.sequence; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_commit_keeps_epoch_when_bonus_matches_next_draft():
    seq = Sequence(params())
    drafts(seq, [7, 8, 9, 10])
    new = seq.commit([7, 8, 9], 10)
    assert new == [7, 8, 9, 10] and seq.epoch == 0 and seq.drafts == []
    drafts(seq, [5, 6])
    seq.commit([5], 4)  # recovered token differs from the rejected draft 6
    assert seq.epoch == 1 and seq.drafts == []


def test_commit_keeps_run_ahead_beyond_the_round():
    seq = Sequence(params())
    drafts(seq, [7, 8, 9, 10, 11])
    seq.commit([7, 8], 9)  # verified 2, bonus equals the third arrived draft
    assert seq.epoch == 0 and [d.token_id for d in seq.drafts] == [10, 11]
    assert seq.next_draft_position() == seq.num_tokens + 2  # the kept drafts follow on


def test_commit_cuts_at_stop_token_and_length():
    seq = Sequence(params(max_new=10))
    assert seq.commit([5, 0, 6], 7) == [5, 0] and seq.finish_reason == "stop"
    seq = Sequence(params(max_new=3))
    assert seq.commit([5, 6, 7, 8], 9) == [5, 6, 7] and seq.finish_reason == "length"


def test_generate_params_validation():
    with pytest.raises(ValueError, match="session_id"):
        params(session_id="")
    with pytest.raises(ValueError, match="prompt"):
        params(prompt=())
    with pytest.raises(ValueError, match="max_new_tokens"):
        params(max_new=0)
    with pytest.raises(ValueError, match="speculation method"):
        params(method="medusa-9000")


def test_expected_tokens_and_speedup():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert leviathan_speedup(0.8, 4, 0.05) == pytest.approx((1 - 0.8**5) / (0.2 * 1.2))


def test_choose_k_grows_with_acceptance():
    cost = CostModel()
    ks = [choose_k(a, 8, cost) for a in (0.0, 0.3, 0.6, 0.8, 0.95)]
    assert ks[0] == 0 and ks == sorted(ks) and ks[-1] >= 4
    assert choose_k(0.95, 2, cost) <= 2


def test_update_acceptance_moves_towards_observation():
    assert update_acceptance(0.5, 4, 4) > 0.5
    assert update_acceptance(0.5, 4, 0) < 0.5
    assert update_acceptance(0.5, 0, 0) == 0.5


def make_sched(num_blocks=64, block_size=4, **kw):
    return Scheduler(BlockManager(num_blocks, block_size), SchedulerConfig(**kw), CostModel())


def test_prefill_then_verify_then_rollback():
    sched = make_sched()
    seq = Sequence(params(prompt=range(1, 10)))
    sched.add(seq)
    out = sched.schedule()
    assert [s.is_prefill for s in out.scheduled] == [True]
    assert out.scheduled[0].token_ids == list(range(1, 10))
    sched.update_from_output(out.scheduled[0], 0)
    seq.commit([], 42)
    seq.est.acceptance_ema = 0.99
    drafts(seq, [43, 44, 45])
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.token_ids == [42, 43, 44, 45] and s.start_pos == 9 and s.num_drafts == 3
    sched.update_from_output(s, 1)  # one accepted: keep KV of 42 and 43
    assert sched.blocks.num_tokens(seq.session_id) == 11


def test_plain_sessions_never_verify_drafts():
    sched = make_sched()
    seq = Sequence(params(method=Method.NONE))
    sched.add(seq)
    sched.update_from_output(sched.schedule().scheduled[0], 0)
    seq.commit([], 9)
    drafts(seq, [1, 2])
    assert sched.schedule().scheduled[0].num_drafts == 0


def test_batch_load_caps_k():
    sched = make_sched(num_blocks=256, max_verify_tokens=16, max_spec_tokens=8)
    seqs = [Sequence(params(session_id=f"s{i}")) for i in range(8)]
    for s in seqs:
        sched.add(s)
    for s in sched.schedule().scheduled:
        sched.update_from_output(s, 0)
        s.seq.commit([], 9)
        s.seq.est.acceptance_ema = 0.99
        drafts(s.seq, [1] * 8)
    assert all(s.num_drafts <= 1 for s in sched.schedule().scheduled)  # 16 // 8 - 1


def test_preemption_when_blocks_run_out_and_recompute():
    sched = make_sched(num_blocks=6, block_size=4)
    a = Sequence(params(session_id="a", prompt=range(1, 9), max_new=50))
    b = Sequence(params(session_id="b", prompt=range(11, 19), max_new=50))
    sched.add(a)
    sched.add(b)
    for s in sched.schedule().scheduled:
        sched.update_from_output(s, 0)
        s.seq.commit([], 50)
    preempted = []
    for _ in range(6):  # grow both until the cache is full
        out = sched.schedule()
        preempted += out.preempted
        for s in out.scheduled:
            sched.update_from_output(s, 0)
            s.seq.commit([], 51)
    # The newest session went back to waiting and lost its KV; the oldest kept running.
    assert preempted[0] is b and a.sched.status is SeqStatus.RUNNING
    assert b.sched.status is SeqStatus.WAITING and not sched.blocks.has("b")
    sched.finish(a)
    (s,) = sched.schedule().scheduled  # b re-admitted: recomputes its committed tokens...
    assert s.seq is b and s.is_prefill and s.token_ids == b.tokens[s.start_pos:]
    assert s.start_pos == 8  # ...except its prompt blocks, still in the prefix cache
    sched.finish(b)
    assert sched.blocks.num_free_blocks == 6  # no leak


def test_context_limit():
    sched = make_sched(max_model_len=8)
    with pytest.raises(ValueError, match="exceeds the context"):
        sched.add(Sequence(params(prompt=range(1, 9))))


def test_abort_frees_blocks():
    sched = make_sched()
    seq = Sequence(params())
    sched.add(seq)
    sched.schedule()
    assert sched.abort("s") is seq and seq.finish_reason == "abort"
    assert sched.blocks.num_free_blocks == 64 and sched.num_sessions == 0


def test_carried_round_keeps_drafts_and_feeds_only_drafts():
    sched = make_sched()
    seq = Sequence(params(prompt=range(1, 10)))
    sched.add(seq)
    sched.update_from_output(sched.schedule().scheduled[0], 0)
    seq.commit([], 42)
    seq.est.acceptance_ema = 0.99
    drafts(seq, [43, 44, 45])
    (s,) = sched.schedule().scheduled
    sched.update_from_output(s, 3)
    epoch = seq.epoch
    assert seq.commit([43, 44, 45], None) == [43, 44, 45]  # no bonus: carried
    assert seq.epoch == epoch  # every committed token was a draft: run-ahead continues
    seq.sched.carried = True
    seq.drafts = [DraftToken(46), DraftToken(47)]
    (s,) = sched.schedule().scheduled
    # The last committed token (45) is already cached: only the waiting drafts go in.
    assert s.token_ids == [46, 47] and s.start_pos == seq.num_tokens and s.num_drafts == 2
    sched.update_from_output(s, 0)
    assert sched.blocks.num_tokens(seq.session_id) == seq.num_tokens
    seq.sched.carried, seq.drafts = True, []
    (s,) = sched.schedule().scheduled  # drafts vanished: a round without a forward
    assert s.token_ids == [] and s.num_drafts == 0


def test_measured_round_costs_switch_speculation_off_and_probes_continue():
    cost = CostModel()
    cost.observe(1, 46.0)  # a plain round
    cost.observe(2, 62.0)  # a k = 1 round incl. draft wait and sampling (measured here)
    assert choose_k(0.3, 1, cost) == 0  # 1.3 tokens per 62 ms < 1 per 46 ms
    assert choose_k(0.9, 1, cost) == 1  # 1.9 per 62 ms wins
    sched = Scheduler(BlockManager(64, 4), SchedulerConfig(max_spec_tokens=1), cost)
    seq = Sequence(params())
    seq.est.acceptance_ema = 0.3
    seq.stats.drafted = 8  # an estimate of its own (a fresh session's first round probes)
    ks = []
    for r in range(32):
        seq.stats.rounds = r
        ks.append(sched.desired_k(seq))
    assert ks.count(1) == 2 and ks.count(0) == 30  # off, with a probe every 16 rounds


def test_round_cost_is_keyed_by_the_tokens_the_forward_ran():
    """A carried round runs only its drafts: its time is the cost of k tokens, not k + 1;
    a round with no forward at all (sampled from the carried row) is not a cost sample; the
    wait for drafts is not in it (priced apart, by the draft's source)."""
    from verify_service.forward.step import StepTimings
    from verify_service.policy.feedback import observe_cost
    from verify_service.policy.scheduler import ScheduledSeq

    sched = make_sched()
    seq = Sequence(params())
    observe_cost(sched, [ScheduledSeq(seq, [5, 6], 4, 2, False)], 1.0, StepTimings(50.0, 2.0))
    observe_cost(sched, [ScheduledSeq(seq, [], 6, 0, False)], 0.0, StepTimings(0.0, 1.0))
    assert sched.cost.ms == {2: 52.0}  # 50 + 2; not the 1.0 ms wait


def test_draft_side_learns_how_long_the_first_draft_after_a_commit_takes():
    """The wait bound of a session with no drafts yet follows the measured delay from a
    commit to its first proposal; a commit that pauses drafting expects none."""
    import asyncio
    import time

    from tandem.spec import Proposal
    from verify_service.drafts.side import DraftSide

    class Link:
        address, sent = "l", []

        def send(self, msg):
            self.sent.append(msg)

    async def main():
        seq = Sequence(params())
        side = DraftSide({seq.session_id: seq}, 100, 4, 8)
        link = side.links[seq.session_id] = Link()
        for _ in range(20):
            side.commit(seq, seq.num_tokens, [], run_ahead=2)
            await asyncio.sleep(0.03)
            side.on_reply(link, Proposal(seq.session_id, seq.epoch, seq.next_draft_position(),
                                         DraftToken(5)))
            seq.drafts = []
        assert 20 < side.first.ms < 60  # ~30 ms, from 10 ms at the start
        side.commit(seq, seq.num_tokens, [], run_ahead=0)
        assert link.sent[-1].max_run_ahead == 0
        before = side.first.ms
        time.sleep(0.1)
        side.on_reply(link, Proposal(seq.session_id, seq.epoch, seq.next_draft_position(),
                                     DraftToken(5)))
        assert side.first.ms == before  # not asked for: says nothing about the delay

    asyncio.run(main())


def test_one_sessions_late_drafts_cost_the_batch_only_its_share_of_the_wait():
    from verify_service.engine import Engine, EngineConfig

    class Side:  # a DraftSide stand-in: everyone linked, measured delays fixed
        arrival, first = Latency(4.0), Latency(10.0)

        def linked(self, seq):
            return True

    sched = make_sched(max_spec_tokens=8)  # k at most the 8 drafts each session has
    engine = Engine(None, sched, EngineConfig(max_draft_wait_ms=25.0), 100)
    engine.drafts = Side()
    seqs = [Sequence(params(session_id=f"s{i}")) for i in range(4)]
    sched.running = seqs
    for seq in seqs:
        seq.est.acceptance_ema = 0.95  # k > 0 wanted by everyone
        drafts(seq, [1] * 8)  # ... and every draft is here
    assert engine._draft_wait_limit_ms() == 0.0
    seqs[0].drafts = []  # one session waits for its first draft and more
    k = sched.desired_k(seqs[0])
    alone = min(25.0, 1.5 * (10.0 + (k - 1) * 4.0))
    assert engine._draft_wait_limit_ms() == pytest.approx(alone / 4)
    for seq in seqs:
        seq.drafts = []
    assert engine._draft_wait_limit_ms() == pytest.approx(alone)


def test_medusa_tree_prefix_scheduled_and_probed_when_off():
    reach = (0.6, 0.3, 0.2, 0.1)
    flat = CostModel({q: 10.0 for q in range(1, 20)})
    sched = Scheduler(BlockManager(64, 4), SchedulerConfig(max_spec_tokens=3), flat,
                      tree_reach=reach)
    seq = Sequence(params(method=Method.MEDUSA))
    sched.add(seq)
    prefill = sched.schedule().scheduled[0]
    sched.update_from_output(prefill, 0)
    seq.output.append(5)
    drafts(seq, [11, 12, 13, 14])
    seq.draft_parents = (-1, -1, 0, 1)
    s = sched.schedule().scheduled[0]  # k capped at 3: the first three nodes, still a tree
    assert s.num_drafts == 3 and s.parents == (-1, -1, 0) and s.token_ids == [5, 11, 12, 13]
    sched.update_from_output(s, 2, [12, 13])  # path b -> c moved after the root
    assert sched.blocks.num_tokens(seq.session_id) == 6
    assert seq.commit([12, 13], 9) == [12, 13, 9] and seq.drafts == []
    assert seq.draft_parents is None and seq.epoch == 1  # a tree round ends its epoch
    # A tree the cost curve does not pay for is off, but probed every EXPLORE_EVERY rounds.
    steep = Scheduler(BlockManager(64, 4), SchedulerConfig(), CostModel(
        {1: 10.0, **{q: 40.0 * q for q in range(2, 20)}}), tree_reach=reach)
    ks = [steep.desired_k(seq, ahead) for ahead in range(16)]
    assert ks.count(0) == 15 and ks.count(1) == 1


def test_history_drafts_are_sized_by_their_own_confidence():
    """A session drafted in the verifier's step (ngram / suffix): the round verifies as many
    of its drafts as their per-token estimates pay for: all of a confident copy, a short
    prefix of a shaky one, none when nothing matched; and the drafts are made afresh after
    every commit (never carried over to another round)."""
    from tandem.proposers.ngram import confidences

    sched = make_sched(max_spec_tokens=12)
    seq = Sequence(params(prompt=range(1, 10), max_new=40, method=Method.NGRAM))
    seq.local.in_verifier = True
    sched.add(seq)
    sched.update_from_output(sched.schedule().scheduled[0], 0)
    seq.commit([], 42)
    verified = {}
    for held, n in ((32, 12), (2, 12), (0, 0)):
        drafts(seq, range(100, 100 + n))
        seq.draft_reach = list(confidences(held, n))
        (s,) = sched.schedule().scheduled
        verified[held] = s.num_drafts
        sched.update_from_output(s, 0)
        seq.commit([], 7)
        assert seq.drafts == [] and seq.draft_reach == []
    assert verified[32] > verified[2] >= 0 and verified[0] == 0
    assert verified[32] >= 6


def test_auto_takes_the_history_proposal_with_the_most_expected_tokens_per_ms():
    """auto asks suffix and ngram each round and keeps the proposal that promises the most
    tokens per ms of verify cost (verify_service/policy/auto.py); with no match anywhere it drafts
    nothing; a source that over-promised is corrected on its own."""
    from tandem.spec.cost import best_rate
    from verify_service.drafts.history import HistoryDrafts
    from verify_service.policy import auto

    sched = make_sched(max_spec_tokens=8)
    history = HistoryDrafts(8)
    text = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14] * 3 + [5, 6, 7]  # a copy that has held long
    picks, rates = {}, {}
    for method in (Method.NGRAM, Method.SUFFIX, Method.AUTO):
        seq = Sequence(params(session_id=method.api_name, prompt=text, max_new=20, method=method))
        history.fill([seq], lambda s: 8)
        if method is Method.AUTO:
            assert set(seq.local.proposals) == {Method.NGRAM, Method.SUFFIX}
            rates = {m: best_rate(p.reach, 8, sched.cost) for m, p in seq.local.proposals.items()}
        auto.pick(sched, seq)
        picks[method] = seq
    best = max(rates, key=rates.get)
    assert picks[Method.AUTO].local.source is best
    assert picks[Method.AUTO].drafts == picks[best].drafts
    assert [d.token_id for d in picks[Method.AUTO].drafts][:7] == [8, 9, 10, 11, 12, 13, 14]
    worse = Sequence(params(session_id="worse", prompt=text, max_new=20, method=Method.AUTO))
    worse.est.source_scale = {best: 0.05, Method.SUFFIX if best is Method.NGRAM else Method.NGRAM:
                          1.0}  # the better proposer has kept over-promising here
    history.fill([worse], lambda s: 8)
    auto.pick(sched, worse)
    assert worse.local.source is not best
    fresh = Sequence(params(session_id="fresh", prompt=[1, 2, 3, 4], method=Method.AUTO))
    history.fill([fresh], lambda s: 8)
    auto.pick(sched, fresh)
    assert fresh.drafts == [] and fresh.draft_reach == [] and fresh.local.source is None
    history.finish(fresh)  # forgets it in both proposers, learns it for suffix


def test_history_sessions_start_from_what_finished_ones_measured():
    from verify_service.drafts.history import HistoryDrafts

    history = HistoryDrafts(8)
    assert history.prior_scales(Method.AUTO) == {Method.SUFFIX: 1.0, Method.NGRAM: 1.0,
                                                 Method.MEDUSA: 1.0}
    seq = Sequence(params(method=Method.SUFFIX))
    seq.est.source_scale = {Method.SUFFIX: 0.2}  # its drafts were accepted far less than hoped
    seq.est.drafted_from = {Method.SUFFIX}
    history.finish(seq)
    assert history.prior_scales(Method.SUFFIX)[Method.SUFFIX] < 1.0
    assert history.prior_scales(Method.AUTO)[Method.NGRAM] == 1.0
    assert history.prior_scales(Method.SUFFIX, greedy=False) == {Method.SUFFIX: 1.0}
    idle = Sequence(params(session_id="idle", method=Method.NGRAM))
    idle.est.source_scale = {Method.NGRAM: 0.1}  # never drafted: says nothing
    history.finish(idle)
    assert history.prior_scales(Method.NGRAM) == {Method.NGRAM: 1.0}


def test_draft_latency_estimates_recover_within_a_few_healthy_rounds():
    # A slow spell (300 ms per first draft) followed by a healthy link (10 ms): the estimate
    # that bounds the draft wait is back under the verifier's 25 ms wait within 5 samples.
    est = Latency(10.0)
    for _ in range(30):
        est.observe(300.0)
    assert est.ms > 250  # it did learn the slow link
    healthy = 0
    while est.ms >= 25.0:
        est.observe(10.0)
        healthy += 1
    assert healthy <= 5, healthy
    one_spike = Latency(10.0)
    one_spike.observe(300.0)
    assert one_spike.ms < 75  # a single slow sample moves it only part of the way
