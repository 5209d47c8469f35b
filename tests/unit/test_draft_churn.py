"""The draft link under churn, without a network: the re-attach budget and its backoff, what a
re-attach asks for, bounded queues on both sides, links that are never duplicated or leaked,
the cost model after a noisy episode, the Redis breaker's single probe, quotas of requests
cut short, and `tandem up` starting a dead draft worker again."""
import asyncio
import subprocess
import sys

import pytest
from test_verifier_logic import make_sched, params

from draft_service.session import Stream
from tandem.spec import Close, Commit, DraftToken, Method, Open, Proposal, TreeNode
from tandem.spec.cost import STALE_AFTER, CostModel, StepCost, choose_k, plan_batch
from verify_service.drafts import link as draft_link
from verify_service.drafts.side import ATTACH_BACKOFF_S, DraftSide
from verify_service.policy.scheduler import EXPLORE_EVERY
from verify_service.session.sequence import DRAFT_ATTACHES, Sequence

pytestmark = pytest.mark.unit


class Link:
    def __init__(self, address="w1"):
        self.address, self.sent = address, []

    def send(self, msg):
        self.sent.append(msg)


class Pool:
    """Hands out `link` once `up` (None before: a worker restarting or draining)."""

    def __init__(self, link):
        self.link, self.up, self.gets = link, False, 0

    async def get(self, hint="", avoid=()):
        self.gets += 1
        return self.link if self.up else None

    def mark_failed(self, address, link=None):
        pass


def test_no_worker_costs_no_attach_and_backs_off_then_a_working_stream_refills():
    async def main():
        now = [100.0]
        seq = Sequence(params())
        link = Link()
        pool = Pool(link)
        side = DraftSide({seq.session_id: seq}, 100, 4, 8, pool, clock=lambda: now[0])
        for _ in range(20):  # a restart window: every round tries, nothing is there
            side.attach(seq)
            await asyncio.sleep(0)
        assert seq.link.attaches_left == DRAFT_ATTACHES  # nothing was spent
        assert pool.gets == 1  # and it backs off instead of asking every round
        assert seq.link.next_attach_at == pytest.approx(100.0 + ATTACH_BACKOFF_S)
        now[0] += 1.0
        side.attach(seq)
        await asyncio.sleep(0)
        assert pool.gets == 2
        assert seq.link.next_attach_at == pytest.approx(101.0 + 2 * ATTACH_BACKOFF_S)
        pool.up, now[0] = True, now[0] + 10
        side.attach(seq)
        await asyncio.sleep(0)
        assert isinstance(link.sent[0], Open) and seq.link.attaches_left == DRAFT_ATTACHES - 1
        side.on_reply(link, Proposal(seq.session_id, seq.epoch, seq.next_draft_position(),
                                     DraftToken(5)))
        assert seq.link.attaches_left == DRAFT_ATTACHES  # the stream works: budget back

    asyncio.run(main())


def test_a_reattach_asks_only_for_what_the_session_last_wanted():
    async def main():
        seq = Sequence(params())
        link = Link()
        pool = Pool(link)
        pool.up = True
        side = DraftSide({seq.session_id: seq}, 100, 4, 8, pool)
        side.commit(seq, seq.num_tokens, [], run_ahead=0)  # no link, asked for nothing:
        await asyncio.sleep(0)
        assert not link.sent and not side.coming(seq)  # no Open until it is asked (issue 49)
        side.commit(seq, seq.num_tokens, [], run_ahead=3)
        await asyncio.sleep(0)
        (opened,) = link.sent
        assert isinstance(opened, Open) and opened.max_run_ahead == 3

    asyncio.run(main())


def test_the_open_asks_for_what_the_first_decode_round_will_verify():
    """Issue 49: a draft session's Open asks for the drafts its first decode round would
    verify, not the most: where the method's pooled acceptance says drafts do not pay, one
    probe's and the bonus token's, so the worker does not draft 16 tokens no one verifies."""
    from verify_service.engine import Engine, EngineConfig

    async def main(pooled: bool):
        sched = make_sched()
        for _ in range(50 if pooled else 0):
            sched.pool.learn(Method.DRAFT_MODEL, 4, 0)
        engine = Engine(None, sched, EngineConfig(), 100)
        link = Link()
        engine.drafts.pool = Pool(link)
        engine.drafts.pool.up = True
        engine.submit(params())
        await asyncio.sleep(0)
        return link.sent[0]

    opened = asyncio.run(main(pooled=True))
    assert isinstance(opened, Open) and opened.max_run_ahead == 2
    assert asyncio.run(main(pooled=False)).max_run_ahead > 2  # the prior: drafts pay


