"""kill -9 of a tensor-parallel verifier's rank 1 mid-stream, through the gateway (issue 31):
the client sees no error, only the failover the gateway already does (the session resumes on
the other verifier from the committed tokens), and no token is lost or repeated.

Two verifiers behind one gateway (static addresses): the default target split over TP=3 (its
3 KV heads) and a plain TP=1 one. The TP verifier binds 127.0.0.1 and the plain one 127.0.0.2,
so the gateway's tie-break (equal load: the lowest address) sends new sessions to the TP one.
A failed verifier does what `serve` does when its `failed` event is set: stop at once."""
import asyncio
import json
import logging
import os
import re
import signal
import threading
from contextlib import contextmanager

import pytest

from verify_service.config import VerifierConfig

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Name three rivers and the seas they flow into."}]
MAX_TOKENS = 40
KILL_AFTER = 6  # content chunks received before rank 1 dies


@contextmanager
def two_verifiers_behind_a_gateway(target_model, tokenizer):
    import redis.asyncio as aioredis
    from fastapi.testclient import TestClient

    from gateway.app import create_app
    from gateway.config import GatewayConfig
    from tandem.redis_server import start_redis
    from verify_service.main import start_verifier

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(180)

    def config(host, **tp):
        return VerifierConfig(host=host, port=0, kv_cache_mb=32, calibrate_reps=0, threads=1,
                              layer_skip="off", tensor_parallel_timeout_s=10, **tp)

    async def start():
        tp = await start_verifier(config("127.0.0.1", tensor_parallel_size=3))
        plain = await start_verifier(config("127.0.0.2"), model=target_model)

        async def stop_when_failed():  # as `serve`: a failed verifier stops at once
            await tp.failed.wait()
            await tp.drain_and_stop(0.0)
        watcher = asyncio.ensure_future(stop_when_failed())
        return tp, plain, watcher

    tp, plain, watcher = run(start())
    try:
        with start_redis() as redis_proc:
            gw = GatewayConfig(redis_url=redis_proc.url, model_name=MODEL,
                               static_verifiers=(f"127.0.0.1:{tp.port}",
                                                 f"127.0.0.2:{plain.port}"))
            app = create_app(gw, redis=aioredis.Redis.from_url(redis_proc.url),
                             tokenizer=tokenizer)
            with TestClient(app) as client:
                yield client, tp
    finally:
        if tp.failed.is_set():  # its stop leaves the process group: the next TP test joins one
            run(asyncio.wait_for(watcher, 120))
        else:
            watcher.cancel()
            run(tp.drain_and_stop(0))
        run(plain.drain_and_stop(0))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def _stream(client, on_chunk=lambda n: None) -> tuple[str, list[dict]]:
    """The streamed text and every event; `on_chunk(n)` after the n-th content chunk."""
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "messages": ASK,
            "stream": True, "speculation": {"method": "none"}}
    text, events, chunks = "", [], 0
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            events.append(event)
            for choice in event.get("choices", []):
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece:
                    text += piece
                    chunks += 1
                    on_chunk(chunks)
    return text, events


def test_kill_9_of_rank_1_mid_stream_fails_over_without_a_lost_token(target_model, tokenizer,
                                                                      caplog):
    caplog.set_level(logging.WARNING, logger="gateway.generation")
    with two_verifiers_behind_a_gateway(target_model, tokenizer) as (client, tp):
        undisturbed, _ = _stream(client)
        assert not tp.failed.is_set()
        rank1 = tp.tp.procs[0]
        assert rank1.is_alive()

        def kill(n):
            if n == KILL_AFTER:
                os.kill(rank1.pid, signal.SIGKILL)
        text, events = _stream(client, kill)
        assert not rank1.is_alive()
        assert tp.failed.is_set(), "the TP verifier did not notice its dead rank"
        address = f"127.0.0.1:{tp.port}"
    # the stream ran on the TP verifier and resumed elsewhere after some committed tokens
    resumed = [re.search(r"(\d+) tokens committed, resuming", r.getMessage())
               for r in caplog.records if f"verifier {address} failed" in r.getMessage()]
    assert len(resumed) == 1 and resumed[0] and int(resumed[0].group(1)) >= KILL_AFTER, \
        [r.getMessage() for r in caplog.records]
    assert not [e for e in events if "error" in e], events
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert text == undisturbed
    assert len(tokenizer(undisturbed)["input_ids"]) >= KILL_AFTER * 2
