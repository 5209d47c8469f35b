"""`auto` linked to a draft worker's model method (verify_service/policy/auto.py): the
worker's chain kept apart from the verifier's own proposals (Sequence.remote), picked by the
same rule when it arrived, asked for only once the token history keeps missing and paused
while it matches."""
import asyncio

import pytest

from tandem.engine.block_manager import BlockManager
from tandem.errors import InvalidArgument
from tandem.sampling_params import SamplingParams
from tandem.spec import Commit, DraftToken, Method, Open
from tandem.spec import Proposal as Reply
from tandem.spec.cost import CostModel
from verify_service.config import SchedulerConfig
from verify_service.drafts.side import DraftSide
from verify_service.drafts.waits import missing
from verify_service.policy import auto
from verify_service.policy.feedback import learn_acceptance
from verify_service.policy.scheduler import EXPLORE_EVERY, ScheduledSeq, Scheduler
from verify_service.session.params import GenerateParams
from verify_service.session.sequence import LocalProposal, Sequence

pytestmark = pytest.mark.unit

CURVE = {1: 20.0, 2: 22.0, 4: 26.0, 8: 34.0, 16: 50.0}  # ms by new tokens (a cheap verify)
Q = ((7, 8), (0.75, 0.25))  # a sampled draft's q (top-2)


def _setup(auto_draft=Method.DRAFT_MODEL, temperature=0.0):
    sched = Scheduler(BlockManager(64, 16), SchedulerConfig(max_spec_tokens=8),
                      CostModel(dict(CURVE)))
    seq = Sequence(GenerateParams(
        session_id="s", prompt=(1, 2, 3), committed=(),
        sampling=SamplingParams(temperature=temperature), max_new_tokens=64,
        stop_token_ids=frozenset(), method=Method.AUTO, auto_draft=auto_draft))
    seq.local.in_verifier = True
    return sched, seq


def _remote(seq, n, acceptance=0.9):
    seq.est.acceptance_ema = acceptance
    seq.remote = [DraftToken(7 + i, *Q) for i in range(n)]


def _history(seq, source, reach):
    seq.local.offer(source, LocalProposal([DraftToken(50 + i) for i in range(len(reach))],
                                          None, list(reach)))


def test_an_arrived_worker_chain_fills_a_round_the_history_has_nothing_for():
    sched, seq = _setup(temperature=1.0)
    _remote(seq, 4)
    auto.pick(sched, seq, asked=5)
    assert seq.local.source is Method.DRAFT_MODEL and seq.draft_parents is None
    assert seq.drafts == seq.remote and seq.drafts is not seq.remote  # a copy
    assert all((d.q_ids, d.q_probs) == Q for d in seq.drafts)  # q stays with its tokens
    assert sched.reach(seq) == pytest.approx([0.9 ** (i + 1) for i in range(4)])
    assert sched.desired_k(seq) > 0


def test_a_confident_history_match_beats_the_worker_and_their_tokens_never_mix():
    sched, seq = _setup(temperature=1.0)
    _remote(seq, 4, acceptance=0.6)
    _history(seq, Method.SUFFIX, [0.95] * 8)
    auto.pick(sched, seq, asked=5)
    assert seq.local.source is Method.SUFFIX
    assert [d.token_id for d in seq.drafts] == list(range(50, 58))
    assert all(not d.q_ids for d in seq.drafts)  # one-hot: the history's own tokens only
    assert len(seq.remote) == 4  # the worker's chain is kept apart, untouched


def test_a_worker_that_over_promises_loses_to_a_modest_history_match():
    sched, seq = _setup()
    _remote(seq, 4, acceptance=0.2)
    _history(seq, Method.NGRAM, [0.8, 0.7])
    auto.pick(sched, seq, asked=5)
    assert seq.local.source is Method.NGRAM


def test_nothing_arrived_is_a_late_round_and_nothing_is_taken():
    sched, seq = _setup()
    auto.pick(sched, seq, asked=5)
    assert seq.drafts == [] and seq.est.late_rounds == 1
    auto.pick(sched, seq, asked=0)  # paused: not asked, not late
    _history(seq, Method.SUFFIX, [0.9])
    auto.pick(sched, seq, asked=5)  # the history matched: not waited for, not late
    assert seq.est.late_rounds == 1
    _remote(seq, 2)
    auto.pick(sched, seq, asked=5)
    assert seq.est.late_rounds == 0 and seq.local.source is Method.DRAFT_MODEL


