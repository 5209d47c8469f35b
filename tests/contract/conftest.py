"""Fixtures the contract tests share: a real redis-server per module."""
import pytest

from tandem.redis_server import start_redis


@pytest.fixture(scope="module")
def redis_proc():
    """A real redis-server on loopback, started for the module and stopped after it."""
    with start_redis() as proc:
        yield proc
