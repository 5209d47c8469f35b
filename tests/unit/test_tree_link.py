"""Token trees over the draft link, without a model: the draft worker streams one tree per
epoch as numbered nodes (parents first, depth positions, scores, the last one marked), and the
verifier's DraftSide takes well-formed nodes and drops a session's stream for anything else;
the scheduler sizes such a tree by its scores and the tree's drafting wait."""
import asyncio

import pytest
from test_draft_worker import make_worker, nothing_more, run, take

from draft_service.limits import Limits
from draft_service.worker import DraftWorker
from tandem.engine.block_manager import BlockManager
from tandem.sampling_params import SamplingParams
from tandem.spec import (
    Commit,
    DraftResult,
    DraftToken,
    ErrorCode,
    Method,
    Open,
    Proposal,
    SessionError,
    TreeNode,
)
from tandem.spec.cost import CostModel, choose_tree_size
from verify_service.config import SchedulerConfig
from verify_service.drafts.side import DraftSide
from verify_service.policy.feedback import Latency
from verify_service.policy.scheduler import Scheduler
from verify_service.session.params import GenerateParams
from verify_service.session.sequence import Sequence

pytestmark = pytest.mark.unit

# A tree under the last token t: t+1 (0.6) -> t+3 (0.3); t+2 (0.2) -> t+4 (0.1)
TREE = ((1, 2, 3, 4), (-1, -1, 0, 1), (0.6, 0.2, 0.3, 0.1))


class TreeProposer:
    method = Method.EAGLE
    feature_size = 4

    def __init__(self):
        self.calls = []

    def propose(self, reqs):
        self.calls.append(list(reqs))
        out = []
        for r in reqs:
            last, (offsets, parents, scores) = r.token_ids[-1], TREE
            n = min(len(offsets), r.max_tokens)
            out.append(DraftResult([DraftToken(last + o) for o in offsets[:n]],
                                   parents=parents[:n], scores=scores[:n]))
        return out

    def release(self, session_key):
        pass


def tree_worker(**limits):
    lim = Limits(**{"vocab_size": 100, "max_context_length": 64, **limits})
    proposer = TreeProposer()
    return DraftWorker({Method.EAGLE: proposer}, lim), proposer


def test_worker_streams_one_tree_per_epoch():
    async def main():
        worker, fake = tree_worker()
        s = worker.open_stream()
        worker.handle(s, Open("a", [1, 2, 3], max_run_ahead=8, epoch=2, method=Method.EAGLE,
                              tree=True))
        got = await take(s, 4)
        assert [(p.position, p.token.token_id, p.epoch, p.tree) for p in got] == [
            (3, 4, 2, TreeNode(-1, 0.6)), (3, 5, 2, TreeNode(-1, 0.2)),
            (4, 6, 2, TreeNode(0, 0.3)), (4, 7, 2, TreeNode(1, 0.1, last=True))]
        await nothing_more(s)  # one tree per epoch
        assert fake.calls[0][0].tree and fake.calls[0][0].max_tokens == 8
        # The verifier committed 4, 6 and a bonus 9: a new epoch, a new tree from its end.
        worker.handle(s, Commit("a", 3, 3, [4, 6, 9], max_run_ahead=2))
        got = await take(s, 2)
        assert [(p.position, p.token.token_id, p.epoch, p.tree.parent, p.tree.last)
                for p in got] == [(6, 10, 3, -1, False), (6, 11, 3, -1, True)]
        await nothing_more(s)
        # A tree session's commit under the same epoch cannot be: the verifier is confused.
        worker.handle(s, Commit("a", 3, 6, [10]))
        (err,) = await take(s, 1)
        assert isinstance(err, SessionError) and err.code is ErrorCode.OUT_OF_SYNC
        await worker.aclose()
    run(main())


