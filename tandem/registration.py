"""A worker's presence in the Redis registry: heartbeats with a TTL until it drains."""
from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Registration:
    redis_url: str
    role: str  # "draft" | "verifier"
    address: str  # what gateways and verifiers dial
    worker_id: str = ""
    interval_s: float = 1.0

    def __post_init__(self):
        if self.role not in ("draft", "verifier"):
            raise ValueError(f"role must be 'draft' or 'verifier', got {self.role!r}")
        if not self.redis_url or not self.address:
            raise ValueError("registration needs a redis_url and an address")


def start_registration(reg: Registration, capacity: int, load: Callable[[], int],
                       **record_fields) -> tuple[asyncio.Task, asyncio.Event]:
    """Heartbeat task and the event that stops it (then it deregisters)."""
    import redis.asyncio as aioredis

    from tandem.registry import WorkerRecord, WorkerRegistry, heartbeat_loop

    registry = WorkerRegistry(aioredis.from_url(reg.redis_url))
    worker_id = reg.worker_id or f"{reg.role}-{socket.gethostname()}-{uuid.uuid4().hex[:6]}"

    def record() -> WorkerRecord:
        return WorkerRecord(role=reg.role, worker_id=worker_id, address=reg.address,
                            capacity=capacity, load=load(), **record_fields)

    stop = asyncio.Event()
    return asyncio.create_task(heartbeat_loop(registry, record, reg.interval_s, stop)), stop


def draft_discovery(redis_url: str):
    """An async callable listing live draft workers' addresses (for the verifier)."""
    import redis.asyncio as aioredis

    from tandem.registry import WorkerRegistry

    registry = WorkerRegistry(aioredis.from_url(redis_url))

    async def discover() -> list[str]:
        return [r.address for r in await registry.list("draft")]

    return discover
