"""The gateway's /health body: Redis (reachable, filling, full) and the live verifiers."""
from __future__ import annotations

import asyncio
from typing import Any

from redis.exceptions import RedisError


async def health_body(gw: Any) -> dict:  # gw: gateway.app._Gateway
    """Redis filling or full makes the status "degraded", never a 503: requests are still
    served (limits fail open), and failing the liveness probe of every gateway would restart
    them all without freeing a byte of Redis."""
    from tandem import redis_memory

    try:
        redis_ok = bool(await gw.breaker.call(gw.redis.ping))
    except RedisError:
        redis_ok = False
    verifiers = await gw.router.verifiers() if redis_ok else []
    memory = None
    if redis_ok:  # not through the breaker: a Redis that refuses INFO must not open it
        watch = redis_memory.watch_of(gw.redis, gw.metrics.redis_memory)
        memory = await watch.read(lambda: asyncio.wait_for(
            redis_memory.read_memory(gw.redis), gw.config.redis_timeout_s))
    state = memory.state if memory is not None else "ok"
    return {"status": "ok" if state == "ok" else "degraded",
            "redis": state if redis_ok else "unavailable",
            "redis_memory": memory.report() if memory is not None else None,
            "verifiers": len(verifiers), "model": gw.config.model_name}