def test_commits_to_a_paused_worker_are_held_and_sent_with_its_next_ask():
    """A worker asked for no drafts gets no Commit per round (each costs both processes'
    CPU on a shared host): the tokens go with the next ask, or before the Close."""
    seq = Sequence(params())
    side = DraftSide({seq.session_id: seq}, 100, 4, 8)
    link = side.links[seq.session_id] = Link()

    def round_(token, run_ahead):
        start = seq.num_tokens
        seq.commit([], token)
        side.commit(seq, start, [token], run_ahead=run_ahead)

    side.commit(seq, seq.num_tokens, [], run_ahead=0)  # the pause itself is sent
    for t in (7, 8, 9):
        round_(t, 0)
    assert len(link.sent) == 1
    round_(10, 2)
    ask = link.sent[-1]
    assert (ask.start_position, ask.token_ids, ask.max_run_ahead) == (3, [7, 8, 9, 10], 2)
    round_(11, 0)  # sent: the worker was drafting
    round_(12, 0)
    assert len(link.sent) == 3
    side.release(seq)
    flushed, close = link.sent[-2:]
    assert isinstance(flushed, Commit) and flushed.token_ids == [12] and isinstance(close, Close)


def test_a_worker_sending_past_run_ahead_or_sampled_tree_nodes_is_cut_off():
    seq = Sequence(params())
    side = DraftSide({seq.session_id: seq}, 100, 4, 3)
    link = side.links[seq.session_id] = Link()
    for _ in range(3):
        side.on_reply(link, Proposal(seq.session_id, seq.epoch, seq.next_draft_position(),
                                     DraftToken(5)))
    assert len(seq.drafts) == 3
    side.on_reply(link, Proposal(seq.session_id, seq.epoch, seq.next_draft_position(),
                                 DraftToken(5)))  # a fourth: beyond any limit it was given
    assert seq.session_id not in side.links and seq.drafts == [] and seq.epoch == 1
    assert isinstance(link.sent[-1], Close)

    tree = Sequence(params(session_id="t", tree=True, method=Method.EAGLE))
    side = DraftSide({tree.session_id: tree}, 100, 4, 8)
    link = side.links[tree.session_id] = Link()
    one_hot = DraftToken(5, (5,), (1.0,))
    side.on_reply(link, Proposal("t", 0, tree.num_tokens, one_hot, TreeNode(-1, 0.9, False)))
    assert len(tree.drafts) == 1
    sampled = DraftToken(6, (6, 7), (0.5, 0.5))  # how were its siblings drawn? unknown
    side.on_reply(link, Proposal("t", 0, tree.num_tokens, sampled, TreeNode(-1, 0.5, False)))
    assert tree.session_id not in side.links


def test_concurrent_gets_share_one_link_and_an_old_link_cannot_evict_a_new_one(monkeypatch):
    made = []

    class FakeLink:
        def __init__(self, address, *args, **kwargs):
            self.address, self.alive, self.closed = address, False, False
            made.append(self)

        async def start(self):
            await asyncio.sleep(0.02)
            self.alive = True
            return True

        async def close(self):
            self.alive, self.closed = False, True

    monkeypatch.setattr(draft_link, "DraftLink", FakeLink)

    async def main():
        pool = draft_link.DraftPool(["w1"], None, None, None)
        links = await asyncio.gather(*(pool.get() for _ in range(5)))
        assert len(made) == 1 and all(link is made[0] for link in links)
        old = made[0]
        old.alive = False  # broke; a new one replaces it
        new = await pool.get()
        assert new is not old and pool.links["w1"] is new
        pool.mark_failed("w1", old)  # the old link's late failure report
        assert pool.links["w1"] is new
        await pool.close()
        assert new.closed

    asyncio.run(main())


def test_a_link_whose_peer_stops_reading_breaks_instead_of_queueing():
    async def main():
        broken = []
        link = draft_link.DraftLink("127.0.0.1:1", None, broken.append, max_queued=5)
        link.alive = True  # as if started; nobody drains the queue
        for i in range(50):
            link.send(Close(f"s{i}"))
        assert broken == [link] and not link.alive
        assert link._queue.qsize() <= 6
        await asyncio.sleep(0.01)  # the background close ran

    asyncio.run(main())


def test_the_workers_outbox_is_bounded_and_drafting_waits_while_backed_up():
    async def main():
        room = []
        stream = Stream(max_pending=8, on_room=lambda: room.append(1))
        for i in range(3):
            stream.put(Proposal("s", 0, i, DraftToken(1)))
        assert not stream.backed_up
        for i in range(100):
            stream.put(Proposal("s", 0, i, DraftToken(1)))
        assert stream.backed_up and stream.overflowed and stream.pending == 9  # 8 + the end
        for _ in range(5):
            await stream.get()
        assert room == [] and stream.backed_up  # 4 left: half of 8, still backed up
        for _ in range(3):
            await stream.get()
        assert room == [1] and not stream.backed_up  # below half: woken, once

    asyncio.run(main())


