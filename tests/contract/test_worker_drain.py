"""A draft worker's `serve()` (the process entry) on SIGUSR1 and over IPv6, with a real Redis
registry and real gRPC on loopback.

SIGUSR1 (`tandem drain`, the preStop hook) must take the worker out of the registry at once,
report its service NOT_SERVING (liveness "" stays SERVING), refuse new streams with
UNAVAILABLE and keep drafting on the streams already open; SIGTERM then stops it.
"""
import asyncio
import contextlib
import os
import signal
import time
import uuid

import grpc
import pytest
import redis.asyncio as aioredis
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from draft_service.config import DraftConfig
from draft_service.main import serve
from draft_service.server import SERVICE_NAME
from tandem.netaddr import has_ipv6_loopback, join_host_port, split_host_port
from tandem.registration import Registration
from tandem.registry import WorkerRegistry
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc

pytestmark = pytest.mark.contract
NGRAM = common_pb2.SPECULATION_METHOD_NGRAM
PROMPT = [10, 11, 12, 13, 14, 15, 10, 11, 12]  # n-gram lookup proposes 13, 14, 15, ...




def open_msg(session_id: str) -> draft_pb2.DraftControl:
    return draft_pb2.DraftControl(open=draft_pb2.OpenSession(
        session_id=session_id, token_ids=PROMPT, method=NGRAM, max_run_ahead=2,
        sampling=common_pb2.SamplingParams(temperature=0.0)))


async def proposals(call, n: int) -> list:
    got = []
    while len(got) < n:
        msg = await asyncio.wait_for(call.read(), 10)
        assert msg is not grpc.aio.EOF and not msg.HasField("error"), msg
        got.append(msg)
    return got


class Worker:
    """serve() as a task of the test's loop, registered under a fresh id."""

    def __init__(self, redis_url: str, target_paths, host: str):
        self.worker_id = f"draft-{uuid.uuid4().hex[:6]}"
        self.config = DraftConfig(host=host, port=0, model=None, drain_grace_s=0.2,
                                  tokenizer=str(target_paths.root),
                                  threads=torch.get_num_threads())
        # port 0: serve() registers the port it bound
        self.registration = Registration(redis_url, "draft", join_host_port(host, 0),
                                         self.worker_id)
        self.registry = WorkerRegistry(aioredis.Redis.from_url(redis_url))
        self.task: asyncio.Task | None = None

    async def start(self) -> str:
        """The address it registered, once it is listed."""
        self.task = asyncio.create_task(serve(self.config, registration=self.registration))
        for _ in range(200):
            if (rec := await self.record()) is not None:
                return rec.address
            await asyncio.sleep(0.05)
        raise AssertionError("the worker never registered")

    async def record(self):
        found = [r for r in await self.registry.list("draft") if r.worker_id == self.worker_id]
        return found[0] if found else None

    async def stop(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(self.task, 10)


async def health(channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return (await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)).status


def test_sigusr1_leaves_the_registry_refuses_new_streams_and_serves_open_ones(
        redis_proc, target_paths):
    async def main():
        worker = Worker(redis_proc.url, target_paths, "127.0.0.1")
        address = await worker.start()
        async with grpc.aio.insecure_channel(address) as channel:
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            call = stub.Speculate()
            await call.write(open_msg("open"))
            first = await proposals(call, 2)
            assert [p.token_id for p in first] == [13, 14]
            os.kill(os.getpid(), signal.SIGUSR1)
            start = time.monotonic()
            while await worker.record() is not None:  # deregistered, not left to expire
                assert time.monotonic() - start < 1.0, "still registered 1 s after SIGUSR1"
                await asyncio.sleep(0.02)
            assert await health(channel, SERVICE_NAME) == health_pb2.HealthCheckResponse.NOT_SERVING
            assert await health(channel, "") == health_pb2.HealthCheckResponse.SERVING
            refused = stub.Speculate()
            await refused.write(open_msg("new"))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(refused.read(), 5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "draining" in err.value.details()
            # the open stream drafts on: accept the first draft, get the next one
            await call.write(draft_pb2.DraftControl(commit=draft_pb2.CommitTokens(
                session_id="open", epoch=0, start_position=len(PROMPT), token_ids=[13])))
            more = await proposals(call, 1)
            assert more[0].position == len(PROMPT) + 2 and more[0].token_id == 15
            os.kill(os.getpid(), signal.SIGUSR1)  # a second one changes nothing
            await asyncio.sleep(0.1)
            call.cancel()
        await worker.stop()
    asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback (::1) on this host")
def test_a_worker_on_ipv6_loopback_registers_a_bracketed_address_and_is_reached(
        redis_proc, target_paths):
    async def main():
        worker = Worker(redis_proc.url, target_paths, "::1")
        address = await worker.start()
        host, port = split_host_port(address)
        assert address == f"[::1]:{port}" and host == "::1" and port > 0
        async with grpc.aio.insecure_channel(address) as channel:  # what a verifier dials
            info = await draft_pb2_grpc.DraftServiceStub(channel).Info(
                common_pb2.InfoRequest(), timeout=5)
            assert info.model_id == "ngram"
        await worker.stop()
    asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback (::1) on this host")
def test_a_worker_bound_to_all_addresses_answers_on_ipv4_and_ipv6(target_paths):
    """--host=:: binds dual stack: reachable over 127.0.0.1 and ::1."""
    from draft_service.main import build_app

    async def main():
        app = await build_app(DraftConfig(host="::", port=0, model=None,
                                          tokenizer=str(target_paths.root)))
        await app.server.start()
        try:
            for target in (f"127.0.0.1:{app.port}", f"[::1]:{app.port}"):
                async with grpc.aio.insecure_channel(target) as channel:
                    assert await health(channel, "") == health_pb2.HealthCheckResponse.SERVING
        finally:
            await app.server.stop(None)
            with contextlib.suppress(Exception):
                await app.worker.aclose()
    asyncio.run(asyncio.wait_for(main(), 30))
