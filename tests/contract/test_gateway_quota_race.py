"""A token quota holds under concurrent requests (issue 47): each request reserves its
prompt + max_tokens atomically before it starts, so requests that arrive together cannot
all pass a check that counts only the requests already finished."""
from __future__ import annotations

import asyncio
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis.asyncio as aioredis
from test_gateway import (
    MODEL,
    FakeVerifier,
    LoopThread,
    continue_text,
    make_app,
    uvicorn_server,
)

from gateway.auth import ApiKey, digest_of
from gateway.quotas import RedisQuotas, Refusal, Reservation

pytestmark = pytest.mark.contract
TPM = 40
BODY = {"model": MODEL, "prompt": "x", "max_tokens": 5}


@pytest.fixture(scope="module")
def slow_verifier(tokenizer):
    """Every call answers the same short text after half a second: requests overlap."""
    loop = LoopThread()
    ids = tokenizer.encode("Hi there", add_special_tokens=False)
    fake = FakeVerifier(continue_text(ids, per_round=8, delay=0.5), max_sessions=64)
    loop.run(fake.start())
    yield fake
    loop.run(fake.server.stop(None))
    loop.close()


def test_concurrent_requests_stay_within_the_token_quota(redis_proc, tokenizer, slow_verifier):
    key = ApiKey(digest_of("sk-race"), "race", tpm=TPM)
    app = make_app(redis_proc, tokenizer, f"race{uuid.uuid4().hex[:8]}", api_keys=(key,),
                   static_verifiers=(slow_verifier.address,), static_capacity=64)
    with uvicorn_server(app) as base, ThreadPoolExecutor(20) as pool:
        def post(_):
            return httpx.post(base + "/v1/completions", json=BODY, timeout=30,
                              headers={"Authorization": "Bearer sk-race"})

        answers = list(pool.map(post, range(20)))
    served = [a.json()["usage"]["total_tokens"] for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code == 429]
    assert len(served) + len(refused) == 20
    # 20 requests of 6 tokens at most (1 + max_tokens 5) for a quota of 40: some must wait
    assert served and refused
    assert sum(served) <= TPM, served
    assert "token quota exceeded" in refused[0].json()["error"]["message"]


def test_a_reservation_is_settled_to_what_the_request_used(redis_proc):
    async def go():
        r = aioredis.Redis.from_url(redis_proc.url)
        quotas = RedisQuotas(r, prefix=f"settle{uuid.uuid4().hex[:8]}", clock=lambda: 100.0)
        got = await asyncio.gather(*(quotas.reserve("k", 15, 40) for _ in range(4)))
        held = sorted((g for g in got if isinstance(g, Reservation)), key=lambda g: g.tokens)
        assert held == [Reservation(1, 10), Reservation(1, 15), Reservation(1, 15)]
        (refused,) = [g for g in got if isinstance(g, Refusal)]
        assert "40 of 40" in refused.message
        await quotas.settle("k", held[-1], 4)  # used 4 of its 15: 11 back for others
        assert await quotas.reserve("k", 15, 40) == Reservation(1, 11)
        await r.aclose()
    asyncio.run(go())
