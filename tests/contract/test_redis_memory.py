"""Redis says when it is filling (issue 47), against a real redis-server with a small
maxmemory and `noeviction` like the deployed one: the gateway's gauge and /health (degraded,
still 200), a warning in the log of the gateway and of every worker (tandem.redis_memory)."""
import asyncio
import logging

import pytest
import redis
import redis.asyncio as aioredis
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.config import GatewayConfig
from tandem import redis_memory
from tandem.redis_server import start_redis
from tandem.registration import Registration, start_registration, stop_registration

pytestmark = pytest.mark.contract
MAXMEMORY = 4 << 20


@pytest.fixture
def small_redis():
    with start_redis(password="pw") as proc:
        client = redis.Redis(port=proc.port, password="pw")
        client.config_set("maxmemory", MAXMEMORY)
        client.config_set("maxmemory-policy", "noeviction")
        yield proc, client
        client.close()


def fill(client: redis.Redis, up_to: float, chunk: int) -> float:
    """Write `chunk`-byte values until used_memory / maxmemory >= up_to (or Redis refuses:
    OOM); the ratio reached."""
    i = 0
    while (ratio := client.info("memory")["used_memory"] / MAXMEMORY) < up_to:
        try:
            client.set(f"fill:{chunk}:{i}", b"x" * chunk)
        except redis.exceptions.OutOfMemoryError:
            return ratio
        i += 1
    return ratio


def health(client: TestClient) -> dict:
    resp = client.get("/health")
    assert resp.status_code == 200, resp.text
    return resp.json()


def gauge(client: TestClient) -> float:
    line = [x for x in client.get("/metrics").text.splitlines()
            if x.startswith("tandem_redis_memory_usage_ratio ")]
    return float(line[0].split()[1])


def test_gateway_health_and_gauge_say_redis_is_filling_then_full(small_redis, tokenizer,
                                                                   caplog):
    proc, client = small_redis
    config = GatewayConfig(redis_url=proc.url, model_name="m", redis_prefix="mem")
    app = create_app(config, redis=aioredis.Redis.from_url(proc.url, password="pw"),
                     tokenizer=tokenizer)
    with TestClient(app) as http:
        body = health(http)
        assert body["status"] == "ok" and body["redis"] == "ok"
        assert body["redis_memory"]["max_bytes"] == MAXMEMORY
        redis_memory.watch_of(app.state.gateway.redis).read_every_s = 0.0  # no caching here
        ratio = fill(client, 0.85, 64 << 10)
        assert 0.85 <= ratio < redis_memory.FULL_RATIO
        with caplog.at_level(logging.WARNING, logger="tandem.redis_memory"):
            body = health(http)
        assert body["status"] == "degraded" and body["redis"] == "filling"
        assert body["redis_memory"]["usage_ratio"] >= 0.85
        assert gauge(http) >= 0.85
        assert [r for r in caplog.records if "Redis memory is filling" in r.getMessage()]
        fill(client, 1.0, 1 << 10)  # until Redis refuses a write
        body = health(http)
        assert body["status"] == "degraded" and body["redis"] == "full"
        assert gauge(http) >= redis_memory.FULL_RATIO
        client.flushdb()
        assert health(http)["status"] == "ok" and gauge(http) < 0.8


def test_a_warning_is_logged_again_only_after_a_while(small_redis, caplog):
    _, client = small_redis
    fill(client, 0.85, 64 << 10)
    now = [0.0]
    watch = redis_memory.MemoryWatch(read_every_s=0.0, warn_every_s=60.0, clock=lambda: now[0])

    async def reads() -> None:
        aclient = aioredis.Redis(port=small_redis[0].port, password="pw")
        for t in (0.0, 10.0, 59.0, 60.0):  # warned at once, then again a minute later
            now[0] = t
            await watch.read(lambda: redis_memory.read_memory(aclient))
        await aclient.aclose()

    with caplog.at_level(logging.WARNING, logger="tandem.redis_memory"):
        asyncio.run(reads())
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2


def test_a_workers_heartbeat_warns_when_redis_is_filling(small_redis, caplog):
    proc, client = small_redis
    fill(client, 0.85, 64 << 10)

    async def beat_once() -> None:
        beat = start_registration(Registration(proc.url, "draft", "127.0.0.1:1",
                                               redis_password="pw"), capacity=1,
                                  load=lambda: 0)
        await asyncio.sleep(0.5)
        await stop_registration(beat)

    with caplog.at_level(logging.WARNING, logger="tandem.redis_memory"):
        asyncio.run(beat_once())
    assert [r for r in caplog.records if "Redis memory is filling" in r.getMessage()]
