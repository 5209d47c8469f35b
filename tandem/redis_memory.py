"""How full Redis is, said before it is full.

The deployed Redis has a fixed maxmemory and `noeviction` (deploy/k8s/base/redis.yaml): once
full, every write is refused, so rate limits and quotas stop being enforced (they fail open),
heartbeats lapse and discovery loses every worker, sessions go unrecorded. Every service reads
INFO memory now and then (MemoryWatch): the gateway each /health (probed every few seconds)
into its gauge tandem_redis_memory_usage_ratio and its /health body, the workers from their
heartbeat task (tandem.registration); each logs a warning while Redis is past WARN_RATIO.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from redis.exceptions import RedisError

log = logging.getLogger(__name__)

WARN_RATIO = 0.8  # "filling": time to raise maxmemory or find what grows
FULL_RATIO = 0.98  # "full": writes are (about to be) refused
WARN_EVERY_S = 60.0  # a warning again while it stays past WARN_RATIO
READ_EVERY_S = 5.0


@dataclass(frozen=True)
class RedisMemory:
    used_bytes: int
    max_bytes: int  # maxmemory; 0 = no limit (then it never fills, as far as we can tell)

    @property
    def ratio(self) -> float:
        return self.used_bytes / self.max_bytes if self.max_bytes > 0 else 0.0

    @property
    def state(self) -> str:
        """"ok", "filling" (past WARN_RATIO) or "full" (past FULL_RATIO)."""
        if self.ratio >= FULL_RATIO:
            return "full"
        return "filling" if self.ratio >= WARN_RATIO else "ok"

    def report(self) -> dict:
        """For /health."""
        return {"state": self.state, "used_bytes": self.used_bytes,
                "max_bytes": self.max_bytes, "usage_ratio": round(self.ratio, 4)}


async def read_memory(redis) -> RedisMemory:
    info = await redis.info("memory")
    return RedisMemory(int(info.get("used_memory", 0)), int(info.get("maxmemory", 0)))


class MemoryWatch:
    """The last reading of one Redis: read at most every read_every_s, put in `gauge` (the
    usage ratio), warned about while past WARN_RATIO (at once, then every warn_every_s)."""

    def __init__(self, gauge=None, read_every_s: float = READ_EVERY_S,
                 warn_every_s: float = WARN_EVERY_S,
                 clock: Callable[[], float] = time.monotonic):
        self.gauge = gauge
        self.read_every_s, self.warn_every_s = read_every_s, warn_every_s
        self._clock = clock
        self.last: RedisMemory | None = None
        self._read_at = self._warned_at = -math.inf
        self._warned_state = "ok"

    async def read(self, fetch: Callable) -> RedisMemory | None:
        """The reading, fresh when the last is older than read_every_s: `fetch()` gives
        RedisMemory (e.g. read_memory through a circuit breaker). None when Redis cannot
        say (down, or INFO refused): the caller reports it unknown."""
        now = self._clock()
        if now - self._read_at < self.read_every_s:
            return self.last
        self._read_at = now
        try:
            memory = await fetch()
        except (RedisError, OSError, asyncio.TimeoutError):
            self.last = None
            return None
        self.observe(memory, now)
        return memory

    def observe(self, memory: RedisMemory, now: float) -> None:
        self.last = memory
        if self.gauge is not None:
            self.gauge.set(memory.ratio)
        state = memory.state
        if state != "ok" and (state != self._warned_state
                              or now - self._warned_at >= self.warn_every_s):
            self._warned_at = now
            log.warning("Redis memory is %s: %.0f%% of maxmemory used (%.1f of %.1f MiB); "
                        "when full, writes fail: rate limits and quotas are not enforced, "
                        "heartbeats lapse and workers drop out of discovery", state,
                        100 * memory.ratio, memory.used_bytes / 2**20,
                        memory.max_bytes / 2**20)
        elif state == "ok" and self._warned_state != "ok":
            log.info("Redis memory back to %.0f%% of maxmemory", 100 * memory.ratio)
        self._warned_state = state

    async def run(self, redis, stop: asyncio.Event) -> None:
        """Read `redis` every read_every_s until `stop` is set (a worker's background task)."""
        while not stop.is_set():
            await self.read(lambda: asyncio.wait_for(read_memory(redis), self.read_every_s))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.read_every_s)


# One watch per Redis client (the gateway's app holds one client for its life): the gateway
# reads Redis from /health, a request handler, which has nowhere else to keep the last reading.
_watches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def watch_of(redis, gauge=None) -> MemoryWatch:
    """The MemoryWatch of the client `redis` (made on first use, with `gauge`)."""
    watch = _watches.get(redis)
    if watch is None:
        watch = _watches[redis] = MemoryWatch(gauge)
    return watch
