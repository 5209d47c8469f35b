"""A request whose client went away stops its generation, streamed or not (issue 47): a
non-streamed tool call holds every event back until the end, so a check made as events
arrive never ran and the verifier generated to max_tokens for nobody."""
from __future__ import annotations

import json
import socket
import uuid

import pytest
from test_gateway import (
    MODEL,
    FakeVerifier,
    LoopThread,
    continue_text,
    make_app,
    uvicorn_server,
    wait_for,
)

pytestmark = pytest.mark.contract
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


@pytest.fixture()
def slow_verifier(tokenizer):
    """About 8 s to write max_tokens: one token a round, a round each 50 ms."""
    loop = LoopThread()
    ids = tokenizer.encode("Rivers: Nile, Amazon, Yangtze.", add_special_tokens=False)
    fake = FakeVerifier(continue_text(ids * 20, per_round=1, delay=0.05))
    loop.run(fake.start())
    yield fake
    loop.run(fake.server.stop(None))
    loop.close()


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "lookup"}},
                                    "required"])
def test_a_non_streamed_tool_call_is_cancelled_when_its_client_leaves(
        redis_proc, tokenizer, slow_verifier, choice):
    app = make_app(redis_proc, tokenizer, f"gone{uuid.uuid4().hex[:8]}",
                   static_verifiers=(slow_verifier.address,))
    body = {"model": MODEL, "max_tokens": 150, "tools": TOOLS, "tool_choice": choice,
            "messages": [{"role": "user", "content": "look it up"}]}
    with uvicorn_server(app) as base:
        client = _post(base, "/v1/chat/completions", body)
        assert wait_for(lambda: slow_verifier.requests, timeout=10)  # generating
        client.close()  # the client goes away mid-generation
        assert wait_for(lambda: slow_verifier.cancelled == 1, timeout=3), \
            "the disconnect did not cancel the verifier's work"


def _post(base: str, path: str, body: dict) -> socket.socket:
    """A request sent on a raw socket, its answer never read: closing it is a real
    client disconnect."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
                 f"\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock
