"""The verifier's intake of draft proposals: bad ones are dropped, others are unharmed."""
import asyncio

import pytest

from tandem.engine.block_manager import BlockManager
from tandem.sampling_params import SamplingParams
from tandem.spec import DraftToken, ErrorCode, Method, Proposal, SessionError
from tandem.spec.cost import CostModel
from verify_service.config import SchedulerConfig
from verify_service.engine import Engine, EngineConfig
from verify_service.policy.scheduler import Scheduler
from verify_service.session.params import GenerateParams

pytestmark = pytest.mark.unit
VOCAB = 100


class Link:
    address = "draft:1"

    def __init__(self):
        self.sent = []

    def send(self, control):
        self.sent.append(control)


def make_engine():
    sched = Scheduler(BlockManager(32, 4), SchedulerConfig(), CostModel())
    engine = Engine(None, sched, EngineConfig(), VOCAB)
    link = Link()
    for session_id in ("a", "b"):
        engine.submit(GenerateParams(session_id=session_id, prompt=(1, 2, 3), committed=(),
                                     sampling=SamplingParams(temperature=0.0),
                                     max_new_tokens=8, stop_token_ids=frozenset(),
                                     method=Method.DRAFT_MODEL))
        engine.drafts.links[session_id] = link
    return engine, link


def proposal(session_id="a", epoch=0, position=3, token=7, ids=(), probs=()):
    return Proposal(session_id, epoch, position, DraftToken(token, tuple(ids), tuple(probs)))


@pytest.mark.parametrize("bad", [
    proposal(session_id="nobody"),  # unknown session
    proposal(epoch=5),  # stale or future epoch
    proposal(token=VOCAB),  # out of vocabulary
    proposal(position=9),  # gap
    proposal(ids=(7, 8), probs=(0.5,)),  # ids and probs of different lengths
    proposal(ids=(7, 8), probs=(0.5, 0.2)),  # does not sum to 1
    proposal(ids=(7, VOCAB), probs=(0.5, 0.5)),  # q outside the vocabulary
    proposal(ids=(8, 9), probs=(0.5, 0.5)),  # q does not contain the token
    proposal(ids=(7, 8), probs=(1.5, -0.5)),  # negative mass
])
def test_bad_proposals_are_dropped_and_others_unharmed(bad):
    async def main():
        engine, link = make_engine()
        engine.drafts.on_reply(link, bad)
        engine.drafts.on_reply(link, proposal(session_id="b", token=9))  # a healthy neighbour
        return engine

    engine = asyncio.run(main())
    assert engine.sessions["a"].drafts == []
    assert [d.token_id for d in engine.sessions["b"].drafts] == [9]


def test_good_proposals_accumulate_in_order_and_errors_detach():
    async def main():
        engine, link = make_engine()
        engine.drafts.on_reply(link, proposal(token=7, ids=(7, 8), probs=(0.75, 0.25)))
        engine.drafts.on_reply(link, proposal(position=4, token=8))
        before = [d.token_id for d in engine.sessions["a"].drafts]
        engine.drafts.on_reply(link, SessionError("a", ErrorCode.INTERNAL, "boom"))
        return engine, before

    engine, before = asyncio.run(main())
    assert before == [7, 8]
    assert engine.sessions["a"].drafts == [] and "a" not in engine.drafts.links
    assert "b" in engine.drafts.links  # the other session keeps its draft stream


def test_in_flight_proposals_and_errors_of_an_old_attach_are_stale_after_reattach():
    """Every detach moves the epoch on: what the old attach still sends fails the check."""
    async def main():
        engine, link = make_engine()
        seq = engine.sessions["a"]
        engine.drafts.on_reply(link, proposal(token=VOCAB))  # malformed: detached
        assert "a" not in engine.drafts.links and seq.epoch == 1
        engine.drafts.links["a"] = link  # re-attached on the same stream (Open at epoch 1)
        engine.drafts.on_reply(link, proposal(epoch=0, token=7))  # in flight from before
        engine.drafts.on_reply(link, SessionError("a", ErrorCode.INTERNAL, "old", epoch=0))
        stale = (list(seq.drafts), "a" in engine.drafts.links)
        engine.drafts.on_reply(link, proposal(epoch=1, token=8))  # the new attach's
        engine.drafts.on_reply(link, SessionError("a", ErrorCode.INTERNAL, "new", epoch=1))
        return seq, stale

    seq, (drafts_after_stale, still_linked) = asyncio.run(main())
    assert drafts_after_stale == [] and still_linked
    assert seq.drafts == [] and seq.epoch == 2  # the current error detached it, epoch moved


def test_a_plain_sessions_round_tells_no_draft_side_and_a_drafting_ones_does():
    """Committing a round: a speculating session's link hears of it (its worker keeps up);
    a plain one's round touches no draft state at all (the verifier's hot path at 32
    sessions), yet its client still gets the round."""
    from tandem.spec import Commit
    from verify_service.forward.step import RoundOutcome, StepTimings

    async def main():
        engine, link = make_engine()
        queue = engine.submit(GenerateParams(
            session_id="plain", prompt=(1, 2, 3), committed=(),
            sampling=SamplingParams(temperature=0.0), max_new_tokens=8,
            stop_token_ids=frozenset(), method=Method.NONE))
        told = []
        commit = engine.drafts.commit
        engine.drafts.commit = lambda seq, *a: (told.append(seq.session_id), commit(seq, *a))
        first = engine.scheduler.schedule().scheduled  # the prefills
        for s in first:
            engine._apply(s, RoundOutcome([], 5), 0.0, StepTimings(1.0, 0.1))
        return engine, link, queue, told

    engine, link, queue, told = asyncio.run(main())
    assert sorted(told) == ["a", "b"]
    assert {c.session_id for c in link.sent if isinstance(c, Commit)} == {"a", "b"}
    out = queue.get_nowait()
    assert out.token_ids == [5] and engine.sessions["plain"].num_tokens == 4
