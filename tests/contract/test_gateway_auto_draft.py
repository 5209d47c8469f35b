"""auto's draft worker (SpeculationConfig.auto_draft_method): the gateway links an auto session
to a draft worker only where one serves a model method, the first of method_preference, and
says which; without one the request is exactly today's (no draft address, no method).

A fake verifier (tests/contract/test_gateway.py's) records the GenerateRequests; a real Redis
holds the registered draft workers.
"""
from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis
from fastapi.testclient import TestClient
from test_gateway import MODEL, FakeVerifier, LoopThread, continue_text, make_app

from gateway.plan import auto_draft_method
from gateway.routing import Router
from tandem.registry import WorkerRecord, WorkerRegistry
from tandem.v1 import common_pb2

pytestmark = pytest.mark.contract

AUTO = common_pb2.SPECULATION_METHOD_AUTO


@pytest.fixture(scope="module")
def verifier(tokenizer):
    loop = LoopThread()
    fake = FakeVerifier(continue_text(tokenizer.encode("Hi there", add_special_tokens=False)))
    loop.run(fake.start())
    yield fake
    loop.run(fake.server.stop(None))
    loop.close()


def draft(address: str, *methods: str) -> WorkerRecord:
    return WorkerRecord("draft", address, address, 8, 0, methods=methods)


def ask(redis_proc, tokenizer, verifier, drafts, method=None, **config):
    """One chat request with these draft workers registered; the verifier's request."""
    prefix = f"auto{uuid.uuid4().hex[:8]}"

    async def register():
        r = aioredis.Redis.from_url(redis_proc.url)
        reg = WorkerRegistry(r, ttl_s=30, prefix=prefix)
        for rec in drafts:
            await reg.register(rec)
        await r.aclose()

    asyncio.run(register())
    app = make_app(redis_proc, tokenizer, prefix, static_verifiers=(verifier.address,),
                   **config)
    spec = {"speculation": {"method": method}} if method else {}
    with TestClient(app) as client:
        resp = client.post("/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "Hi"}], **spec})
    assert resp.status_code == 200, resp.text
    return verifier.requests[-1].speculation


def test_auto_is_linked_to_a_draft_model_worker_and_says_so(redis_proc, tokenizer, verifier):
    spec = ask(redis_proc, tokenizer, verifier,
               [draft("10.0.0.1:1", "ngram", "suffix"), draft("10.0.0.2:2", "draft_model")])
    assert spec.method == AUTO and spec.draft_address == "10.0.0.2:2"
    assert spec.auto_draft_method == common_pb2.SPECULATION_METHOD_DRAFT_MODEL
    spec = ask(redis_proc, tokenizer, verifier, [draft("10.0.0.3:3", "draft_model")],
               method="auto")  # asked for by name: the same
    assert spec.draft_address == "10.0.0.3:3" and spec.auto_draft_method


def test_the_preference_order_picks_the_model_method(redis_proc, tokenizer, verifier):
    drafts = [draft("10.0.0.1:1", "draft_model"), draft("10.0.0.2:2", "eagle")]
    spec = ask(redis_proc, tokenizer, verifier, drafts,
               method_preference=("auto", "eagle", "draft_model"))
    assert spec.method == AUTO and spec.draft_address == "10.0.0.2:2"
    assert spec.auto_draft_method == common_pb2.SPECULATION_METHOD_EAGLE
    spec = ask(redis_proc, tokenizer, verifier, drafts, method_preference=("auto",))
    assert spec.draft_address == "" and not spec.auto_draft_method  # no model method listed


def test_without_a_model_drafting_worker_auto_is_todays(redis_proc, tokenizer, verifier):
    for drafts in ([], [draft("10.0.0.1:1", "ngram", "suffix")]):
        spec = ask(redis_proc, tokenizer, verifier, drafts)
        assert spec.method == AUTO and spec.draft_address == ""
        assert spec.auto_draft_method == common_pb2.SPECULATION_METHOD_UNSPECIFIED
    spec = ask(redis_proc, tokenizer, verifier, [draft("10.0.0.2:2", "draft_model")],
               method="draft_model")  # other methods never carry it
    assert spec.draft_address == "10.0.0.2:2" and not spec.auto_draft_method


def test_a_worker_that_does_not_advertise_serves_draft_model():
    class Source:
        async def list(self, role):
            return []

    async def go():
        router = Router(Source(), None, static_drafts=("10.0.0.9:9",))
        return await auto_draft_method(router, ("auto", "eagle", "draft_model"))

    assert asyncio.run(go()) == common_pb2.SPECULATION_METHOD_DRAFT_MODEL


def test_auto_model_drafts_off_links_no_worker(redis_proc, tokenizer, verifier):
    """`--auto-model-drafts off` (tandem up's one-host cluster): auto as before the fallback."""
    spec = ask(redis_proc, tokenizer, verifier, [draft("10.0.0.2:2", "draft_model")],
               auto_model_drafts=False)
    assert spec.method == AUTO and spec.draft_address == "" and not spec.auto_draft_method
