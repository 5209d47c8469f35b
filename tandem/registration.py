"""A worker's presence in the Redis registry: heartbeats with a TTL until it drains."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

Beat = tuple[asyncio.Task, asyncio.Event]
MEMORY_EVERY_S = 15.0  # how often a worker reads Redis's INFO memory (tandem.redis_memory)
# Per Redis call: a Redis that accepts connections but never answers must not hang the
# heartbeats or a session's draft discovery (redis-py waits forever by default).
REDIS_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Registration:
    redis_url: str
    role: str  # "draft" | "verifier"
    address: str  # what gateways and verifiers dial
    worker_id: str = ""
    interval_s: float = 1.0
    # Used when redis_url carries none (tandem.redis_conn); kept out of repr and logs.
    redis_password: str = field(default="", repr=False)

    def __post_init__(self):
        if self.role not in ("draft", "verifier"):
            raise ValueError(f"role must be 'draft' or 'verifier', got {self.role!r}")
        if not self.redis_url or not self.address:
            raise ValueError("registration needs a redis_url and an address")


def start_registration(reg: Registration, capacity: int, load: Callable[[], int],
                       **record_fields) -> Beat:
    """Heartbeat task and the event that stops it (then it deregisters)."""
    from tandem import redis_conn
    from tandem.registry import WorkerRecord, WorkerRegistry

    client = redis_conn.client(reg.redis_url, reg.redis_password,
                               socket_connect_timeout=REDIS_TIMEOUT_S,
                               socket_timeout=REDIS_TIMEOUT_S)
    registry = WorkerRegistry(client)
    worker_id = reg.worker_id or f"{reg.role}-{socket.gethostname()}-{uuid.uuid4().hex[:6]}"

    def record() -> WorkerRecord:
        return WorkerRecord(role=reg.role, worker_id=worker_id, address=reg.address,
                            capacity=capacity, load=load(), **record_fields)

    stop = asyncio.Event()
    return asyncio.create_task(_beat(registry, record, reg.interval_s, stop, client)), stop


async def _beat(registry, record, interval_s: float, stop: asyncio.Event, client) -> None:
    """Heartbeats, and a look at Redis's memory now and then: a Redis that fills up is what
    makes heartbeats fail, so the worker's log says so before it happens."""
    from tandem.redis_memory import MemoryWatch
    from tandem.registry import heartbeat_loop

    watch = asyncio.create_task(MemoryWatch(read_every_s=MEMORY_EVERY_S).run(client, stop))
    try:
        await heartbeat_loop(registry, record, interval_s, stop)
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch


async def stop_registration(beat: Beat | None, timeout_s: float = 5.0) -> None:
    """Leave the registry now (deregister) and wait for it; safe to call again."""
    if beat is None:
        return
    task, stop = beat
    stop.set()
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.shield(task), timeout_s)


def draft_discovery(redis_url: str, password: str = "", timeout_s: float = REDIS_TIMEOUT_S):
    """An async callable listing live draft workers' addresses (for the verifier); it
    raises within about `timeout_s` when Redis does not answer."""
    from tandem import redis_conn
    from tandem.registry import WorkerRegistry

    registry = WorkerRegistry(redis_conn.client(
        redis_url, password, socket_connect_timeout=timeout_s, socket_timeout=timeout_s))

    async def discover() -> list[str]:  # the whole listing bounded, however many calls
        records = await asyncio.wait_for(registry.list("draft"), 2 * timeout_s)
        return [r.address for r in records]

    return discover