def test_the_worker_is_paused_while_the_history_matches_and_asked_once_it_misses():
    sched, seq = _setup()
    first, gap = 5.0, 1.0
    _history(seq, Method.SUFFIX, [0.9] * 4)
    auto.pick(sched, seq)
    assert auto.remote_run_ahead(sched, seq, first, gap) == 0  # history drafts verified
    for _ in range(auto.HEADS_AFTER_MISSES):
        assert auto.remote_run_ahead(sched, seq, first, gap) == 0  # a miss or two: wait
        auto.pick(sched, seq)  # the history found nothing
    k = auto.remote_run_ahead(sched, seq, first, gap)
    assert k >= 2  # its chain pays (and one more, for the bonus token)
    _remote(seq, k - 1)
    _history(seq, Method.NGRAM, [0.1])  # a weak match: the worker's chain still wins
    auto.pick(sched, seq, asked=k)
    assert seq.local.source is Method.DRAFT_MODEL and seq.local.history_misses == 0
    assert auto.remote_run_ahead(sched, seq, first, gap) > 0  # its drafts verified: go on
    _history(seq, Method.SUFFIX, [0.95] * 8)
    seq.remote = []
    auto.pick(sched, seq, asked=k)
    assert auto.remote_run_ahead(sched, seq, first, gap) == 0  # matching again: paused


def test_a_slow_or_poor_worker_is_not_asked_except_for_a_probe():
    sched, seq = _setup()
    for _ in range(auto.HEADS_AFTER_MISSES):
        auto.pick(sched, seq)
    assert auto.remote_run_ahead(sched, seq, 5.0, 1.0) > 0
    assert auto.remote_run_ahead(sched, seq, 200.0, 50.0) == 0  # the wait costs more
    seq.est.acceptance_ema = 0.05
    assert auto.remote_run_ahead(sched, seq, 5.0, 1.0) == 0
    seq.stats.rounds = auto.PROBE_EVERY + EXPLORE_EVERY - 1  # the next round is a probe
    assert auto.remote_run_ahead(sched, seq, 200.0, 50.0) == 2
    seq.stats.rounds += EXPLORE_EVERY  # the scheduler's probe, not the worker's: rarer
    assert auto.remote_run_ahead(sched, seq, 200.0, 50.0) == 0
    _, plain = _setup(auto_draft=None)
    plain.local.history_misses = 5
    assert auto.remote_run_ahead(sched, plain, 0.0, 0.0) == 0  # no worker linked


def test_the_worker_chain_learns_its_acceptance_not_a_history_scale():
    sched, seq = _setup()
    seq.est.source_scale = {Method.SUFFIX: 1.0, Method.NGRAM: 1.0}
    _remote(seq, 4, acceptance=0.9)
    auto.pick(sched, seq, asked=5)
    reach = sched.reach(seq)
    s = ScheduledSeq(seq, [3, 7, 8, 9, 10], 2, 4, False, 4)
    for _ in range(5):
        learn_acceptance(seq, s, 0, reach, lambda _: True)
    assert seq.est.acceptance_ema < 0.5 and seq.est.drafted_from == {Method.DRAFT_MODEL}
    assert seq.est.source_scale == {Method.SUFFIX: 1.0, Method.NGRAM: 1.0}
    assert seq.est.late_rounds == 0


def test_a_commit_keeps_the_worker_chain_only_where_it_holds_the_new_tokens():
    _, seq = _setup()
    _remote(seq, 4)  # tokens 7, 8, 9, 10
    seq.drafts = [DraftToken(50)]
    seq.commit([7], 8)  # its first two: the rest goes on in the same epoch
    assert [d.token_id for d in seq.remote] == [9, 10] and seq.epoch == 0
    assert seq.drafts == []  # the round's proposal is drafted afresh
    seq.commit([9, 10], 11)  # beyond what arrived: the worker's state is unknown
    assert seq.remote == [] and seq.epoch == 1
    _remote(seq, 2)
    seq.commit([], 99)  # diverged
    assert seq.remote == [] and seq.epoch == 2


