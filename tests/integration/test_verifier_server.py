"""The verifier's gRPC surface: status codes, cancellation, health during a forward."""
import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.netaddr import has_ipv6_loopback
from tandem.v1 import common_pb2, verify_pb2, verify_pb2_grpc
from verify_service.config import VerifierConfig
from verify_service.main import start_verifier

pytestmark = pytest.mark.integration


def request(session_id="s", prompt=(1, 2, 3, 4), max_new=8, **kw):
    kw.setdefault("sampling", common_pb2.SamplingParams(temperature=0))
    return verify_pb2.GenerateRequest(
        session_id=session_id, prompt_token_ids=list(prompt),
        stopping=verify_pb2.StoppingCriteria(max_new_tokens=max_new), **kw)


def with_verifier(target_model, body, **config):
    async def main():
        config.setdefault("kv_cache_mb", 64)
        v = await start_verifier(VerifierConfig(**config), model=target_model)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{v.port}") as ch:
                return await body(v, verify_pb2_grpc.VerifyServiceStub(ch), ch)
        finally:
            await v.drain_and_stop(0)

    return asyncio.run(main())


async def status_of(stub, req) -> grpc.StatusCode:
    try:
        async for _ in stub.Generate(req, timeout=60):
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


BAD = [
    (request(prompt=()), "prompt_token_ids is empty"),
    (request(prompt=(1, 60000)), "outside the vocabulary"),
    (request(session_id=""), "session_id is empty"),
    (request(max_new=0), "max_new_tokens"),
    (request(max_new=9000), "exceeds the context"),
    (request(sampling=common_pb2.SamplingParams(temperature=-1)), "temperature"),
    (request(sampling=common_pb2.SamplingParams(top_p=1.5)), "top_p"),
    (request(speculation=verify_pb2.SpeculationConfig(num_speculative_tokens=99)),
     "num_speculative_tokens"),
    (request(speculation=verify_pb2.SpeculationConfig(method=42)), "unknown speculation method"),
    (request(logprobs=True, top_logprobs=21), "top_logprobs must be in [0, 20]"),
]


def test_bad_requests_are_invalid_argument_and_the_server_keeps_serving(target_model):
    async def body(v, stub, ch):
        for req, words in BAD:
            code, details = await status_of(stub, req)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and words in details, (req, details)
        return await status_of(stub, request())

    assert with_verifier(target_model, body)[0] == grpc.StatusCode.OK


def test_full_duplicate_and_cancel(target_model):
    async def body(v, stub, ch):
        first = stub.Generate(request("a", max_new=200), timeout=60)
        await first.read()  # "a" is generating
        dup = await status_of(stub, request("a"))
        full = await status_of(stub, request("b"))
        first.cancel()
        for _ in range(100):  # the cancelled session is released promptly
            if not v.engine.sessions:
                break
            await asyncio.sleep(0.05)
        after = await status_of(stub, request("c"))
        return dup[0], full[0], v.engine.sessions, after[0], v.engine.scheduler.blocks.usage

    dup, full, sessions, after, usage = with_verifier(target_model, body, max_sessions=1)
    assert dup == grpc.StatusCode.ALREADY_EXISTS
    assert full == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert sessions == {} and after == grpc.StatusCode.OK and usage == 0.0


def test_health_answers_during_a_long_forward(target_model):
    async def body(v, stub, ch):
        health = health_pb2_grpc.HealthStub(ch)
        # A 1500-token prefill keeps the forward thread busy for seconds.
        call = stub.Generate(request("long", prompt=[5] * 1500, max_new=2), timeout=120)
        reader = asyncio.create_task(call.read())
        await asyncio.sleep(0.3)
        latencies = []
        while not reader.done():
            t = time.perf_counter()
            resp = await health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            latencies.append(time.perf_counter() - t)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
            await asyncio.sleep(0.1)
        await reader
        return latencies

    latencies = with_verifier(target_model, body, kv_cache_mb=128)
    assert len(latencies) >= 3 and max(latencies) < 1.0


def test_a_session_larger_than_the_cache_is_refused_not_queued(target_model):
    async def body(v, stub, ch):
        return await status_of(stub, request(prompt=[5] * 2000, max_new=8))

    code, details = with_verifier(target_model, body, kv_cache_mb=16)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "KV blocks" in details


def test_the_cost_curve_is_measured_at_start_up(target_model):
    """k is chosen from this machine's own forward times per token count, not a table."""
    async def body(v, stub, ch):
        sched = v.engine.scheduler
        return dict(sched.cost.ms), dict(sched.step_cost.calibrated)

    ms, step = with_verifier(target_model, body, calibrate_reps=1)
    assert set(ms) == {1, 2, 3, 4, 5, 6, 8, 12, 17} and all(t > 0 for t in ms.values())
    # The batch plan's curve: the same points and whole steps' token counts beyond them.
    assert set(step) == set(ms) | {16, 32, 64} and step[64] > step[1]
    assert with_verifier(target_model, body, calibrate_reps=0) == ({}, {})


def test_begin_drain_refuses_new_sessions_and_finishes_open_ones(target_model):
    """SIGUSR1's half of a drain (Verifier.begin_drain): readiness NOT_SERVING, liveness
    SERVING, new Generate calls UNAVAILABLE, the open stream runs to its end."""
    async def body(v, stub, ch):
        call = stub.Generate(request(session_id="open", max_new=16), timeout=60)
        got = list((await call.read()).token_ids)
        await v.begin_drain()
        hs = health_pb2_grpc.HealthStub(ch)
        for service, want in (("tandem.v1.VerifyService", "NOT_SERVING"), ("", "SERVING")):
            resp = await hs.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.ServingStatus.Value(want)
        assert await status_of(stub, request(session_id="new")) == (grpc.StatusCode.UNAVAILABLE,
                                                             "verifier is draining")
        last = None
        while (resp := await call.read()) is not grpc.aio.EOF:
            got += resp.token_ids
            last = resp
        assert last.finish_reason in (verify_pb2.FINISH_REASON_STOP,
                                      verify_pb2.FINISH_REASON_LENGTH)
        assert len(got) == 16 or last.finish_reason == verify_pb2.FINISH_REASON_STOP

    with_verifier(target_model, body, calibrate_reps=0)




@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback (::1) on this host")
def test_a_verifier_binds_ipv6_loopback(target_model):
    from tandem.netaddr import join_host_port

    async def main():
        v = await start_verifier(VerifierConfig(host="::1", kv_cache_mb=16, calibrate_reps=0),
                                 model=target_model)
        try:
            async with grpc.aio.insecure_channel(join_host_port("::1", v.port)) as ch:
                info = await verify_pb2_grpc.VerifyServiceStub(ch).Info(
                    common_pb2.InfoRequest(), timeout=10)
                assert info.vocab_size == target_model.cfg.vocab_size
        finally:
            await v.drain_and_stop(0)

    asyncio.run(main())
