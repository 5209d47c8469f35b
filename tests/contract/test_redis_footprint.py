"""Redis holds only what is read (issue 47): a session's record keeps its prompt's length,
not its ids, and a finished session expires soon; so thousands of long-prompt requests leave
a small footprint in a real redis-server."""
import asyncio
import time

import pytest
import redis.asyncio as aioredis

from gateway.sessions import RedisSessionStore

pytestmark = pytest.mark.contract

PROMPT = list(range(20_000, 28_192))  # an 8K-token prompt: ~48 KB as JSON
SESSIONS = 10_000  # the count of requests


def test_long_prompts_leave_a_small_footprint(redis_proc):
    async def main():
        r = aioredis.Redis.from_url(redis_proc.url)
        try:
            store = RedisSessionStore(r, prefix="footprint", clock=time.time)
            before = (await r.info("memory"))["used_memory"]
            for i in range(SESSIONS):
                sid = f"cmpl-{i}"
                await store.create(sid, model="m", prompt_token_ids=PROMPT)
                await store.assign(sid, verifier="v:1", draft="")
                await store.append(sid, list(range(16)))
                await store.finish(sid, status="finished", finish_reason="stop")
            grown = (await r.info("memory"))["used_memory"] - before
            record = await store.get("cmpl-0")
            ttl = await r.ttl(store.key("cmpl-0"))
            return grown, record, ttl
        finally:
            await r.aclose()

    grown, record, ttl = asyncio.run(main())
    # Storing the ids took ~48 KB a session (~96 MB here); a record and 16 committed ids take
    # a few hundred bytes.
    assert grown < 4 * SESSIONS * 1024, grown
    assert record.prompt_tokens == len(PROMPT) and list(record.committed_token_ids) == list(
        range(16))
    assert 0 < ttl <= 300


def test_stop_token_ids_are_capped(redis_proc):
    from gateway.errors import APIError
    from gateway.schemas import CompletionRequest, check_common

    check_common(CompletionRequest(prompt="x", stop_token_ids=list(range(64))),
                 max_spec_tokens=16)
    with pytest.raises(APIError, match="stop_token_ids: at most 64"):
        check_common(CompletionRequest(prompt="x", stop_token_ids=list(range(65))),
                     max_spec_tokens=16)
