"""Per-caller request and token quotas in Redis, over fixed one-minute windows.

Key layout (prefix defaults to "tandem"; every key expires):
  {prefix}:ratelimit:{who}:{win}         STRING  requests of `who` in minute `win` (INCR)
  {prefix}:ratelimit:{who}:{win}:tokens  STRING  prompt + completion tokens of the requests
                                                 `who` finished in minute `win` (INCRBY)

`who` is gateway.sessions.identity: a key's digest prefix, or the client address without keys.
Tokens are known only when a request ends, so they are counted then and enforced before the
next request: one request may overrun the quota, the ones after it wait for the next window.
Callers route these through a RedisBreaker and fail open on RedisError.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.generation import Finished, TextDelta

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """What one caller may use per minute; 0 = unlimited."""

    rpm: int = 0
    tpm: int = 0

    def __post_init__(self) -> None:
        for name in ("rpm", "tpm"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")

    @property
    def active(self) -> bool:
        return self.rpm > 0 or self.tpm > 0


@dataclass(frozen=True)
class Refusal:
    message: str
    retry_after_s: float  # until the window turns


class RedisQuotas:
    WINDOW_S = 60

    def __init__(self, redis: aioredis.Redis, *, prefix: str = "tandem",
                 clock: Callable[[], float]):
        self._redis = redis
        self._prefix = prefix
        self._clock = clock
        self._charging: set[asyncio.Task] = set()  # charges that outlive a cancelled request

    def _key(self, who: str, window: int) -> str:
        return f"{self._prefix}:ratelimit:{who}:{window}"

    async def check(self, who: str, limits: Limits) -> Refusal | None:
        """Count one request of `who`; a Refusal when it is over either quota."""
        if not limits.active:
            return None
        now = self._clock()
        window = int(now // self.WINDOW_S)
        key = self._key(who, window)
        pipe = self._redis.pipeline(transaction=True)
        if limits.rpm:
            pipe.incr(key)
            pipe.expire(key, self.WINDOW_S + 1)
        if limits.tpm:
            pipe.get(f"{key}:tokens")
        results = await pipe.execute()
        retry_after = (window + 1) * self.WINDOW_S - now
        if limits.rpm and int(results[0]) > limits.rpm:
            return Refusal(f"rate limit exceeded: {limits.rpm} requests per minute",
                           retry_after)
        used = int(results[-1] or 0) if limits.tpm else 0
        if limits.tpm and used >= limits.tpm:
            return Refusal(f"token quota exceeded: {used} of {limits.tpm} tokens per minute "
                           "used", retry_after)
        return None

    def hold(self, task: asyncio.Task) -> None:
        """Keep a charge running after its request is gone (a task needs a reference)."""
        self._charging.add(task)
        task.add_done_callback(self._charging.discard)

    async def charge(self, who: str, tokens: int) -> None:
        """Add a finished request's tokens to `who`'s current window."""
        if tokens <= 0:
            return
        key = f"{self._key(who, int(self._clock() // self.WINDOW_S))}:tokens"
        pipe = self._redis.pipeline(transaction=True)
        pipe.incrby(key, tokens)
        pipe.expire(key, self.WINDOW_S + 1)
        await pipe.execute()


async def metered(events: AsyncIterator, quotas: RedisQuotas, who: str,
                  prompt_tokens: int) -> AsyncIterator:
    """Pass a session's events through, charging prompt + completion tokens as the Finished
    event goes by: before it is passed on, since a non-streaming caller stops reading there.
    A request that ends without one (the client went away, an error) is charged its prompt
    and the tokens delivered so far, however it ends."""
    delivered, charged = 0, False
    try:
        async with aclosing(events):
            async for ev in events:
                if isinstance(ev, TextDelta):
                    delivered += ev.tokens
                elif isinstance(ev, Finished):
                    charged = True
                    await _charge(quotas, who, prompt_tokens + ev.completion_tokens)
                yield ev
    finally:
        if not charged:  # shielded: the request's task may be being cancelled
            task = asyncio.ensure_future(_charge(quotas, who, prompt_tokens + delivered))
            quotas.hold(task)
            await asyncio.shield(task)  # cancelled: the charge still completes (held)


async def _charge(quotas: RedisQuotas, who: str, tokens: int) -> None:
    try:
        await quotas.charge(who, tokens)
    except (RedisError, OSError) as exc:  # fail open, like the limiter
        log.warning("token quota not charged for %s: %s", who, exc)