def test_only_auto_takes_a_worker_method_and_only_a_model_one():
    with pytest.raises(InvalidArgument):
        _setup(auto_draft=Method.NGRAM)
    with pytest.raises(InvalidArgument):
        GenerateParams(session_id="s", prompt=(1,), committed=(), sampling=SamplingParams(),
                       max_new_tokens=4, stop_token_ids=frozenset(), method=Method.SUFFIX,
                       auto_draft=Method.DRAFT_MODEL)
    _, eagle = _setup(auto_draft=Method.EAGLE)
    assert eagle.needs_features and eagle.link_method is Method.EAGLE
    _, plain = _setup(auto_draft=None)
    assert not plain.needs_features


def test_the_draft_side_files_the_workers_tokens_apart_and_waits_only_when_useful():
    class Link:
        address = "w"

        def __init__(self):
            self.sent = []

        def send(self, msg):
            self.sent.append(msg)

    class Pool:
        def __init__(self, link):
            self.link = link

        async def get(self, hint="", avoid=()):
            return self.link

        def mark_failed(self, address, link=None):
            pass

    async def main():
        sched, seq = _setup(temperature=1.0)
        side = DraftSide({seq.session_id: seq}, 100, 4, 8, Pool(Link()))
        side.attach(seq)
        side.commit(seq, seq.num_tokens, [], run_ahead=0)
        await asyncio.sleep(0)
        assert not side.linked(seq)  # not linked until its worker is asked for drafts
        side.commit(seq, seq.num_tokens, [], run_ahead=3)
        await asyncio.sleep(0)
        link = side.links[seq.session_id]
        (opened,) = link.sent
        assert isinstance(opened, Open) and opened.method is Method.DRAFT_MODEL
        assert not opened.tree and opened.max_run_ahead == 3
        assert missing(seq, sched, side) == 2
        side.commit(seq, seq.num_tokens, [], run_ahead=0)  # paused: still told every commit
        assert isinstance(link.sent[-1], Commit) and link.sent[-1].max_run_ahead == 0
        assert missing(seq, sched, side) == 0  # paused: nothing to wait for
        side.commit(seq, seq.num_tokens, [], run_ahead=3)
        seq.stats.rounds = EXPLORE_EVERY - 1
        assert missing(seq, sched, side) == 0  # a probe's chain is taken if it is there
        seq.stats.rounds = 0
        side.on_reply(link, Reply(seq.session_id, seq.epoch, seq.num_tokens, DraftToken(7, *Q)))
        assert seq.drafts == [] and [d.token_id for d in seq.remote] == [7]
        assert missing(seq, sched, side) == 1
        _history(seq, Method.SUFFIX, [0.9])
        assert missing(seq, sched, side) == 0  # the history matched: no wait for the worker
        side.on_link_broken(link)
        assert seq.remote == [] and not side.linked(seq)

    asyncio.run(main())


def test_auto_draft_method_on_the_wire():
    from gateway.plan import GenerationPlan
    from gateway.verifier import build_request
    from tandem.v1 import common_pb2
    from verify_service.server import params_from_proto

    info = common_pb2.WorkerInfo(max_spec_tokens=16, vocab_size=100,
                                 max_context_length=64)
    plan = GenerationPlan(session_id="s", prompt_token_ids=(1, 2), sampling=SamplingParams(),
                          max_new_tokens=4, stop_token_ids=(), ignore_eos=False,
                          method=Method.AUTO, num_speculative_tokens=0)
    plain = build_request(plan, [], "")
    assert plain.speculation.auto_draft_method == common_pb2.SPECULATION_METHOD_UNSPECIFIED
    assert params_from_proto(plain, info, Method.NONE).auto_draft is None
    linked = build_request(plan, [], "10.0.0.1:1", Method.EAGLE)
    assert linked.speculation.auto_draft_method == common_pb2.SPECULATION_METHOD_EAGLE
    assert params_from_proto(linked, info, Method.NONE).auto_draft is Method.EAGLE
    for method, auto_draft in ((Method.AUTO, Method.SUFFIX), (Method.DRAFT_MODEL, Method.EAGLE)):
        bad = build_request(plan, [], "")
        bad.speculation.method, bad.speculation.auto_draft_method = method, auto_draft
        with pytest.raises(InvalidArgument):
            params_from_proto(bad, info, Method.NONE)
    bad.speculation.method, bad.speculation.auto_draft_method = Method.AUTO, 99
    with pytest.raises(InvalidArgument):
        params_from_proto(bad, info, Method.NONE)
