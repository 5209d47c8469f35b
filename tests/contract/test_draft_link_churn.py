"""The verifier's draft links against real n-gram draft servers on loopback: a black-holed
link is found by its keepalive and its session moves to a healthy worker; hundreds of broken
links leave no channel, stream or file descriptor behind; an engine loop that dies takes the
verifier to NOT_SERVING and ends its process."""
import asyncio
import gc
import os

import pytest
from grpc_health.v1 import health, health_pb2

import draft_service.main as draft_main
from draft_service.config import DraftConfig
from draft_service.limits import Limits
from draft_service.worker import DraftWorker
from tandem.proposers.ngram import NgramProposer
from tandem.sampling_params import SamplingParams
from tandem.spec import Method
from tandem.v1 import common_pb2
from verify_service.drafts import link as draft_link
from verify_service.drafts.side import DraftSide
from verify_service.session.params import GenerateParams
from verify_service.session.sequence import Sequence

pytestmark = pytest.mark.contract
PROMPT = (10, 11, 12, 13, 14, 15, 10, 11, 12)  # n-gram lookup proposes 13, 14, 15, ...


async def ngram_server():
    worker = DraftWorker({Method.NGRAM: NgramProposer()},
                         Limits(vocab_size=1000, max_context_length=256))
    app = await draft_main.build_app(DraftConfig(port=0), worker, common_pb2.WorkerInfo())
    await app.server.start()
    return app


class BlackHole:
    """A TCP forwarder on loopback that can swallow every byte without closing anything."""

    def __init__(self, port: int):
        self.target, self.holding = port, False

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._link, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _link(self, reader, writer):
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target)
        await asyncio.gather(self._pipe(reader, up_w), self._pipe(up_r, writer))

    async def _pipe(self, reader, writer):
        while data := await reader.read(65536):
            if not self.holding:
                writer.write(data)
                await writer.drain()


def session(session_id="s"):
    return Sequence(GenerateParams(
        session_id=session_id, prompt=PROMPT, committed=(),
        sampling=SamplingParams(temperature=0.0), max_new_tokens=64,
        stop_token_ids=frozenset(), method=Method.NGRAM))


async def until(cond, timeout_s: float):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.02)
    return loop.time()


def test_a_black_holed_link_is_detected_and_its_session_moves(monkeypatch):
    monkeypatch.setattr(draft_main, "MIN_PING_INTERVAL_MS", 100)  # our pings come every 0.5 s

    async def main():
        a, b = await ngram_server(), await ngram_server()
        hole = BlackHole(a.port)
        via_hole = await hole.start()
        seq = session()
        side = DraftSide({seq.session_id: seq}, 1000, 4, 4)
        side.pool = draft_link.DraftPool([via_hole, f"127.0.0.1:{b.port}"], None,
                                         side.on_reply, side.on_link_broken,
                                         keepalive=(0.5, 1.0))
        try:
            side.attach(seq)
            await until(lambda: len(seq.drafts) == 4, 10)
            assert side.links[seq.session_id].address == via_hole
            hole.holding = True
            t0 = asyncio.get_running_loop().time()
            await until(lambda: seq.session_id not in side.links, 10)
            detected = asyncio.get_running_loop().time() - t0
            assert detected < 4.0, detected  # a ping (0.5 s) unanswered for 1 s, with slack
            side.commit(seq, seq.num_tokens, [], run_ahead=4)  # the next round re-attaches
            await until(lambda: seq.session_id in side.links and len(seq.drafts) == 4, 10)
            assert side.links[seq.session_id].address == f"127.0.0.1:{b.port}"
        finally:
            await side.close()
            for app in (a, b):
                await app.server.stop(None)
                await app.worker.aclose()
            hole.server.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_hundreds_of_broken_links_leave_nothing_open():
    now = [0.0]

    async def main():
        app = await ngram_server()
        seq = session()
        side = DraftSide({seq.session_id: seq}, 1000, 4, 4)
        side.pool = draft_link.DraftPool([f"127.0.0.1:{app.port}"], None, side.on_reply,
                                         side.on_link_broken, clock=lambda: now[0])

        async def cycle():
            side.attach(seq)
            await until(lambda: len(seq.drafts) == 4, 10)
            app.worker.end_streams()  # the worker drops the stream (as a restart would)
            await until(lambda: seq.session_id not in side.links, 10)
            now[0] += 10  # past the pool's backoff for a failed worker
            seq.link.attaches_left = 3

        try:
            for _ in range(20):  # warm up: grpc's own threads and pools
                await cycle()
            await asyncio.sleep(0.2)
            gc.collect()
            fds = len(os.listdir("/proc/self/fd"))
            for _ in range(200):
                await cycle()
            await asyncio.sleep(0.2)
            gc.collect()
            live = [o for o in gc.get_objects() if isinstance(o, draft_link.DraftLink)]
            assert len(live) <= 2, len(live)
            assert len(os.listdir("/proc/self/fd")) <= fds + 4
            assert len(app.worker._streams) <= 1
        finally:
            await side.close()
            await app.server.stop(None)
            await app.worker.aclose()

    asyncio.run(asyncio.wait_for(main(), 120))


