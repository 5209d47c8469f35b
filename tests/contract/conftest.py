"""Fixtures the contract tests share: a real redis-server per module, a loop thread for fake
servers, and a fresh Redis key prefix per test."""
import uuid

import pytest
from loopthread import LoopThread

from tandem.redis_server import start_redis


@pytest.fixture(scope="module")
def redis_proc():
    """A real redis-server on loopback, started for the module and stopped after it."""
    with start_redis() as proc:
        yield proc


@pytest.fixture(scope="session")
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture()
def prefix() -> str:
    """A fresh Redis namespace per test: no cross-test state, no FLUSHALL needed."""
    return f"t{uuid.uuid4().hex[:8]}"