def test_costs_survive_zero_samples_and_forget_a_noisy_episode():
    cost = CostModel({1: 0.0, 2: 20.0, 6: 30.0})
    assert choose_k(0.9, 8, cost) >= 0  # a zero calibration does not divide by zero
    cost.observe(3, 0.0)
    cost.observe(3, float("nan"))
    assert 3 not in cost.ms
    cost.observe(6, 5000.0)  # one noisy episode at k = 5
    assert cost.cost(6) > 1000  # priced out: k = 5 is not chosen again
    for _ in range(STALE_AFTER + 1):
        cost.observe(1, 20.0)
    assert cost.cost(6) == 30.0  # not seen again for long: the calibration again
    step = StepCost({8: 40.0, 16: 60.0})
    step.observe(9, -1.0)
    assert not step.observed
    assert plan_batch([[0.9], [0.9]], lambda t: 0.0) is not None  # no ZeroDivisionError
    step.observe(12, 9000.0)
    for _ in range(STALE_AFTER + 1):
        step.observe(8, 40.0)
    assert 12 not in step.observed


def test_a_probe_is_not_cut_by_the_batch_plan():
    sched = make_sched()
    seq = Sequence(params())
    sched.add(seq)
    seq.est.acceptance_ema = 0.0  # speculation priced out: k = 0 but for probes
    seq.stats.rounds = EXPLORE_EVERY - 1
    sched._caps = {seq.session_id: 0}  # the plan gives it nothing
    assert sched.desired_k(seq) >= 1
    seq.stats.rounds = 0
    assert sched.desired_k(seq) == 0


def test_the_redis_breaker_lets_one_probe_through_after_its_cooldown():
    from gateway.sessions import RedisBreaker, RedisSkipped

    now = [0.0]
    breaker = RedisBreaker(timeout_s=1.0, cooldown_s=5.0, clock=lambda: now[0])

    async def fail():
        raise OSError("down")

    async def slow_ok():
        await asyncio.sleep(0.05)
        return "pong"

    async def main():
        with pytest.raises(RedisSkipped):
            await breaker.call(fail)
        now[0] = 6.0  # cooled down
        got = await asyncio.gather(*(breaker.call(slow_ok) for _ in range(5)),
                                   return_exceptions=True)
        assert got.count("pong") == 1 and sum(isinstance(g, RedisSkipped) for g in got) == 4
        assert await breaker.call(slow_ok) == "pong"  # closed again

    asyncio.run(main())


def test_a_request_cut_short_is_charged_its_prompt_and_what_it_got():
    from gateway.generation import Finished, TextDelta
    from gateway.quotas import metered

    class Quotas:
        def __init__(self):
            self.charged = []

        async def charge(self, who, tokens):
            self.charged.append((who, tokens))

        def hold(self, task):
            self.task = task

    async def events():
        yield TextDelta("a", (), 3)
        yield TextDelta("b", (), 2)
        yield TextDelta("c", (), 4)
        yield Finished("stop", 9, {})

    async def main():
        q = Quotas()
        gen = metered(events(), q, "k", 10)
        await gen.__anext__()
        await gen.__anext__()
        await gen.aclose()  # the client went away after two deltas
        assert q.charged == [("k", 15)]
        q = Quotas()
        assert len([ev async for ev in metered(events(), q, "k", 10)]) == 4
        assert q.charged == [("k", 19)]  # finished: charged once, from Finished

    asyncio.run(main())


def test_tandem_up_starts_a_dead_draft_worker_again_with_backoff(monkeypatch):
    from tools.launcher import Cluster, ClusterConfig

    cluster = Cluster(ClusterConfig(num_drafts=1), log=lambda m: None)
    started = []

    def popen(args):
        started.append(args)
        return subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])

    monkeypatch.setattr(cluster, "_popen", popen)
    cluster._spawn("draft-0", ["draft", "--port", "1"])
    cluster.procs[0][1].wait()
    now = [0.0]
    assert cluster.supervise(lambda: now[0]) == ["draft-0"]  # at once, same command
    assert started[-1] == ["draft", "--port", "1"]
    cluster.procs[0][1].wait()
    now[0] = 0.5
    assert cluster.supervise(lambda: now[0]) == []  # backing off (1 s)
    now[0] = 1.5
    assert cluster.supervise(lambda: now[0]) == ["draft-0"]
    # a verifier or the gateway is restarted alike: tests/unit/test_launcher_supervise.py