def test_an_engine_loop_that_dies_reports_not_serving_and_ends_the_process(monkeypatch):
    import verify_service.main as verify_main
    from verify_service.config import VerifierConfig

    class Server:
        async def stop(self, grace):
            self.stopped = grace

    class Engine:
        async def run(self):
            await asyncio.sleep(0.05)
            raise RuntimeError("injected: a bug in the round")

        async def close(self):
            pass

    servicer = health.aio.HealthServicer()

    async def fake_start(config, discover=None, colocate=None):
        v = verify_main.Verifier(Server(), 0, Engine(), None, servicer)
        v.servicer = type("S", (), {"draining": False, "grammars": None})()
        v.watch_engine(asyncio.create_task(v.engine.run()))
        return v

    monkeypatch.setattr(verify_main, "start_verifier", fake_start)
    statuses = []
    real_set = verify_main.set_health

    async def spy(servicer_, names, status):
        statuses.append((tuple(names), status))
        await real_set(servicer_, names, status)

    monkeypatch.setattr(verify_main, "set_health", spy)
    async def run():
        try:
            await verify_main.serve(VerifierConfig(port=0, metrics_port=-1))
        except SystemExit as exc:  # caught here: asyncio.run would re-raise it from the loop
            return exc.code
        return None

    assert asyncio.run(asyncio.wait_for(run(), 30)) == 1  # the process exits non-zero
    assert (("", "tandem.v1.VerifyService"), health_pb2.HealthCheckResponse.NOT_SERVING) in \
        statuses


def test_a_verifier_that_vanished_has_its_sessions_dropped_by_the_servers_pings():
    """The verifier's host is gone without closing its connection: the draft server's own
    keepalive (not the verifier's) finds it and frees the sessions it held."""
    async def main():
        worker = DraftWorker({Method.NGRAM: NgramProposer()},
                             Limits(vocab_size=1000, max_context_length=256))
        app = await draft_main.build_app(
            DraftConfig(port=0, keepalive_s=0.5, keepalive_timeout_s=1.0), worker,
            common_pb2.WorkerInfo())
        await app.server.start()
        hole = BlackHole(app.port)
        via_hole = await hole.start()
        seq = session()
        side = DraftSide({seq.session_id: seq}, 1000, 4, 4)
        side.pool = draft_link.DraftPool([via_hole], None, side.on_reply,
                                         side.on_link_broken, keepalive=(600.0, 600.0))
        try:
            side.attach(seq)
            await until(lambda: len(seq.drafts) == 4, 10)
            assert worker.load() == 1
            hole.holding = True  # the verifier vanishes: nothing more from it, no close
            t0 = asyncio.get_running_loop().time()
            detected = await until(lambda: worker.load() == 0, 10) - t0
            assert detected < 4.0, detected  # a ping (0.5 s) unanswered for 1 s, with slack
        finally:
            await side.close()
            await app.server.stop(None)
            await worker.aclose()
            hole.server.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_the_draft_servers_pings_default_to_under_a_minute():
    config = DraftConfig()
    assert config.keepalive_s + config.keepalive_timeout_s <= 60
    for bad in (0, -1.0, float("nan"), "30"):
        with pytest.raises(ValueError):
            DraftConfig(keepalive_s=bad)


def test_a_full_worker_sends_its_session_to_another_over_real_links():
    """Worker A is full and refuses the session (RESOURCE_EXHAUSTED) on a link that stays
    up: the session drafts from worker B, not from A again and again."""
    async def main():
        full = DraftWorker({Method.NGRAM: NgramProposer()},
                           Limits(vocab_size=1000, max_context_length=256, max_sessions=1))
        a = await draft_main.build_app(DraftConfig(port=0), full, common_pb2.WorkerInfo())
        await a.server.start()
        b = await ngram_server()
        first, seq = session("first"), session("s")
        side = DraftSide({s.session_id: s for s in (first, seq)}, 1000, 4, 4)
        side.pool = draft_link.DraftPool([f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"],
                                         None, side.on_reply, side.on_link_broken)
        try:
            side.attach(first)  # takes A's only place
            await until(lambda: len(first.drafts) == 4, 10)
            side.attach(seq)
            await until(lambda: seq.session_id not in side.links and seq.epoch > 0, 10)
            side.commit(seq, seq.num_tokens, [], run_ahead=4)  # the next round re-attaches
            await until(lambda: len(seq.drafts) == 4, 10)
            assert side.links[seq.session_id].address == f"127.0.0.1:{b.port}"
            assert side.links[first.session_id].alive  # A's link itself is fine
        finally:
            await side.close()
            for app in (a, b):
                await app.server.stop(None)
                await app.worker.aclose()

    asyncio.run(asyncio.wait_for(main(), 60))
