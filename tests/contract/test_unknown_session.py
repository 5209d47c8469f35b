"""Unknown sessions are NOT_FOUND (the convention: bad input INVALID_ARGUMENT, unknown session
NOT_FOUND, full RESOURCE_EXHAUSTED, draining UNAVAILABLE).

The draft worker looks a session up by id for every commit; an id it does not hold raises
tandem.errors.NotFound. On the Speculate stream that is answered in-band
(DRAFT_ERROR_CODE_UNKNOWN_SESSION, draft.proto: one bad session never ends the shared stream);
a servicer that lets NotFound escape gets gRPC NOT_FOUND from the StatusInterceptor.
"""
import asyncio

import grpc
import pytest

from draft_service.config import DraftConfig
from draft_service.limits import Limits
from draft_service.main import build_app
from draft_service.session import Stream
from draft_service.worker import DraftWorker
from tandem.errors import NotFound
from tandem.grpc_status import StatusInterceptor
from tandem.spec import DraftResult, DraftToken, Method
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc

pytestmark = pytest.mark.contract

LOOKUP = "/test.Sessions/Lookup"


class CountingProposer:
    """Drafts last_token + 1, one per call (no model)."""

    method = Method.DRAFT_MODEL

    def propose(self, reqs):
        return [DraftResult([DraftToken((r.token_ids[-1] + 1) % 100)]) for r in reqs]

    def release(self, session_key) -> None:
        pass


def _worker() -> DraftWorker:
    limits = Limits(vocab_size=100, max_context_length=64)
    return DraftWorker({Method.DRAFT_MODEL: CountingProposer()}, limits)


def _open(session_id: str) -> draft_pb2.DraftControl:
    return draft_pb2.DraftControl(open=draft_pb2.OpenSession(
        session_id=session_id, token_ids=[1, 2, 3],
        method=common_pb2.SPECULATION_METHOD_DRAFT_MODEL,
        sampling=common_pb2.SamplingParams(temperature=0), max_run_ahead=2))


def _commit(session_id: str) -> draft_pb2.DraftControl:
    return draft_pb2.DraftControl(commit=draft_pb2.CommitTokens(
        session_id=session_id, epoch=0, start_position=3, token_ids=[4]))


def test_the_draft_workers_lookup_raises_not_found():
    with pytest.raises(NotFound, match="ghost"):
        DraftWorker.session(Stream(), "ghost")


def test_commit_to_an_unknown_session_is_unknown_session_and_the_stream_goes_on():
    async def main():
        config = DraftConfig(host="127.0.0.1", port=0, model=None, drain_grace_s=0.2)
        app = await build_app(config, _worker(), common_pb2.WorkerInfo())
        await app.server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
                call = draft_pb2_grpc.DraftServiceStub(channel).Speculate()
                await call.write(_commit("ghost"))
                reply = await call.read()
                assert reply.session_id == "ghost"
                assert reply.error.code == draft_pb2.DRAFT_ERROR_CODE_UNKNOWN_SESSION
                assert "ghost" in reply.error.message
                await call.write(_open("good"))  # the shared stream still serves others
                reply = await call.read()
                assert reply.session_id == "good" and not reply.HasField("error")
                assert reply.position == 3
                call.cancel()
        finally:
            await app.server.stop(None)
            await app.worker.aclose()
    asyncio.run(asyncio.wait_for(main(), 30))


def _lookup_handler(known: set[str]) -> grpc.GenericRpcHandler:
    async def lookup(request: bytes, context) -> bytes:
        session_id = request.decode()
        if session_id not in known:
            raise NotFound(f"session {session_id!r} is unknown")
        return request
    return grpc.method_handlers_generic_handler("test.Sessions", {
        "Lookup": grpc.unary_unary_rpc_method_handler(lookup)})


@pytest.mark.parametrize("session_id, code",
                         [("known", None), ("ghost", grpc.StatusCode.NOT_FOUND)])
def test_a_servicer_raising_not_found_answers_not_found(session_id, code):
    async def main():
        server = grpc.aio.server(interceptors=[StatusInterceptor()])
        server.add_generic_rpc_handlers((_lookup_handler({"known"}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.unary_unary(LOOKUP)
                try:
                    assert await call(session_id.encode(), timeout=5) == session_id.encode()
                    got = None
                except grpc.aio.AioRpcError as exc:
                    got, details = exc.code(), exc.details()
                    assert session_id in details
                assert got == code
        finally:
            await server.stop(None)
    asyncio.run(asyncio.wait_for(main(), 30))
