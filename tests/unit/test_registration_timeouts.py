"""A Redis that accepts connections but never answers: draft discovery fails in bounded
time (the verifier then decodes without the registry's workers) instead of hanging."""
import asyncio
import socket
import time

import pytest
from redis.exceptions import RedisError

from tandem.registration import draft_discovery

pytestmark = pytest.mark.unit


def test_draft_discovery_gives_up_on_a_silent_redis():
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # connections complete in the kernel's backlog; nothing ever answers
    port = silent.getsockname()[1]
    try:
        discover = draft_discovery(f"redis://127.0.0.1:{port}/0", timeout_s=0.5)
        start = time.monotonic()
        with pytest.raises((RedisError, TimeoutError)):  # redis-py's timeout, or ours
            asyncio.run(asyncio.wait_for(discover(), 30))
        took = time.monotonic() - start
    finally:
        silent.close()
    assert took < 5, f"discovery hung for {took:.1f} s"