def test_a_tree_is_cut_at_the_context_and_chains_only_methods_refuse_trees():
    async def main():
        worker, _ = tree_worker(max_context_length=4)
        s = worker.open_stream()
        worker.handle(s, Open("a", [1, 2, 3], max_run_ahead=8, method=Method.EAGLE, tree=True))
        got = await take(s, 2)  # one position left: depth 1 only, renumbered, last marked
        assert [(p.position, p.tree.parent, p.tree.last) for p in got] == [
            (3, -1, False), (3, -1, True)]
        await nothing_more(s)
        await worker.aclose()
        plain, _ = make_worker()
        s = plain.open_stream()
        plain.handle(s, Open("b", [1, 2], tree=True))  # draft_model drafts chains
        (err,) = await take(s, 1)
        assert err.code is ErrorCode.INVALID_ARGUMENT and "tree" in err.message
        await plain.aclose()
    run(main())


class Link:
    address = "fake"

    def __init__(self):
        self.sent = []

    def send(self, msg):
        self.sent.append(msg)


def _side(tree=True, prompt=(1, 2, 3)):
    seq = Sequence(GenerateParams("s", tuple(prompt), (), SamplingParams(temperature=0.0), 32,
                                  frozenset(), method=Method.EAGLE, tree=tree))
    side = DraftSide({"s": seq}, vocab_size=100, top_n=8, max_run_ahead=4)
    link = Link()
    side.links["s"] = link
    return side, seq, link


def _node(position, token, parent, prob=0.5, last=False, epoch=0):
    return Proposal("s", epoch, position, DraftToken(token), TreeNode(parent, prob, last))


def test_draft_side_takes_a_well_formed_tree():
    async def main():
        side, seq, _ = _side()
        for p in (_node(3, 10, -1, 0.6), _node(3, 11, -1, 0.3), _node(4, 12, 0, 0.4),
                  _node(5, 13, 2, 0.2, last=True)):
            side.on_reply(side.links["s"], p)
        assert [d.token_id for d in seq.drafts] == [10, 11, 12, 13]
        assert seq.draft_parents == (-1, -1, 0, 2) and seq.draft_reach == [0.6, 0.3, 0.4, 0.2]
        assert seq.tree_complete and side.linked(seq)
        # A round commits the path 10, 12 and a bonus: the tree is gone, the epoch moves on,
        # and the last tree's scores size the next one until it arrives.
        assert seq.commit([10, 12], 7) == [10, 12, 7]
        assert seq.drafts == [] and seq.draft_parents is None and seq.epoch == 1
        assert seq.last_reach == (0.6, 0.3, 0.4, 0.2) and not seq.tree_complete
        side.on_reply(side.links["s"], _node(6, 10, -1, epoch=0))  # the old epoch's: dropped
        assert seq.drafts == [] and side.linked(seq)
    asyncio.run(main())


@pytest.mark.parametrize("bad", [
    _node(3, 10, 0),  # parent not yet sent
    _node(4, 10, -1),  # a child of the root sits at the first draft position
    _node(3, 10, -1, prob=float("nan")),
    _node(3, 10, -1, prob=1.5),
    _node(3, 100, -1),  # outside the vocabulary
    Proposal("s", 0, 3, DraftToken(10)),  # a chain token for a tree session
])
def test_draft_side_drops_the_stream_of_a_malformed_node(bad):
    async def main():
        side, seq, link = _side()
        side.on_reply(link, bad)
        assert not side.linked(seq) and seq.drafts == [] and seq.epoch == 1
    asyncio.run(main())


def test_nodes_after_the_last_or_beyond_the_cap_and_nodes_for_chains_are_refused():
    async def main():
        side, seq, link = _side()
        side.on_reply(link, _node(3, 10, -1, last=True))
        side.on_reply(link, _node(3, 11, -1))  # after the last node
        assert not side.linked(seq)
        side, seq, link = _side()
        for j in range(4):
            side.on_reply(link, _node(3, 10 + j, -1))
        side.on_reply(link, _node(3, 20, -1))  # a fifth node: over max_run_ahead
        assert not side.linked(seq)
        side, seq, link = _side(tree=False)
        side.on_reply(link, _node(3, 10, -1))  # a tree node for a chain session
        assert not side.linked(seq)
    asyncio.run(main())


