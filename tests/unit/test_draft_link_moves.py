"""A session leaves a draft worker whose link is up but that fails it (issue 47): one that
refuses it (full) or never drafts for it moves the session to another worker of the pool, or
to plain decoding when there is none, and may come back once it has stayed away a while."""
import asyncio

import pytest
from test_verifier_logic import params

from tandem.spec import Close, DraftToken, ErrorCode, Method, Open, Proposal, SessionError
from verify_service.drafts.side import DraftSide
from verify_service.drafts.watch import AVOID_S, DRAFT_SILENCE_S
from verify_service.session.sequence import Sequence

pytestmark = pytest.mark.unit


class Link:
    def __init__(self, address):
        self.address, self.alive, self.sent = address, True, []

    def send(self, msg):
        self.sent.append(msg)


class Pool:
    """Like DraftPool.get: the first worker, in order, that the session does not avoid."""

    def __init__(self, *links):
        self.links = list(links)

    async def get(self, hint="", avoid=()):
        return next((link for link in self.links if link.address not in avoid), None)

    def mark_failed(self, address, link=None):
        pass


def _side(seqs, *links):
    now = [0.0]
    side = DraftSide({s.session_id: s for s in seqs}, 100, 4, 8, Pool(*links),
                     clock=lambda: now[0])
    return side, now


async def _commit(side, seq):
    side.commit(seq, seq.num_tokens, [], run_ahead=3)
    await asyncio.sleep(0)


def test_a_full_worker_sends_the_session_to_another():
    async def main():
        seq = Sequence(params())
        full, free = Link("w1"), Link("w2")
        side, now = _side([seq], full, free)
        side.attach(seq)
        await asyncio.sleep(0)
        assert side.links[seq.session_id] is full
        side.on_reply(full, SessionError(seq.session_id, ErrorCode.RESOURCE_EXHAUSTED,
                                         "worker is full (256 sessions)", seq.epoch))
        now[0] += 1.0
        await _commit(side, seq)
        assert side.links[seq.session_id] is free and isinstance(free.sent[0], Open)
        assert not any(isinstance(m, Open) for m in full.sent[1:])

    asyncio.run(main())


def test_with_no_other_worker_it_decodes_plain_then_tries_again():
    async def main():
        seq = Sequence(params())
        only = Link("w1")
        side, now = _side([seq], only)
        side.attach(seq)
        await asyncio.sleep(0)
        side.on_reply(only, SessionError(seq.session_id, ErrorCode.INTERNAL, "bug", seq.epoch))
        for _ in range(3):  # plain decoding meanwhile: no link, no Open to the failing worker
            now[0] += 1.0
            await _commit(side, seq)
            assert not side.linked(seq)
        assert sum(isinstance(m, Open) for m in only.sent) == 1
        now[0] += AVOID_S
        await _commit(side, seq)
        assert side.links[seq.session_id] is only  # stayed away long enough: back

    asyncio.run(main())


def test_a_worker_that_never_drafts_for_a_session_loses_it():
    async def main():
        model = Sequence(params("m"))
        ngram = Sequence(params("n", method=Method.NGRAM))  # often has nothing: never moved
        silent, other = Link("w1"), Link("w2")
        side, now = _side([model, ngram], silent, other)
        for seq in (model, ngram):
            side.attach(seq)
            await asyncio.sleep(0)
            assert side.links[seq.session_id] is silent
        now[0] += DRAFT_SILENCE_S * 0.6
        side.on_reply(silent, Proposal("m", model.epoch, model.next_draft_position(),
                                       DraftToken(5)))  # a draft: the silence starts over
        now[0] += DRAFT_SILENCE_S * 0.6
        for seq in (model, ngram):
            await _commit(side, seq)
        assert side.links["m"] is silent and side.links["n"] is silent
        now[0] += DRAFT_SILENCE_S
        for seq in (model, ngram):
            await _commit(side, seq)
        assert side.links["m"] is other and isinstance(other.sent[0], Open)
        assert Close("m") in silent.sent  # the worker frees it
        assert side.links["n"] is silent

    asyncio.run(main())
