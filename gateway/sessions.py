"""Per-session state in Redis: session records, affinity (rate limits: gateway/quotas.py).

Key layout (prefix defaults to "tandem"; every key expires):
  {prefix}:session:{id}            HASH    status, model, prompt_tokens (a count), verifier,
                                           draft, attempts, finish_reason, error,
                                           created_at, updated_at
  {prefix}:session:{id}:committed  LIST    committed token ids, appended as they stream
  {prefix}:affinity:{hash}         STRING  address of the verifier that served the prefix

The committed list is what a resumed session sends back to the next verifier, so it is
appended (RPUSH) before the tokens are shown to the client. Redis holds only what is read:
not the prompt's ids (the gateway that serves a session has them), and a finished session
only for `finished_ttl_s` (what a client may still look at), not the running session's TTL.
"""
from __future__ import annotations

import asyncio
import inspect
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tandem.backoff import KeyedBackoff

STATUSES = ("queued", "running", "resuming", "finished", "failed", "cancelled")


@dataclass(frozen=True)
class SessionRecord:
    session_id: str
    status: str
    model: str
    prompt_tokens: int
    committed_token_ids: tuple[int, ...]
    verifier: str
    draft: str
    attempts: int
    finish_reason: str
    error: str
    created_at: float
    updated_at: float


class SessionStore(Protocol):
    async def create(self, session_id: str, *, model: str,
                     prompt_token_ids: Sequence[int]) -> None: ...

    async def assign(self, session_id: str, *, verifier: str, draft: str,
                     status: str) -> None: ...

    async def append(self, session_id: str, token_ids: Sequence[int]) -> None: ...

    async def finish(self, session_id: str, *, status: str, finish_reason: str = "",
                     error: str = "") -> None: ...

    async def committed(self, session_id: str) -> list[int]: ...

    async def get(self, session_id: str) -> SessionRecord | None: ...


class AffinityStore(Protocol):
    async def get(self, key: str) -> str | None: ...

    async def set(self, key: str, address: str) -> None: ...


def _s(value: bytes | str | None, default: str = "") -> str:
    if value is None:
        return default
    return value.decode() if isinstance(value, bytes) else value


class RedisSessionStore:
    def __init__(self, redis: aioredis.Redis, *, prefix: str = "tandem", ttl_s: float = 3600.0,
                 clock: Callable[[], float], finished_ttl_s: float = 300.0):
        self._redis = redis
        self._prefix = prefix
        self._ttl = max(1, math.ceil(ttl_s))
        self._finished_ttl = max(1, math.ceil(min(finished_ttl_s, ttl_s)))
        self._clock = clock

    def key(self, session_id: str) -> str:
        return f"{self._prefix}:session:{session_id}"

    def committed_key(self, session_id: str) -> str:
        return f"{self.key(session_id)}:committed"

    async def _write(self, session_id: str, mapping: dict, *, incr_attempts: bool = False,
                     tokens: Sequence[int] = (), ttl_s: int | None = None) -> None:
        key, ckey = self.key(session_id), self.committed_key(session_id)
        pipe = self._redis.pipeline(transaction=True)
        pipe.hset(key, mapping={**mapping, "updated_at": repr(self._clock())})
        if incr_attempts:
            pipe.hincrby(key, "attempts", 1)
        if tokens:
            pipe.rpush(ckey, *tokens)
        pipe.expire(key, ttl_s or self._ttl)
        pipe.expire(ckey, ttl_s or self._ttl)
        await pipe.execute()

    async def create(self, session_id: str, *, model: str,
                     prompt_token_ids: Sequence[int]) -> None:
        now = repr(self._clock())
        await self._redis.delete(self.committed_key(session_id))
        await self._write(session_id, {
            "status": "queued", "model": model, "created_at": now, "attempts": 0,
            "prompt_tokens": len(prompt_token_ids), "verifier": "",
            "draft": "", "finish_reason": "", "error": ""})

    async def assign(self, session_id: str, *, verifier: str, draft: str,
                     status: str = "running") -> None:
        await self._write(session_id, {"status": status, "verifier": verifier, "draft": draft},
                          incr_attempts=True)

    async def append(self, session_id: str, token_ids: Sequence[int]) -> None:
        if token_ids:
            await self._write(session_id, {}, tokens=list(token_ids))

    async def finish(self, session_id: str, *, status: str, finish_reason: str = "",
                     error: str = "") -> None:
        await self._write(session_id, {"status": status, "finish_reason": finish_reason,
                                       "error": error}, ttl_s=self._finished_ttl)

    async def committed(self, session_id: str) -> list[int]:
        return [int(t) for t in await self._redis.lrange(self.committed_key(session_id), 0, -1)]

    async def get(self, session_id: str) -> SessionRecord | None:
        raw = await self._redis.hgetall(self.key(session_id))
        if not raw:
            return None
        h = {_s(k): _s(v) for k, v in raw.items()}
        return SessionRecord(
            session_id=session_id, status=h.get("status", ""), model=h.get("model", ""),
            prompt_tokens=int(h.get("prompt_tokens") or 0),
            committed_token_ids=tuple(await self.committed(session_id)),
            verifier=h.get("verifier", ""), draft=h.get("draft", ""),
            attempts=int(h.get("attempts") or 0), finish_reason=h.get("finish_reason", ""),
            error=h.get("error", ""), created_at=float(h.get("created_at") or 0),
            updated_at=float(h.get("updated_at") or 0))