def test_tree_size_follows_scores_and_the_drafting_wait():
    cost = CostModel({1: 10.0, 2: 11.0, 3: 12.0, 4: 13.0, 5: 14.0})
    reach = [0.6, 0.3, 0.2, 0.05]
    assert choose_tree_size(reach, 4, cost) == 3  # the 0.05 node does not pay its 1 ms
    assert choose_tree_size(reach, 4, cost, draft_ms=5.0) == 3
    assert choose_tree_size(reach, 4, cost, draft_ms=30.0) == 0  # the wait eats the gain
    sched = Scheduler(BlockManager(64, 4), SchedulerConfig(max_spec_tokens=4), cost)
    seq = Sequence(GenerateParams("s", (1, 2, 3), (), SamplingParams(temperature=0.0), 32,
                                  frozenset(), method=Method.EAGLE, tree=True))
    seq.draft_reach = reach
    assert sched.desired_k(seq) == 3
    seq.est.tree_wait_ms = 30.0
    assert sched.desired_k(seq) == 0
    # ... but probed every EXPLORE_EVERY rounds, with the tree that pays without the wait.
    assert [sched.desired_k(seq, ahead) for ahead in range(16)].count(3) == 1
    with pytest.raises(Exception, match="draft_shape tree applies"):
        GenerateParams("s", (1,), (), SamplingParams(), 4, frozenset(), method=Method.NGRAM,
                       tree=True)


def test_draft_shape_on_the_wire_and_its_defaults():
    from gateway.verifier import build_request
    from tandem.v1 import common_pb2, verify_pb2
    from verify_service.server import params_from_proto

    info = common_pb2.WorkerInfo(max_spec_tokens=16, vocab_size=100,
                                 max_context_length=64)

    def request(method, shape):
        return verify_pb2.GenerateRequest(
            session_id="s", prompt_token_ids=[1, 2], sampling=common_pb2.SamplingParams(),
            stopping=verify_pb2.StoppingCriteria(max_new_tokens=4),
            speculation=verify_pb2.SpeculationConfig(method=method, draft_shape=shape))

    eagle, ngram = int(Method.EAGLE), int(Method.NGRAM)
    unset, chain, tree = (verify_pb2.DRAFT_SHAPE_UNSPECIFIED, verify_pb2.DRAFT_SHAPE_CHAIN,
                          verify_pb2.DRAFT_SHAPE_TREE)
    both = frozenset({Method.EAGLE, Method.MEDUSA})
    assert params_from_proto(request(eagle, unset), info, Method.NONE, both).tree is True
    assert params_from_proto(request(eagle, unset), info, Method.NONE).tree is False
    assert params_from_proto(request(eagle, chain), info, Method.NONE, both).tree is False
    assert params_from_proto(request(eagle, tree), info, Method.NONE).tree is True
    assert params_from_proto(request(ngram, unset), info, Method.NONE, both).tree is False
    medusa = int(Method.MEDUSA)
    assert params_from_proto(request(medusa, unset), info, Method.NONE).tree is True
    from verify_service.config import VerifierConfig
    # auto follows Medusa: its heads' proposals are the heads' trees
    assert VerifierConfig().tree_methods("cpu") == {Method.MEDUSA, Method.AUTO}
    assert VerifierConfig().tree_methods("cuda") == {*both, Method.AUTO}
    assert VerifierConfig(draft_shape="tree").tree_methods("cpu") == {*both, Method.AUTO}
    assert VerifierConfig(draft_shape="chain").tree_methods("cuda") == frozenset()
    with pytest.raises(ValueError, match="draft_shape"):
        VerifierConfig(draft_shape="forest")
    with pytest.raises(Exception, match="draft_shape tree applies"):
        params_from_proto(request(ngram, tree), info, Method.NONE)
    with pytest.raises(Exception, match="unknown draft_shape 7"):
        params_from_proto(request(eagle, 7), info, Method.NONE)

    class Plan:  # the fields build_request reads
        session_id, prompt_token_ids, max_new_tokens, stop_token_ids = "s", (1,), 4, ()
        ignore_eos, method, num_speculative_tokens, tenant = False, Method.EAGLE, 0, ""
        typical, logprobs, sampling, draft_shape = None, None, SamplingParams(), "chain"
        grammar, prediction_token_ids = None, ()

    assert build_request(Plan(), [], "").speculation.draft_shape == chain
    Plan.draft_shape = None
    assert build_request(Plan(), [], "").speculation.draft_shape == unset


