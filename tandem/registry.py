"""Worker registry in Redis: draft and verifier workers announce themselves with a TTL.

Key layout (prefix defaults to "tandem"):
  {prefix}:worker:{role}:{worker_id}  STRING  the WorkerRecord as JSON, expires after ttl_s
  {prefix}:workers:{role}             SET     worker ids of that role (may hold dead ids)

A worker that stops heartbeating disappears when its record expires; the id left in the set
is pruned by the next `list`. The set exists so `list` never has to SCAN the keyspace.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

import redis.asyncio as aioredis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

ROLES = ("draft", "verifier")


@dataclass(frozen=True)
class WorkerRecord:
    """One live worker as the gateway routes to it. `load` and `capacity` count sessions."""

    role: str
    worker_id: str
    address: str
    capacity: int
    load: int
    model_id: str = ""
    tokenizer_hash: str = ""
    max_spec_tokens: int = 0
    # Draft workers: the speculation methods served (API names); empty = not advertised.
    methods: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not self.worker_id or not self.address:
            raise ValueError("worker_id and address must be non-empty")
        for name in ("capacity", "load", "max_spec_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")

    @property
    def utilization(self) -> float:
        """load / capacity; a worker that reports no capacity counts as full."""
        return self.load / self.capacity if self.capacity > 0 else float("inf")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> WorkerRecord:
        data = json.loads(raw)
        known = {f.name for f in fields(cls)}
        # Ignore fields a newer worker may add, so old gateways keep routing to it.
        data = {k: v for k, v in data.items() if k in known}
        if "methods" in data:
            data["methods"] = tuple(data["methods"])
        return cls(**data)


class WorkerRegistry:
    """Register, deregister and list workers; every method is a few Redis round trips."""

    def __init__(self, redis: aioredis.Redis, ttl_s: float = 6.0, prefix: str = "tandem"):
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        self._redis = redis
        self.ttl_s = ttl_s
        self.prefix = prefix

    def record_key(self, role: str, worker_id: str) -> str:
        return f"{self.prefix}:worker:{role}:{worker_id}"

    def set_key(self, role: str) -> str:
        return f"{self.prefix}:workers:{role}"

    async def register(self, rec: WorkerRecord) -> None:
        """Create or refresh the worker's record; call again within ttl_s to stay alive."""
        pipe = self._redis.pipeline(transaction=True)
        pipe.set(self.record_key(rec.role, rec.worker_id), rec.to_json(),
                 px=max(1, int(self.ttl_s * 1000)))
        pipe.sadd(self.set_key(rec.role), rec.worker_id)
        await pipe.execute()

    async def deregister(self, role: str, worker_id: str) -> None:
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(self.record_key(role, worker_id))
        pipe.srem(self.set_key(role), worker_id)
        await pipe.execute()

    async def list(self, role: str) -> list[WorkerRecord]:
        """Live workers of a role, sorted by worker_id; dead ids are pruned from the set."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        ids = sorted(_text(i) for i in await self._redis.smembers(self.set_key(role)))
        if not ids:
            return []
        raws = await self._redis.mget([self.record_key(role, i) for i in ids])
        live, dead = [], []
        for worker_id, raw in zip(ids, raws):
            if raw is None:
                dead.append(worker_id)
                continue
            try:
                live.append(WorkerRecord.from_json(raw))
            except (ValueError, TypeError) as exc:  # a corrupt record must not break routing
                log.warning("ignoring malformed registry record %s: %s", worker_id, exc)
        if dead:
            await self._redis.srem(self.set_key(role), *dead)
        return live


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def heartbeat_loop(registry: WorkerRegistry, make_record: Callable[[], WorkerRecord],
                         interval_s: float, stop: asyncio.Event) -> None:
    """Re-register `make_record()` every interval_s until `stop` is set, then deregister.

    interval_s should be well below the registry's ttl_s (a third is typical) so one lost
    heartbeat does not drop the worker. Redis errors are logged and retried, never raised:
    a worker keeps serving while Redis is away and reappears when it comes back.
    """
    last: WorkerRecord | None = None
    # Bounded: redis-py retries a dead server with backoff, and a beat later than the TTL
    # is useless anyway; the next beat tries again.
    call_timeout = registry.ttl_s
    while not stop.is_set():
        try:
            last = make_record()
            await asyncio.wait_for(registry.register(last), timeout=call_timeout)
        except (RedisError, OSError, ValueError, asyncio.TimeoutError) as exc:
            log.warning("registry heartbeat failed (retrying in %.1fs): %r", interval_s, exc)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval_s)
    if last is not None:
        try:
            await asyncio.wait_for(registry.deregister(last.role, last.worker_id),
                                   timeout=min(call_timeout, 2.0))
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            log.warning("registry deregister failed (the record expires by TTL): %r", exc)
