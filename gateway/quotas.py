"""Per-caller request and token quotas in Redis, over fixed one-minute windows.

Key layout (prefix defaults to "tandem"; every key expires):
  {prefix}:ratelimit:{who}:{win}         STRING  requests of `who` in minute `win` (INCR)
  {prefix}:ratelimit:{who}:{win}:tokens  STRING  prompt + completion tokens of the requests
                                                 `who` finished in minute `win` (INCRBY)

`who` is gateway.sessions.identity: a key's digest prefix, or the client address without keys.
A request's tokens are known only when it ends, so a token quota is held in advance: a
request starts only while its window has tokens left, and reserves its prompt + max_tokens
(at most what is left) in one atomic step; when it ends the reservation is settled to what it
used. Concurrent requests therefore start only while their reservations fit, and a window
goes over its quota by at most the unreserved part of the one request that took its last
tokens. Callers route these through a RedisBreaker and fail open on RedisError.
"""
from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.errors import rate_limited
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


@dataclass(frozen=True)
class Reservation:
    window: int
    tokens: int  # held in that window, settled when the request ends


# Admit while tokens are left; hold the request's most (no more than is left), in one step so
# that concurrent requests cannot all pass the check before any of them is counted.
_RESERVE = """
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
local quota = tonumber(ARGV[1])
if used >= quota then return {0, used} end
local take = math.min(tonumber(ARGV[2]), quota - used)
redis.call('INCRBY', KEYS[1], take)
redis.call('EXPIRE', KEYS[1], ARGV[3])
return {take, used}
"""


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

    async def reserve(self, who: str, tokens: int, tpm: int) -> Reservation | Refusal:
        """Hold up to `tokens` of `who`'s current window, or a Refusal when none is left."""
        now = self._clock()
        window = int(now // self.WINDOW_S)
        take, used = await self._redis.eval(_RESERVE, 1, f"{self._key(who, window)}:tokens",
                                            tpm, max(0, tokens), self.WINDOW_S + 1)
        if take <= 0 and used >= tpm:
            return Refusal(f"token quota exceeded: {used} of {tpm} tokens per minute used",
                           (window + 1) * self.WINDOW_S - now)
        return Reservation(window, int(take))

    async def settle(self, who: str, held: Reservation, tokens: int) -> None:
        """A request that held `held` used `tokens`: its window counts those instead. Once
        the window has turned, only tokens beyond the reservation count (in the new one)."""
        window = int(self._clock() // self.WINDOW_S)
        delta = tokens - held.tokens if window == held.window else max(0, tokens - held.tokens)
        if delta == 0:
            return
        key = f"{self._key(who, window)}:tokens"
        pipe = self._redis.pipeline(transaction=True)
        pipe.incrby(key, delta)
        pipe.expire(key, self.WINDOW_S + 1)
        await pipe.execute()

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


async def metered(events: AsyncIterator, quotas: RedisQuotas, who: str, prompt_tokens: int,
                  tpm: int = 0, most: int = 0) -> AsyncIterator:
    """Pass a session's events through, charging prompt + completion tokens as the Finished
    event goes by: before it is passed on, since a non-streaming caller stops reading there.
    A request that ends without one (the client went away, an error) is charged its prompt
    and the tokens delivered so far, however it ends. With a quota (`tpm`), the request first
    reserves `most` tokens, a 429 when none are left, and the charge settles that."""
    held = await _reserve(quotas, who, most, tpm) if tpm else None
    delivered, charged = 0, False
    try:
        async with aclosing(events):
            async for ev in events:
                if isinstance(ev, TextDelta):
                    delivered += ev.tokens
                elif isinstance(ev, Finished):
                    charged = True
                    await _charge(quotas, who, prompt_tokens + ev.completion_tokens, held)
                yield ev
    finally:
        if not charged:  # shielded: the request's task may be being cancelled
            task = asyncio.ensure_future(_charge(quotas, who, prompt_tokens + delivered, held))
            quotas.hold(task)
            await asyncio.shield(task)  # cancelled: the charge still completes (held)


async def _reserve(quotas: RedisQuotas, who: str, most: int, tpm: int) -> Reservation | None:
    try:
        held = await quotas.reserve(who, most, tpm)
    except (RedisError, OSError) as exc:  # fail open: charged when it ends, as without one
        log.warning("token quota not reserved for %s: %s", who, exc)
        return None
    if isinstance(held, Refusal):
        raise rate_limited(held.message, math.ceil(held.retry_after_s))
    return held


async def _charge(quotas: RedisQuotas, who: str, tokens: int,
                  held: Reservation | None = None) -> None:
    try:
        if held is None:
            await quotas.charge(who, tokens)
        else:
            await quotas.settle(who, held, tokens)
    except (RedisError, OSError) as exc:  # fail open, like the limiter
        log.warning("token quota not charged for %s: %s", who, exc)
