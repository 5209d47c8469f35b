"""REDIS_PASSWORD against a real `redis-server --requirepass` (tandem.redis_conn): with the
password the registry, session store and a draft worker's registration work; without it every
service refuses to start with one clear error that never shows the password."""
import asyncio
import os
import signal
import time
import uuid

import pytest
import torch

from draft_service.config import DraftConfig
from gateway.sessions import RedisSessionStore
from tandem import redis_conn
from tandem.redis_server import start_redis
from tandem.registration import Registration
from tandem.registry import WorkerRecord, WorkerRegistry

pytestmark = pytest.mark.contract
PASSWORD = "s3cret-" + uuid.uuid4().hex[:8]


@pytest.fixture(scope="module")
def locked_redis():
    with start_redis(password=PASSWORD) as proc:
        yield proc


def test_registry_and_sessions_work_with_the_password(locked_redis):
    async def go():
        await redis_conn.check_auth(locked_redis.url, PASSWORD)
        client = redis_conn.client(locked_redis.url, PASSWORD)
        reg = WorkerRegistry(client, prefix="auth")
        await reg.register(WorkerRecord("verifier", "v1", "[::1]:50051", 8, 0))
        assert [r.address for r in await reg.list("verifier")] == ["[::1]:50051"]
        store = RedisSessionStore(client, prefix="auth", clock=time.time)
        await store.create("s1", model="m", prompt_token_ids=[1, 2])
        await store.append("s1", [3])
        assert await store.committed("s1") == [3]
        await client.aclose()
        # a password in the URL itself works too, and wins over the variable's
        in_url = f"redis://:{PASSWORD}@127.0.0.1:{locked_redis.port}/0"
        await redis_conn.check_auth(in_url, "wrong")
        other = redis_conn.client(in_url, "wrong")
        assert len(await WorkerRegistry(other, prefix="auth").list("verifier")) == 1
        await other.aclose()
    asyncio.run(go())


def test_without_the_password_the_error_is_clear(locked_redis):
    with pytest.raises(ValueError) as err:
        asyncio.run(redis_conn.check_auth(locked_redis.url))
    assert "refused authentication" in str(err.value) and "REDIS_PASSWORD" in str(err.value)
    with pytest.raises(ValueError) as err:
        asyncio.run(redis_conn.check_auth(locked_redis.url, "not-it"))
    assert "password was refused" in str(err.value) and "not-it" not in str(err.value)
    in_url = f"redis://:bad-{PASSWORD}@127.0.0.1:{locked_redis.port}/0"
    with pytest.raises(ValueError) as err:
        asyncio.run(redis_conn.check_auth(in_url))
    assert PASSWORD not in str(err.value) and ":***@" in str(err.value)


def test_an_unreachable_redis_is_not_an_auth_error():
    """Redis down at start is ridden out (the services retry), not fatal."""
    from tools.launcher import free_port

    asyncio.run(redis_conn.check_auth(f"redis://127.0.0.1:{free_port()}/0", PASSWORD))


def _draft_config(target_paths) -> DraftConfig:
    return DraftConfig(host="127.0.0.1", port=0, model=None, tokenizer=str(target_paths.root),
                       drain_grace_s=0.0, threads=torch.get_num_threads())


def test_a_draft_worker_registers_with_the_password(locked_redis, target_paths):
    from draft_service.main import serve

    worker_id = f"draft-{uuid.uuid4().hex[:6]}"
    reg = Registration(locked_redis.url, "draft", "127.0.0.1:0", worker_id,
                       redis_password=PASSWORD)
    seen = []

    async def main():
        server = asyncio.create_task(serve(_draft_config(target_paths), registration=reg))
        registry = WorkerRegistry(redis_conn.client(locked_redis.url, PASSWORD))
        for _ in range(100):
            seen[:] = [r for r in await registry.list("draft") if r.worker_id == worker_id]
            if seen:
                break
            await asyncio.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(server, 10)
        assert not [r for r in await registry.list("draft") if r.worker_id == worker_id]
    asyncio.run(asyncio.wait_for(main(), 30))
    assert seen and seen[0].address.startswith("127.0.0.1:") and not seen[0].address.endswith(":0")


def test_a_draft_worker_without_the_password_refuses_to_start(locked_redis, target_paths):
    from draft_service.main import serve

    reg = Registration(locked_redis.url, "draft", "127.0.0.1:0")
    with pytest.raises(ValueError, match="REDIS_PASSWORD"):
        asyncio.run(asyncio.wait_for(serve(_draft_config(target_paths), registration=reg), 10))


def test_a_verifier_with_a_wrong_password_refuses_before_loading_the_model(locked_redis):
    from verify_service.config import VerifierConfig
    from verify_service.main import serve

    config = VerifierConfig(port=0, redis_url=locked_redis.url, redis_password="wrong",
                            model="/nonexistent")  # never reached: the check comes first
    with pytest.raises(ValueError, match="password was refused"):
        asyncio.run(asyncio.wait_for(serve(config), 10))
