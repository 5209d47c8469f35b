"""`tandem drain` end to end: redis-server, two verifier processes and the gateway (started by
`tandem up`'s launcher). A verifier sent SIGUSR1 while it streams leaves the registry within a
second, finishes the stream it holds, refuses new sessions with UNAVAILABLE, and the gateway
sends new requests to the other verifier.
"""
import asyncio
import json
import signal
import threading
import time

import grpc
import httpx
import pytest
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.sessions import RedisSessionStore
from tandem.registry import WorkerRegistry
from tandem.v1 import verify_pb2, verify_pb2_grpc
from tools.launcher import Cluster, ClusterConfig, free_port

pytestmark = pytest.mark.e2e
SERVICE = "tandem.v1.VerifyService"
# Lean verifiers: no start-up calibration, a small cache, no in-process drafts.
LEAN = {"TANDEM_VERIFIER_CALIBRATE_REPS": "0", "TANDEM_VERIFIER_KV_CACHE_MB": "64",
        "TANDEM_VERIFIER_LAYER_SKIP": "off", "TANDEM_VERIFIER_MEDUSA": "off"}


@pytest.fixture(scope="module")
def cluster(target_paths):
    c = Cluster(ClusterConfig(num_drafts=0, num_verifiers=2, gateway_port=free_port(),
                              model=str(target_paths.root), threads=1),
                log=lambda m: None, env=LEAN)
    try:
        c.start()
        yield c
    finally:
        c.stop()


def body(prompt: str, stream: bool, max_tokens: int) -> dict:
    return {"model": "SmolLM2-135M-Instruct", "max_tokens": max_tokens, "temperature": 0,
            "stream": stream, "speculation": {"method": "none"},
            "messages": [{"role": "user", "content": prompt}]}


def stream_chat(url: str, events: list) -> None:
    req = {**body("Tell a long story about a dragon.", True, 40),
           "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=300, json=req) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))


def record(cluster, session_id: str):
    async def get():
        client = aioredis.Redis.from_url(cluster.redis_url, password=cluster.redis_password)
        try:
            return await RedisSessionStore(client, clock=time.time).get(session_id)
        finally:
            await client.aclose()
    return asyncio.run(get())


def registered(cluster) -> set[str]:
    async def addresses():
        client = aioredis.Redis.from_url(cluster.redis_url, password=cluster.redis_password)
        try:
            return {w.address for w in await WorkerRegistry(client).list("verifier")}
        finally:
            await client.aclose()
    return asyncio.run(addresses())


def health(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_sigusr1_drains_a_verifier_without_dropping_its_stream(cluster):
    assert registered(cluster) == {cluster.addresses["verifier-0"],
                                   cluster.addresses["verifier-1"]}
    events: list = []
    streamer = threading.Thread(target=stream_chat, args=(cluster.gateway_url, events))
    streamer.start()
    deadline = time.monotonic() + 120
    while len(events) < 3:  # the session is generating on one verifier
        assert streamer.is_alive() and time.monotonic() < deadline, "no stream"
        time.sleep(0.05)
    session_id = events[0]["id"]
    drained = record(cluster, session_id).verifier
    name = next(n for n, a in cluster.addresses.items() if a == drained)
    other = next(a for n, a in cluster.addresses.items() if n != name)

    dict(cluster.procs)[name].send_signal(signal.SIGUSR1)  # what `tandem drain` sends
    at_signal = len(events)
    start = time.monotonic()
    while drained in registered(cluster):
        assert time.monotonic() - start < 1.0, "still registered 1 s after SIGUSR1"
        time.sleep(0.02)
    assert health(drained, SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert health(drained, "") == health_pb2.HealthCheckResponse.SERVING  # liveness
    with grpc.insecure_channel(drained) as ch, pytest.raises(grpc.RpcError) as err:
        next(verify_pb2_grpc.VerifyServiceStub(ch).Generate(verify_pb2.GenerateRequest(
            session_id="direct", prompt_token_ids=[1, 2, 3],
            stopping=verify_pb2.StoppingCriteria(max_new_tokens=4)), timeout=10))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    streamer.join(300)
    assert len(events) > at_signal + 3  # the stream went on after the signal
    finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finish in (["stop"], ["length"])
    rec = record(cluster, session_id)  # finished where it started: no failover, nothing cut
    assert (rec.status, rec.verifier, rec.attempts) == ("finished", drained, 1)
    assert len(rec.committed_token_ids) >= events[-1]["usage"]["completion_tokens"] > 3

    for prompt in ("What is the capital of France?", "List three colours."):
        r = httpx.post(cluster.gateway_url + "/v1/chat/completions", timeout=300,
                       json=body(prompt, False, 8))
        assert r.status_code == 200, r.text
        rec = record(cluster, r.json()["id"])
        assert (rec.verifier, rec.attempts) == (other, 1)  # routed away, not refused
    assert dict(cluster.procs)[name].poll() is None  # still up until SIGTERM