class RedisAffinityStore:
    def __init__(self, redis: aioredis.Redis, *, prefix: str = "tandem", ttl_s: float = 1800.0):
        self._redis = redis
        self._prefix = prefix
        self._ttl = max(1, math.ceil(ttl_s))

    async def get(self, key: str) -> str | None:
        value = await self._redis.get(f"{self._prefix}:affinity:{key}")
        return _s(value) or None

    async def set(self, key: str, address: str) -> None:
        await self._redis.set(f"{self._prefix}:affinity:{key}", address, ex=self._ttl)


def client_identity(client_host: str | None) -> str:
    """Who a rate limit counts without API keys: the client host (with keys it is
    ApiKey.identity, a name derived from the key's digest)."""
    return "ip-" + (client_host or "unknown")


class RedisSkipped(RedisError):
    """Redis failed recently, so the call was not even tried (see RedisBreaker)."""


class RedisBreaker:
    """Stops paying Redis timeouts per call while Redis is down.

    A request touches Redis a dozen times; each failing call would cost the client's
    connect timeout and retries. After one failure every call fails fast for cooldown_s,
    then one call probes again while the others keep failing fast until it answers.
    Callers already treat RedisError as "fall back". The breaker is tandem.backoff's, with a
    fixed cooldown (first = max); what is Redis's own is the timeout and the single probe.
    """

    _KEY = "redis"

    def __init__(self, *, timeout_s: float = 1.0, cooldown_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self._timeout = timeout_s
        self._breaker = KeyedBackoff(cooldown_s, cooldown_s, clock)
        self._probing = False

    @property
    def is_open(self) -> bool:
        return not self._breaker.ready(self._KEY) or self._probing

    async def call(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        if self.is_open:
            raise RedisSkipped("redis unavailable (recent failure); call skipped")
        # the first call after a cooldown (a failure since the last success): the only one
        probe = self._breaker.failures(self._KEY) > 0
        self._probing = probe
        try:
            result = await asyncio.wait_for(fn(*args, **kwargs), timeout=self._timeout)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            self._breaker.failed(self._KEY)
            if isinstance(exc, RedisError):
                raise
            raise RedisSkipped(f"redis call failed: {exc!r}") from exc
        finally:
            if probe:
                self._probing = False
        self._breaker.succeeded(self._KEY)
        return result


class Guarded:
    """`target` with every coroutine method routed through a RedisBreaker."""

    def __init__(self, target: Any, breaker: RedisBreaker):
        self._target = target
        self._breaker = breaker

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if not inspect.iscoroutinefunction(attr):
            return attr

        async def guarded(*args, **kwargs):
            return await self._breaker.call(attr, *args, **kwargs)
        return guarded
