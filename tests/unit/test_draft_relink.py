"""A session never stays on a dead draft link: one that broke while the session waited for it
(its break was reported before the session was on it), or one that broke without a report
reaching this session. Either way the next commit looks for a link again. And a session whose
re-attach budget is spent rests, then tries again, rather than never drafting again."""
import asyncio

import pytest
from test_verifier_logic import params

from tandem.spec import Commit, Open
from verify_service.drafts.side import ATTACH_REST_S, DraftSide
from verify_service.session.sequence import DRAFT_ATTACHES, Sequence

pytestmark = pytest.mark.unit


class Link:
    def __init__(self, alive=True):
        self.address, self.alive, self.sent = "w1", alive, []

    def send(self, msg):
        if self.alive:
            self.sent.append(msg)


class Pool:
    def __init__(self, *links):
        self.links, self.gets = list(links), 0

    async def get(self, hint="", avoid=()):
        self.gets += 1
        return self.links.pop(0) if self.links else None

    def mark_failed(self, address, link=None):
        pass


def test_a_link_that_broke_during_the_attach_is_not_kept():
    async def main():
        now = [0.0]
        seq = Sequence(params())
        dead, good = Link(alive=False), Link()
        side = DraftSide({seq.session_id: seq}, 100, 4, 8, Pool(dead, good), clock=lambda: now[0])
        side.attach(seq)
        await asyncio.sleep(0)
        assert not side.linked(seq)  # not on the dead link
        assert seq.link.attaches_left == DRAFT_ATTACHES  # and it cost no attach
        now[0] += 5.0  # past the backoff
        side.commit(seq, seq.num_tokens, [], run_ahead=3)
        await asyncio.sleep(0)
        assert side.links[seq.session_id] is good and isinstance(good.sent[0], Open)

    asyncio.run(main())


def test_a_commit_on_a_link_that_died_silently_reattaches():
    async def main():
        seq = Sequence(params())
        old, new = Link(), Link()
        side = DraftSide({seq.session_id: seq}, 100, 4, 8, Pool(new))
        side.links[seq.session_id] = old
        old.alive = False  # broke; its report did not reach this session
        epoch = seq.epoch
        side.commit(seq, seq.num_tokens, [7], run_ahead=2)
        await asyncio.sleep(0)
        assert side.links[seq.session_id] is new
        opened = new.sent[0]
        assert isinstance(opened, Open) and opened.epoch == epoch + 1  # old drafts fail it
        side.commit(seq, seq.num_tokens, [8], run_ahead=2)
        assert isinstance(new.sent[-1], Commit)

    asyncio.run(main())


def test_a_spent_attach_budget_rests_then_tries_again():
    async def main():
        now = [0.0]
        seq = Sequence(params())
        links = [Link() for _ in range(DRAFT_ATTACHES + 1)]
        pool = Pool(*links)
        side = DraftSide({seq.session_id: seq}, 100, 4, 8, pool, clock=lambda: now[0])
        for link in links[:DRAFT_ATTACHES]:  # streams that open, then fail it before a draft
            side.attach(seq)
            await asyncio.sleep(0)
            assert side.links[seq.session_id] is link
            side.on_link_broken(link)
        assert seq.link.attaches_left == 0
        side.attach(seq)
        await asyncio.sleep(0)
        assert pool.gets == DRAFT_ATTACHES and not side.linked(seq)  # resting
        now[0] += ATTACH_REST_S - 0.1
        side.attach(seq)
        await asyncio.sleep(0)
        assert pool.gets == DRAFT_ATTACHES
        now[0] += 0.2  # rested: one more try
        side.attach(seq)
        await asyncio.sleep(0)
        assert side.links[seq.session_id] is links[-1] and seq.link.attaches_left == 0

    asyncio.run(main())