def test_the_verifier_waits_for_a_tree_as_long_as_trees_take():
    from verify_service.engine import Engine, EngineConfig

    class Side:  # everyone linked; chain drafts come fast
        arrival, first = Latency(2.0), Latency(4.0)

        def linked(self, seq):
            return True

    sched = Scheduler(BlockManager(64, 4), SchedulerConfig(max_spec_tokens=4),
                      CostModel({q: 100.0 for q in range(1, 9)}))
    engine = Engine(None, sched, EngineConfig(max_draft_wait_ms=25.0), 100)
    engine.drafts = Side()
    seq = Sequence(GenerateParams("s", (1, 2, 3), (), SamplingParams(temperature=0.0), 32,
                                  frozenset(), method=Method.EAGLE, tree=True))
    sched.running = [seq]
    seq.last_reach = (0.6, 0.3)
    assert engine._draft_wait_limit_ms() == pytest.approx(1.5 * 4.0)  # nothing measured yet
    seq.est.tree_wait_ms = 12.0
    assert engine._draft_wait_limit_ms() == pytest.approx(18.0)
    seq.add_node(DraftToken(5), -1, 0.5, last=False)  # part of it: the rest comes at once
    assert engine._draft_wait_limit_ms() == pytest.approx(18.0)
    seq.add_node(DraftToken(6), 0, 0.2, last=True)
    assert engine._draft_wait_limit_ms() == 0.0  # complete: nothing to wait for


def test_a_verified_tree_resets_late_rounds_and_measures_its_wait():
    """A tree session that was late twice (no longer waited for) is waited for again once a
    tree is verified; the round's wait feeds the session's tree_wait_ms."""
    from verify_service.engine import Engine, EngineConfig
    from verify_service.forward.step import RoundOutcome, StepTimings

    class Side:
        arrival, first = Latency(2.0), Latency(4.0)

        def linked(self, seq):
            return True

        def attach(self, seq, run_ahead=None):
            pass

        def commit(self, *args, **kw):
            pass

    async def main():
        sched = Scheduler(BlockManager(64, 4), SchedulerConfig(max_spec_tokens=4),
                          CostModel({q: 100.0 for q in range(1, 9)}))
        engine = Engine(None, sched, EngineConfig(), 100)
        engine.drafts = Side()
        engine.submit(GenerateParams("s", (1, 2, 3), (), SamplingParams(temperature=0.0), 32,
                                     frozenset(), method=Method.EAGLE, tree=True))
        seq = engine.sessions["s"]
        (prefill,) = sched.schedule().scheduled
        engine._apply(prefill, RoundOutcome([], 7), 0.0, StepTimings(1.0, 0.0))
        seq.est.late_rounds = 2
        seq.add_node(DraftToken(8), -1, 0.6, last=False)
        seq.add_node(DraftToken(9), -1, 0.3, last=True)
        (s,) = sched.schedule().scheduled
        assert s.num_drafts == 2 and s.parents == (-1, -1)
        engine._apply(s, RoundOutcome([9], 5), 12.0, StepTimings(1.0, 0.0))
        assert seq.est.late_rounds == 0 and seq.est.tree_wait_ms == pytest.approx(0.3 * 12.0)
        assert seq.output == [7, 9, 5] and seq.drafts == [] and seq.epoch == 2
    asyncio.run(main())
