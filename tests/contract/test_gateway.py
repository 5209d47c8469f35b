"""The gateway against fake VerifyService servers (grpc.aio on loopback) and a real Redis.

Fake verifiers run on their own event loop in a background thread and stream scripted
GenerateResponses; the gateway runs in FastAPI's TestClient (or a real uvicorn server for the
official `openai` client). Token ids come from the real target tokenizer, so detokenization,
multi-byte characters and stop strings are exercised for real.
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import hashlib
import json
import socket
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

import grpc
import pytest
import redis
import redis.asyncio as aioredis
from fastapi.testclient import TestClient
from loopthread import LoopThread  # noqa: F401 (the other gateway tests import it here)

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.routing import Router, affinity_key, pick_draft, pick_verifier
from gateway.sessions import RedisSessionStore
from gateway.text import TextStream
from tandem.errors import SessionFailed
from tandem.grpc_status import StatusInterceptor
from tandem.redis_server import start_redis
from tandem.registry import WorkerRecord, WorkerRegistry, heartbeat_loop
from tandem.v1 import common_pb2, verify_pb2, verify_pb2_grpc

pytestmark = pytest.mark.contract

MODEL = "SmolLM2-135M-Instruct"
TEXT = "Hello world! Speculative decoding is fun: café 日本 🎉 done."
EOS = 2
STOP = verify_pb2.FINISH_REASON_STOP


# ---- fixtures: loop thread, Redis, tokenizer-derived tokens --------------------------------


@pytest.fixture(scope="session")
def redis_proc():
    with start_redis() as proc:
        yield proc


@pytest.fixture(scope="session")
def text_ids(tokenizer) -> list[int]:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert tokenizer.decode(ids) == TEXT
    return ids


# ---- fake verifier -----------------------------------------------------------------------


def responses(rounds: list[list[int]], *, base: int = 0, finish=STOP, drafted: int = 4):
    """One GenerateResponse per round; each round accepted all but its last token."""
    out, total, totals = [], base, verify_pb2.SessionStats()
    for i, ids in enumerate(rounds):
        total += len(ids)
        accepted = max(0, len(ids) - 1)
        totals = verify_pb2.SessionStats(rounds=totals.rounds + 1,
                                         drafted_tokens=totals.drafted_tokens + drafted,
                                         accepted_tokens=totals.accepted_tokens + accepted)
        out.append(verify_pb2.GenerateResponse(
            token_ids=ids, num_committed=total, totals=totals,
            round=verify_pb2.RoundStats(drafted=drafted, accepted=accepted),
            finish_reason=finish if i == len(rounds) - 1 else 0))
    return out


def chunked(ids: list[int], size: int) -> list[list[int]]:
    return [ids[i:i + size] for i in range(0, len(ids), size)]


class FakeVerifier(verify_pb2_grpc.VerifyServiceServicer):
    """Streams what `script(fake, request, context)` yields; records requests/cancels."""

    def __init__(self, script, *, max_spec_tokens: int = 8, max_sessions: int = 8):
        self.script = script
        self.requests: list[verify_pb2.GenerateRequest] = []
        self.cancelled = 0
        self.info = common_pb2.WorkerInfo(
            role=common_pb2.WORKER_ROLE_VERIFIER, model_id=MODEL, max_sessions=max_sessions,
            max_spec_tokens=max_spec_tokens, max_context_length=8192)
        self.server: grpc.aio.Server | None = None
        self.stopping: asyncio.Task | None = None
        self.address = ""

    async def Generate(self, request, context):
        self.requests.append(request)
        try:
            async for resp in self.script(self, request, context):
                yield resp
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def Info(self, request, context):
        return self.info

    async def start(self) -> None:
        self.server = grpc.aio.server()
        verify_pb2_grpc.add_VerifyServiceServicer_to_server(self, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.address = f"127.0.0.1:{port}"


@pytest.fixture()
def fakes(loop_thread):
    """Factory for started fake verifiers; all are stopped after the test."""
    started: list[FakeVerifier] = []

    def make(script, cls=None, **kw) -> FakeVerifier:
        fake = (cls or FakeVerifier)(script, **kw)
        loop_thread.run(fake.start())
        started.append(fake)
        return fake

    yield make
    for fake in started:
        if fake.stopping is None:
            loop_thread.run(fake.server.stop(None))
        else:
            loop_thread.run(asyncio.wait_for(asyncio.shield(fake.stopping), 5))


def continue_text(full: list[int], *, per_round: int = 3, die_after: int | None = None,
                  how: str = "abort", delay: float = 0.0):
    """Generate `full` + EOS after whatever the request says is committed. With die_after,
    stream that many rounds and then die: `abort` (UNAVAILABLE), `stop` (server stopped
    under the call), `finish_abort` (FINISH_REASON_ABORT) or `hang` (never answer again)."""
    async def script(fake, request, context):
        done = list(request.committed_token_ids)
        assert done == full[:len(done)], "resumed with the wrong committed tokens"
        rounds = chunked(full[len(done):] + [EOS], per_round)
        for i, resp in enumerate(responses(rounds, base=len(done))):
            if die_after is not None and i == die_after:
                await _die(fake, context, how, resp)
                return
            if delay:
                await asyncio.sleep(delay)
            yield resp
    return script


async def _die(fake, context, how, resp):
    if how == "abort":
        await context.abort(grpc.StatusCode.UNAVAILABLE, "verifier going away")
    elif how == "stop":
        await asyncio.sleep(0.2)  # let the rounds already yielded reach the gateway
        # a task of its own: stopping cancels this handler, which must not cancel the stop
        fake.stopping = asyncio.get_running_loop().create_task(fake.server.stop(None))
        await asyncio.sleep(5)
    elif how == "hang":
        await asyncio.sleep(30)
    elif how == "finish_abort":
        t, r = resp.totals, resp.round  # totals before the round that never happened
        before = verify_pb2.SessionStats(rounds=t.rounds - 1,
                                         drafted_tokens=t.drafted_tokens - r.drafted,
                                         accepted_tokens=t.accepted_tokens - r.accepted)
        await context.write(verify_pb2.GenerateResponse(
            token_ids=[], num_committed=resp.num_committed - len(resp.token_ids),
            totals=before, finish_reason=verify_pb2.FINISH_REASON_ABORT))


def fail_with(code: grpc.StatusCode, details: str):
    async def script(fake, request, context):
        await context.abort(code, details)
        yield  # pragma: no cover - makes this an async generator
    return script


# ---- gateway helpers ---------------------------------------------------------------------


def make_app(redis_proc, tokenizer, prefix: str, *, clock: Callable[[], float] = time.time,
             **overrides):
    config = GatewayConfig(redis_url=redis_proc.url, redis_prefix=prefix, model_name=MODEL,
                           **overrides)
    return create_app(config, redis=aioredis.Redis.from_url(redis_proc.url),
                      tokenizer=tokenizer, clock=clock)


@contextmanager
def gateway(redis_proc, tokenizer, prefix: str, **overrides):
    with TestClient(make_app(redis_proc, tokenizer, prefix, **overrides)) as client:
        yield client


def register(redis_proc, prefix: str, *records: WorkerRecord, ttl_s: float = 30.0) -> None:
    async def go():
        r = aioredis.Redis.from_url(redis_proc.url)
        reg = WorkerRegistry(r, ttl_s=ttl_s, prefix=prefix)
        for rec in records:
            await reg.register(rec)
        await r.aclose()
    asyncio.run(go())


def verifier_rec(address: str, load: int = 0, capacity: int = 8, **kw) -> WorkerRecord:
    return WorkerRecord("verifier", address, address, capacity, load, **kw)


def sse_events(body: str) -> list:
    """Parse an SSE body strictly: only `data: ...` events separated by blank lines."""
    assert body.endswith("\n\n")
    events = []
    for block in body.strip("\n").split("\n\n"):
        assert block.startswith("data: ") and "\n" not in block, block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


def expected_stats(rounds: int, drafted: int, accepted: int, committed: int,
                   method: str = "auto") -> dict:
    return {"method": method, "rounds": rounds, "drafted_tokens": drafted,
            "accepted_tokens": accepted, "lossy": False,
            "acceptance_rate": pytest.approx(accepted / drafted if drafted else 0.0),
            "mean_accepted_length": pytest.approx(committed / rounds if rounds else 0.0)}


def stream_text(events: list, chat: bool) -> str:
    parts = []
    for ev in events:
        for choice in ev["choices"]:
            parts.append((choice["delta"].get("content") or "") if chat else choice["text"])
    return "".join(parts)


def round_stats(full: list[int], per_round: int = 3, drafted: int = 4, base: int = 0):
    """(rounds, drafted, accepted) the continue_text script reports for `full` + EOS."""
    rounds = chunked(full[base:] + [EOS], per_round)
    return len(rounds), drafted * len(rounds), sum(len(r) - 1 for r in rounds)


def wait_for(predicate, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


# ---- completions and chat, streaming and not ---------------------------------------------


def test_completion_returns_text_usage_and_speculation_stats(redis_proc, tokenizer, prefix,
                                                              fakes, text_ids):
    fake = fakes(continue_text(text_ids))
    with gateway(redis_proc, tokenizer, prefix, static_verifiers=(fake.address,)) as client:
        resp = client.post("/v1/completions", json={
            "model": MODEL, "prompt": "Say hi", "max_tokens": 100, "temperature": 0,
            "top_k": 5, "top_p": 0.9, "seed": 7})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["choices"][0]["text"] == TEXT  # the EOS token is not shown
    assert body["choices"][0]["finish_reason"] == "stop"
    prompt_ids = tokenizer("Say hi").input_ids
    assert body["usage"] == {"prompt_tokens": len(prompt_ids),
                             "completion_tokens": len(text_ids) + 1,
                             "total_tokens": len(prompt_ids) + len(text_ids) + 1}
    rounds, drafted, accepted = round_stats(text_ids)
    assert body["speculation"] == expected_stats(rounds, drafted, accepted, len(text_ids) + 1)
    (req,) = fake.requests
    assert req.session_id == body["id"] and list(req.prompt_token_ids) == prompt_ids
    assert not req.committed_token_ids
    assert req.sampling.temperature == 0 and req.sampling.top_k == 5 and req.sampling.seed == 7
    assert req.sampling.top_p == pytest.approx(0.9)
    assert req.stopping.max_new_tokens == 100 and list(req.stopping.stop_token_ids) == [EOS]
    # The default: auto, drafted in the verifier's own step (no draft worker needed or given)
    assert req.speculation.method == common_pb2.SPECULATION_METHOD_AUTO
    assert req.speculation.draft_address == ""


class _ThreadNoting:
    """The real tokenizer, noting the thread each prompt is tokenized on."""

    def __init__(self, tokenizer):
        self._tok, self.threads = tokenizer, []

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __len__(self):
        return len(self._tok)

    def __call__(self, *args, **kw):
        self.threads.append(threading.current_thread().name)
        return self._tok(*args, **kw)

    def apply_chat_template(self, *args, **kw):
        self.threads.append(threading.current_thread().name)
        return self._tok.apply_chat_template(*args, **kw)


def test_prompts_are_tokenized_off_the_event_loop(redis_proc, tokenizer, prefix, fakes,
                                                   text_ids):
    noting = _ThreadNoting(tokenizer)
    fake = fakes(continue_text(text_ids))
    with gateway(redis_proc, noting, prefix, static_verifiers=(fake.address,)) as client:
        for path, body in (("/v1/completions", {"prompt": "Say hi"}),
                           ("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "Say hi"}]})):
            resp = client.post(path, json={"model": MODEL, "max_tokens": 8, **body})
            assert resp.status_code == 200, resp.text
    assert noting.threads and all(t.startswith("tandem-tokenize") for t in noting.threads)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", lambda text: {"prompt": text}),
    ("/v1/chat/completions", lambda text: {"messages": [{"role": "user", "content": "hi"},
                                                        {"role": "user", "content": text}]})])
def test_a_prompt_too_long_to_fit_is_refused_before_it_is_tokenized(
        redis_proc, tokenizer, prefix, fakes, text_ids, path, body):
    """Text longer than the context could hold at the longest token per token (a 3 MiB
    body: seconds on the tokenizing thread every tenant shares) is a 400 at once."""
    noting = _ThreadNoting(tokenizer)
    fake = fakes(continue_text(text_ids))
    longest = max(map(len, tokenizer.get_vocab()))
    with gateway(redis_proc, noting, prefix, static_verifiers=(fake.address,),
                 context_length=64) as client:
        resp = client.post(path, json={"model": MODEL, "max_tokens": 8,
                                       **body("x" * (64 * longest + 1))})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["code"] == "context_length_exceeded"
        assert noting.threads == [] and fake.requests == []
        resp = client.post(path, json={"model": MODEL, "max_tokens": 8, **body("x " * 70)})
        assert resp.status_code == 400  # few enough characters, but still too many tokens
        assert noting.threads  # ... which only tokenizing tells


def test_chat_uses_the_template_and_passes_the_draft_worker(redis_proc, tokenizer, prefix,
                                                            fakes, text_ids):
    fake = fakes(continue_text(text_ids))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    with gateway(redis_proc, tokenizer, prefix, static_verifiers=(fake.address,),
                 static_drafts=("127.0.0.1:9",),
                 method_preference=("ngram", "draft_model", "eagle")) as client:
        resp = client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": messages, "max_completion_tokens": 64,
            "stop_token_ids": [7], "speculation": {"num_speculative_tokens": 5}})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": TEXT}
    expected_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                    tokenize=True, return_dict=False)
    (req,) = fake.requests
    assert list(req.prompt_token_ids) == list(expected_prompt)
    assert body["usage"]["prompt_tokens"] == len(expected_prompt)
    # The default: the first of the preference (ngram first here) that the draft serves.
    assert req.speculation.method == common_pb2.SPECULATION_METHOD_NGRAM
    assert req.speculation.draft_address == "127.0.0.1:9"
    assert req.speculation.num_speculative_tokens == 5
    assert list(req.stopping.stop_token_ids) == [EOS, 7]
    assert req.stopping.max_new_tokens == 64
    assert req.sampling.temperature == pytest.approx(1.0)  # OpenAI's default
    assert body["speculation"]["method"] == "ngram"
    record = asyncio.run(_session(redis_proc, prefix, body["id"]))
    assert (record.status, record.finish_reason, record.model) == ("finished", "stop", MODEL)
    assert record.prompt_tokens == len(expected_prompt)  # a count: nothing reads the ids
    assert list(record.committed_token_ids) == text_ids + [EOS]
    assert (record.verifier, record.draft, record.attempts) == (fake.address, "127.0.0.1:9", 1)
    assert 0 < record.created_at <= record.updated_at
    sync = redis.Redis.from_url(redis_proc.url)
    # finished: kept for a short look, not the running session's hour
    assert 0 < sync.ttl(f"{prefix}:session:{body['id']}") <= 300
    assert 0 < sync.ttl(f"{prefix}:session:{body['id']}:committed") <= 300
    assert b"prompt_token_ids" not in sync.hgetall(f"{prefix}:session:{body['id']}")
    assert 0 < sync.ttl(f"{prefix}:session:{body['id']}:committed") <= 3600
    sync.close()


def test_completion_stream_sse_format_with_stats_on_the_final_chunk(redis_proc, tokenizer,
                                                                     prefix, fakes, text_ids):
    fake = fakes(continue_text(text_ids, per_round=2))
    with gateway(redis_proc, tokenizer, prefix, static_verifiers=(fake.address,)) as client:
        resp = client.post("/v1/completions", json={
            "model": MODEL, "prompt": "Say hi", "max_tokens": 50, "stream": True,
            "speculation": {"method": "ngram", "num_speculative_tokens": 3}})
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.text)
    assert len(events) > 3  # really incremental, not one blob
    assert all(e["object"] == "text_completion" and e["id"] == events[0]["id"] for e in events)
    assert stream_text(events, chat=False) == TEXT
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
    last = events[-1]
    assert last["choices"][0]["finish_reason"] == "stop"
    assert last["usage"]["completion_tokens"] == len(text_ids) + 1
    rounds, drafted, accepted = round_stats(text_ids, per_round=2)
    assert last["speculation"] == expected_stats(rounds, drafted, accepted, len(text_ids) + 1,
                                                 method="ngram")
    assert fake.requests[0].speculation.method == common_pb2.SPECULATION_METHOD_NGRAM


def test_chat_stream_with_include_usage(redis_proc, tokenizer, prefix, fakes, text_ids):
    fake = fakes(continue_text(text_ids))
    with gateway(redis_proc, tokenizer, prefix, static_verifiers=(fake.address,)) as client:
        resp = client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True,
            "stream_options": {"include_usage": True}})
    events = sse_events(resp.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    usage_chunk = events[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == len(text_ids) + 1
    assert usage_chunk["speculation"]["rounds"] == round_stats(text_ids)[0]
    finish = events[-2]
    assert finish["choices"][0]["finish_reason"] == "stop" and "usage" not in finish
    assert stream_text(events[:-1], chat=True) == TEXT


# ---- stop strings and detokenization -------------------------------------------------------


@pytest.mark.parametrize(("stop", "expected"), [
    ("fun", "Hello world! Speculative decoding is "),
    (["nothing", "日本"], "Hello world! Speculative decoding is fun: café "),
    ("🎉", "Hello world! Speculative decoding is fun: café 日本 ")])
@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_the_text_and_cancel_the_verifier(redis_proc, tokenizer, prefix, fakes,
                                                           text_ids, stop, expected, stream):
    fake = fakes(continue_text(text_ids + text_ids, per_round=1, delay=0.01))
    with gateway(redis_proc, tokenizer, prefix, static_verifiers=(fake.address,)) as client:
        resp = client.post("/v1/completions", json={
            "model": MODEL, "prompt": "x", "max_tokens": 200, "stop": stop, "stream": stream})
        assert resp.status_code == 200
        if stream:
            events = sse_events(resp.text)
            text, finish = stream_text(events, False), events[-1]["choices"][0]["finish_reason"]
        else:
            text, finish = resp.json()["choices"][0]["text"], resp.json()["choices"][0][
                "finish_reason"]
        assert (text, finish) == (expected, "stop")
        # a loaded CI host can take seconds to run the cancellation through
        assert wait_for(lambda: fake.cancelled == 1, timeout=15.0), \
            "the upstream call was not cancelled"
        record = asyncio.run(_session(redis_proc, prefix, fake.requests[0].session_id))
    assert record.status == "finished" and record.finish_reason == "stop"


async def _session(redis_proc, prefix, session_id):
    r = aioredis.Redis.from_url(redis_proc.url)
    try:
        return await RedisSessionStore(r, prefix=prefix, clock=time.time).get(session_id)
    finally:
        await r.aclose()


def test_text_stream_handles_partial_characters_and_hidden_stop_tokens(tokenizer, text_ids):
    stream = TextStream(tokenizer, stop_token_ids=[EOS])
    pieces = [stream.push([t]) for t in text_ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + stream.push([EOS, 42]) + stream.finish() == TEXT
    assert stream.stopped
    # a stop string split over many tokens is never half shown
    stream = TextStream(tokenizer, stop_strings=["café 日"])
    shown = "".join(stream.push([t]) for t in text_ids) + stream.finish()
    assert shown == "Hello world! Speculative decoding is fun: " and stream.stopped


def test_usage_counts_tokens_up_to_the_stop_not_the_rest_of_the_round(
        redis_proc, tokenizer, prefix, fakes, text_ids):
    """A round commits several tokens at once; those after the one that completes the stop
    string (or after the stop token) are not the client's and are not in usage."""
    through_fun = next(n for n in range(1, len(text_ids) + 1)
                       if "fun" in tokenizer.decode(text_ids[:n]))
    stream = TextStream(tokenizer, stop_strings=["fun"])
    stream.push(text_ids)  # the whole text in one round
    assert stream.stopped and stream.num_tokens == through_fun
    stream = TextStream(tokenizer, stop_token_ids=[EOS])
    stream.push([*text_ids[:3], EOS, *text_ids[3:6]])
    assert stream.stopped and stream.num_tokens == 4  # three tokens and the stop token
    fake = fakes(continue_text(text_ids + text_ids, per_round=len(text_ids)))
    with gateway(redis_proc, tokenizer, prefix, static_verifiers=(fake.address,)) as client:
        body = client.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                    "max_tokens": 200, "stop": "fun"}).json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == through_fun < len(text_ids)
    # The round accepted all its tokens but the last: those past the stop are not counted.
    spec = body["speculation"]
    assert spec["rounds"] == 1 and spec["accepted_tokens"] == through_fun
    assert spec["mean_accepted_length"] == through_fun


def test_length_finish_and_gateway_enforced_max_tokens(redis_proc, tokenizer, prefix, fakes,
                                                       text_ids):
    fake = fakes(continue_text(text_ids))  # ignores max_new_tokens: the gateway cuts it
    with gateway(redis_proc, tokenizer, prefix, static_verifiers=(fake.address,)) as client:
        body = client.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                    "max_tokens": 4}).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 4
    assert body["choices"][0]["text"] == tokenizer.decode(text_ids[:4])


# ---- failover -------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["abort", "stop", "finish_abort", "hang"])
@pytest.mark.parametrize("stream", [False, True])
def test_failover_resumes_on_another_verifier_without_loss_or_repeat(
        redis_proc, tokenizer, prefix, fakes, text_ids, how, stream):
    a = fakes(continue_text(text_ids, die_after=2, how=how))
    b = fakes(continue_text(text_ids))
    # A is less loaded, so it gets the session first; B is the only place to resume.
    register(redis_proc, prefix, verifier_rec(a.address, load=0), verifier_rec(b.address, load=1))
    with gateway(redis_proc, tokenizer, prefix, stall_timeout_s=0.5) as client:
        resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "Say hi",
                                                    "max_tokens": 60, "stream": stream})
        assert resp.status_code == 200, resp.text
        if stream:
            events = sse_events(resp.text)
            text, final = stream_text(events, False), events[-1]
        else:
            final = resp.json()
            text = final["choices"][0]["text"]
        record = asyncio.run(_session(redis_proc, prefix, a.requests[0].session_id))
    assert text == TEXT
    assert final["choices"][0]["finish_reason"] == "stop"
    (req_a,), (req_b,) = a.requests, b.requests
    streamed_by_a = text_ids[:6]  # two rounds of three tokens
    assert list(req_b.committed_token_ids) == streamed_by_a
    assert req_b.session_id == req_a.session_id
    assert list(req_b.prompt_token_ids) == list(req_a.prompt_token_ids)
    assert req_b.stopping.max_new_tokens == req_a.stopping.max_new_tokens == 60
    assert req_b.sampling == req_a.sampling
    assert final["usage"]["completion_tokens"] == len(text_ids) + 1
    rounds_b, drafted_b, accepted_b = round_stats(text_ids, base=6)
    assert final["speculation"] == expected_stats(2 + rounds_b, 8 + drafted_b, 4 + accepted_b,
                                                  len(text_ids) + 1)
    assert record.status == "finished" and record.verifier == b.address
    assert list(record.committed_token_ids) == text_ids + [EOS]
    assert record.attempts == 2


def test_failover_with_no_verifier_left(redis_proc, tokenizer, prefix, fakes, text_ids):
    a = fakes(continue_text(text_ids, die_after=1))
    with gateway(redis_proc, tokenizer, prefix, static_verifiers=(a.address,)) as client:
        resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                    "max_tokens": 60, "stream": True})
        events = sse_events(resp.text)  # tokens already went out: the error is an event
        assert stream_text(events[:-1], False) == tokenizer.decode(text_ids[:3])
        assert events[-1]["error"]["code"] == "no_verifier_available"
        record = asyncio.run(_session(redis_proc, prefix, a.requests[0].session_id))
        assert record.status == "failed" and list(record.committed_token_ids) == text_ids[:3]
        resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert resp.status_code == 503 and "UNAVAILABLE" in resp.json()["error"]["message"]


class StatusFake(FakeVerifier):
    """A fake verifier whose errors go through the real servicers' StatusInterceptor."""

    async def start(self) -> None:
        self.server = grpc.aio.server(interceptors=[StatusInterceptor()])
        verify_pb2_grpc.add_VerifyServiceServicer_to_server(self, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.address = f"127.0.0.1:{port}"


def fail_session_after(full: list[int], rounds: int):
    """Stream `rounds` rounds of `full`, then fail the session the way a verifier's step that
    failed on it does (tandem.errors.SessionFailed)."""
    async def script(fake, request, context):
        rounds_ = chunked(full, 3)[:rounds]
        for resp in responses(rounds_, finish=verify_pb2.FINISH_REASON_UNSPECIFIED):
            yield resp
        raise SessionFailed("verification failed (ValueError)")
    return script


@pytest.mark.parametrize("stream", [False, True])
def test_a_session_that_failed_on_its_verifier_is_not_replayed(redis_proc, tokenizer, prefix,
                                                               fakes, text_ids, stream):
    """A verifier whose step failed on this session (not a dead or draining verifier) ends
    the request with a 500; another verifier would fail (or crash) the same way."""
    a = fakes(fail_session_after(text_ids, 2), cls=StatusFake)
    b = fakes(continue_text(text_ids))
    register(redis_proc, prefix, verifier_rec(a.address, load=0), verifier_rec(b.address, load=1))
    with gateway(redis_proc, tokenizer, prefix) as client:
        resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "Say hi",
                                                    "max_tokens": 60, "stream": stream})
        if stream:  # tokens already went out: the error is the last event
            error = sse_events(resp.text)[-1]["error"]
        else:
            assert resp.status_code == 500, resp.text
            error = resp.json()["error"]
    assert error["code"] == "generation_failed" and "ValueError" in error["message"]
    assert len(a.requests) == 1 and b.requests == []


def test_a_request_whose_verifiers_keep_dying_stops_after_one_resume(
        redis_proc, tokenizer, prefix, fakes, text_ids):
    """A request that may be what kills verifiers is resumed once (max_resumes), not on
    every verifier there is."""
    dying = [fakes(continue_text(text_ids, die_after=1)) for _ in range(3)]
    register(redis_proc, prefix, *(verifier_rec(f.address, load=i) for i, f in enumerate(dying)))
    with gateway(redis_proc, tokenizer, prefix) as client:
        resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "Say hi",
                                                    "max_tokens": 60})
    assert resp.status_code == 502, resp.text
    assert resp.json()["error"]["code"] == "verifier_lost"
    assert [len(f.requests) for f in dying] == [1, 1, 0]


# ---- verifier status codes -------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_resource_exhausted_is_429_with_retry_after(redis_proc, tokenizer, prefix, fakes, stream):
    fake = fakes(fail_with(grpc.StatusCode.RESOURCE_EXHAUSTED, "all sessions busy"))
    with gateway(redis_proc, tokenizer, prefix, static_verifiers=(fake.address,),
                 retry_after_s=3) as client:
        resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                    "stream": stream})
    assert resp.status_code == 429, resp.text
    assert resp.headers["retry-after"] == "3"
    assert "capacity" in resp.json()["error"]["message"]


def test_a_verifier_our_own_streams_fill_is_refused_without_calling_it(redis_proc, tokenizer,
                                                                       prefix, fakes, text_ids):
    fake = fakes(continue_text(text_ids, per_round=1, delay=0.3), max_sessions=1)
    with gateway(redis_proc, tokenizer, prefix, static_verifiers=(fake.address,),
                 retry_after_s=2) as client, cf.ThreadPoolExecutor(1) as pool:
        busy = pool.submit(client.post, "/v1/completions",
                           json={"model": MODEL, "prompt": "x", "max_tokens": 6})
        assert wait_for(lambda: len(fake.requests) == 1), "the first stream never started"
        refused = client.post("/v1/completions", json={"model": MODEL, "prompt": "y"})
        assert refused.status_code == 429 and refused.headers["retry-after"] == "2"
        assert "full" in refused.json()["error"]["message"]
        assert len(fake.requests) == 1  # refused at the gateway: the verifier never saw it
        assert busy.result(timeout=30).status_code == 200


def test_verifier_invalid_argument_is_400_with_its_message(redis_proc, tokenizer, prefix, fakes):
    fake = fakes(fail_with(grpc.StatusCode.INVALID_ARGUMENT, "sequence beyond max_context"))
    with gateway(redis_proc, tokenizer, prefix, static_verifiers=(fake.address,)) as client:
        resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert resp.status_code == 400
    assert "sequence beyond max_context" in resp.json()["error"]["message"]


def test_a_failed_sessions_record_keeps_its_status_not_its_message(redis_proc, tokenizer,
                                                                    prefix, fakes):
    """An error's message may quote the request: the client gets it, the session record in
    Redis keeps the status and code only (issue 47: user text stays in its own answer)."""
    fake = fakes(fail_with(grpc.StatusCode.INVALID_ARGUMENT, "grammar: near 'S3CRET-USER-TEXT'"))
    with gateway(redis_proc, tokenizer, prefix, static_verifiers=(fake.address,)) as client:
        resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        record = asyncio.run(_session(redis_proc, prefix, fake.requests[0].session_id))
    assert resp.status_code == 400 and "S3CRET-USER-TEXT" in resp.json()["error"]["message"]
    assert record.status == "failed" and record.error == "400 invalid_request"


def test_speculative_token_limit_comes_from_the_verifier_info(redis_proc, tokenizer, prefix,
                                                              fakes, text_ids):
    fake = fakes(continue_text(text_ids), max_spec_tokens=4)
    with gateway(redis_proc, tokenizer, prefix, static_verifiers=(fake.address,)) as client:
        bad = client.post("/v1/completions", json={
            "model": MODEL, "prompt": "x", "speculation": {"num_speculative_tokens": 6}})
        ok = client.post("/v1/completions", json={
            "model": MODEL, "prompt": "x", "speculation": {"num_speculative_tokens": 4}})
    assert bad.status_code == 400 and "[0, 4]" in bad.json()["error"]["message"]
    assert ok.status_code == 200


# ---- rate limits -----------------------------------------------------------------------------


def test_rate_limit_per_key_is_429_with_retry_after(redis_proc, tokenizer, prefix, fakes,
                                                    text_ids):
    fake = fakes(continue_text(text_ids[:2]))
    now = [1000.0]  # minute window [960, 1020): 20 s left
    app = make_app(redis_proc, tokenizer, prefix, clock=lambda: now[0], rate_limit_rpm=2,
                   api_keys=("alice", "bob"), static_verifiers=(fake.address,))
    body = {"model": MODEL, "prompt": "x", "max_tokens": 5}

    def post(key):
        return client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})

    with TestClient(app) as client:
        assert [post("alice").status_code for _ in range(2)] == [200, 200]
        limited = post("alice")
        assert limited.status_code == 429
        assert limited.headers["retry-after"] == "20"
        assert limited.json()["error"]["type"] == "rate_limit_error"
        assert post("bob").status_code == 200  # per key
        now[0] = 1021.0
        assert post("alice").status_code == 200  # a new window


# ---- routing ---------------------------------------------------------------------------------


def test_pick_verifier_least_loaded_affinity_and_exclusion():
    a, b = verifier_rec("a:1", load=3, capacity=4), verifier_rec("b:1", load=2, capacity=8)
    assert pick_verifier([a, b], inflight={}) is b  # 3/4 vs 2/8
    assert pick_verifier([a, b], inflight={"b:1": 6}) is a  # our own in-flight count matters
    assert pick_verifier([a, b], inflight={}, preferred="a:1") is a  # affinity, not full
    assert pick_verifier([a, b], inflight={"a:1": 1}, preferred="a:1") is b  # full: no affinity
    assert pick_verifier([a, b], inflight={}, preferred="gone:1") is b
    assert pick_verifier([a, b], inflight={}, exclude=["b:1"]) is a
    assert pick_verifier([a, b], inflight={}, exclude=["a:1", "b:1"]) is None
    c = verifier_rec("c:1", tokenizer_hash="other")
    assert pick_verifier([c], inflight={}, tokenizer_hash="mine") is None
    d1 = WorkerRecord("draft", "d1", "d1:1", 4, 3, tokenizer_hash="x")
    d2 = WorkerRecord("draft", "d2", "d2:1", 4, 1, tokenizer_hash="y")
    assert pick_draft([d1, d2], inflight={}, verifier=verifier_rec("v:1")) is d2
    assert pick_draft([d1, d2], inflight={}, verifier=verifier_rec("v:1", tokenizer_hash="x")) \
        is d1
    assert affinity_key("abc" + "x" * 1000) == affinity_key("abc" + "x" * 1000 + "more")
    # Workers that advertise their methods only get sessions of those methods.
    e = WorkerRecord("draft", "e", "e:1", 4, 3, methods=("eagle", "ngram"))
    n = WorkerRecord("draft", "n", "n:1", 4, 0, methods=("ngram",))
    assert pick_draft([e, n], inflight={}, verifier=verifier_rec("v:1"), method="eagle") is e
    assert pick_draft([e, n], inflight={}, verifier=verifier_rec("v:1"), method="ngram") is n
    assert pick_draft([n], inflight={}, verifier=verifier_rec("v:1"), method="eagle") is None
    assert WorkerRecord.from_json(e.to_json()) == e


def test_default_method_is_the_first_preferred_one_a_draft_serves():
    from gateway.plan import _method
    from gateway.schemas import SpeculationOptions
    from tandem.spec import Method

    class Drafts:
        def __init__(self, *records):
            self.records = records

        async def drafts(self):
            return list(self.records)

    pref = ("eagle", "draft_model", "ngram")
    both = WorkerRecord("draft", "a", "a:1", 4, 0, methods=("draft_model", "eagle", "ngram"))
    legacy = WorkerRecord("draft", "b", "b:1", 4, 0)  # advertises nothing: model + ngram
    ngram = WorkerRecord("draft", "c", "c:1", 4, 0, methods=("ngram",))
    run = asyncio.run
    assert run(_method(SpeculationOptions(), Drafts(both), pref)) is Method.EAGLE
    assert run(_method(SpeculationOptions(), Drafts(legacy), pref)) is Method.DRAFT_MODEL
    assert run(_method(SpeculationOptions(), Drafts(ngram), pref)) is Method.NGRAM
    assert run(_method(SpeculationOptions(), Drafts(), pref)) is Method.NONE
    assert run(_method(SpeculationOptions(method="ngram"), Drafts(both), pref)) is Method.NGRAM
    with pytest.raises(ValueError, match="unknown speculation method"):
        GatewayConfig(method_preference=("eagle", "medusa2"))


def test_routing_by_registry_load_with_conversation_affinity(redis_proc, tokenizer, prefix,
                                                             fakes, text_ids):
    a, b = fakes(continue_text(text_ids[:2])), fakes(continue_text(text_ids[:2]))
    drafts = [WorkerRecord("draft", "d1", "10.0.0.1:7000", 8, 5),
              WorkerRecord("draft", "d2", "10.0.0.2:7000", 8, 1)]
    register(redis_proc, prefix, verifier_rec(a.address, load=2), verifier_rec(b.address, 0),
             *drafts)
    conv = [{"role": "user", "content": "Tell me about Redis."}]

    def chat(messages):
        resp = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
        assert resp.status_code == 200, resp.text

    # a draft worker's method by default (auto, the shipped default, needs no draft worker)
    with gateway(redis_proc, tokenizer, prefix, method_preference=("draft_model",)) as client:
        chat(conv)  # least loaded: B
        assert (len(a.requests), len(b.requests)) == (0, 1)
        assert b.requests[0].speculation.draft_address == "10.0.0.2:7000"  # least loaded draft
        register(redis_proc, prefix, verifier_rec(b.address, load=7))
        chat(conv + [{"role": "assistant", "content": "A store."}, {"role": "user",
                                                                    "content": "More?"}])
        assert len(b.requests) == 2  # same conversation: B again, though A is less loaded now
        chat([{"role": "user", "content": "Something else"}])
        assert len(a.requests) == 1  # a new conversation goes to the least loaded
        register(redis_proc, prefix, verifier_rec(b.address, load=8))
        chat(conv)
        assert len(a.requests) == 2  # B is full: affinity yields


def test_router_uses_the_last_known_workers_while_the_registry_is_unreachable():
    class FlakySource:
        calls = 0

        async def list(self, role):
            self.calls += 1
            if self.calls > 1:
                raise redis.ConnectionError("down")
            return [verifier_rec("v:1")]

    class NoAffinity:
        async def get(self, key):
            return None

        async def set(self, key, address):
            pass

    async def go():
        router = Router(FlakySource(), NoAffinity(), static_verifiers=("static:1",))
        first = await router.assign("k", need_draft=False)
        second = await router.assign("k", need_draft=False)
        return first.verifier.address, second.verifier.address

    assert asyncio.run(go()) == ("v:1", "v:1")


def test_router_keeps_the_last_workers_briefly_when_a_restarted_registry_is_empty():
    """A Redis restarted empty lists nobody until the workers' next heartbeat."""
    class RestartedSource:
        listings = [[verifier_rec("v:1")], [], []]

        async def list(self, role):
            return self.listings.pop(0)

    class NoAffinity:
        async def get(self, key):
            return None

        async def set(self, key, address):
            pass

    now = [0.0]

    async def go():
        router = Router(RestartedSource(), NoAffinity(), empty_grace_s=6.0,
                        clock=lambda: now[0])
        seen = [(await router.assign("k", need_draft=False)).verifier.address]
        now[0] = 5.0  # within the grace: still the last workers
        seen.append((await router.assign("k", need_draft=False)).verifier.address)
        now[0] = 12.0  # nobody re-registered after the grace: really gone
        seen.append(await router.assign("k", need_draft=False))
        return seen

    assert asyncio.run(go()) == ["v:1", "v:1", None]


def test_registry_entries_take_precedence_over_static_addresses(redis_proc, tokenizer, prefix,
                                                                fakes, text_ids):
    registered, static = fakes(continue_text(text_ids[:2])), fakes(continue_text(text_ids[:2]))
    with gateway(redis_proc, tokenizer, prefix, static_verifiers=(static.address,)) as client:
        client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        register(redis_proc, prefix, verifier_rec(registered.address))
        client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert client.get("/health").json()["verifiers"] == 1
    assert (len(static.requests), len(registered.requests)) == (1, 1)


# ---- registry --------------------------------------------------------------------------------


def test_registry_register_list_expire_and_deregister(redis_proc, prefix):
    async def go():
        r = aioredis.Redis.from_url(redis_proc.url)
        reg = WorkerRegistry(r, ttl_s=0.3, prefix=prefix)
        v = WorkerRecord("verifier", "v1", "h:1", 8, 2, model_id="m", tokenizer_hash="t",
                         max_spec_tokens=8)
        d = WorkerRecord("draft", "d1", "h:2", 4, 0)
        await reg.register(v)
        await reg.register(d)
        assert await reg.list("verifier") == [v] and await reg.list("draft") == [d]
        assert 0 < await r.pttl(f"{prefix}:worker:verifier:v1") <= 300
        assert await r.smembers(f"{prefix}:workers:verifier") == {b"v1"}
        await reg.deregister("draft", "d1")
        assert await reg.list("draft") == []
        await asyncio.sleep(0.45)  # no heartbeat: the record expires and the id is pruned
        assert await reg.list("verifier") == []
        assert await r.smembers(f"{prefix}:workers:verifier") == set()
        await r.aclose()
    asyncio.run(go())


def test_heartbeat_keeps_a_worker_alive_and_deregisters_on_stop(redis_proc, prefix):
    async def go():
        r = aioredis.Redis.from_url(redis_proc.url)
        reg = WorkerRegistry(r, ttl_s=0.3, prefix=prefix)
        loads = iter(range(100))
        stop = asyncio.Event()
        task = asyncio.create_task(heartbeat_loop(
            reg, lambda: WorkerRecord("verifier", "v1", "h:1", 8, next(loads)), 0.05, stop))
        await asyncio.sleep(0.6)  # twice the TTL: alive only thanks to the heartbeat
        (rec,) = await reg.list("verifier")
        assert rec.load >= 5  # refreshed with the current load each beat
        stop.set()
        await asyncio.wait_for(task, 2)
        assert await reg.list("verifier") == []
        await r.aclose()
    asyncio.run(go())


def test_heartbeat_survives_redis_being_down():
    async def go():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead_port = s.getsockname()[1]
        r = aioredis.Redis(host="127.0.0.1", port=dead_port, socket_connect_timeout=0.2)
        stop = asyncio.Event()
        task = asyncio.create_task(heartbeat_loop(
            WorkerRegistry(r, ttl_s=0.3), lambda: WorkerRecord("draft", "d", "h:1", 1, 0),
            0.05, stop))
        await asyncio.sleep(0.4)
        assert not task.done()
        stop.set()
        await asyncio.wait_for(task, 2)  # returns normally, no exception
        await r.aclose()
    asyncio.run(go())


def test_start_redis_is_real_and_stop_is_idempotent():
    with start_redis() as proc:
        client = redis.Redis.from_url(proc.url)
        assert client.ping() and client.config_get("appendonly") == {"appendonly": "no"}
        client.close()
        proc.stop()
        proc.stop()
        assert not proc.is_running()


# ---- a real server: the official openai client, client disconnects ------------------------


@contextmanager
def uvicorn_server(app):
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert wait_for(lambda: server.started, timeout=10), "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def test_official_openai_client_streaming_and_not(redis_proc, tokenizer, prefix, fakes,
                                                  text_ids):
    import openai

    fake = fakes(continue_text(text_ids))
    app = make_app(redis_proc, tokenizer, prefix, api_keys=("sk-test",),
                   static_verifiers=(fake.address,))
    with uvicorn_server(app) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-test", max_retries=0,
                               timeout=20)
        assert [m.id for m in client.models.list()] == [MODEL]
        done = client.completions.create(model=MODEL, prompt="Say hi", max_tokens=40,
                                         temperature=0)
        assert done.choices[0].text == TEXT and done.choices[0].finish_reason == "stop"
        assert done.usage.completion_tokens == len(text_ids) + 1
        assert done.model_extra["speculation"]["rounds"] == round_stats(text_ids)[0]
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=40)
        assert chat.choices[0].message.content == TEXT
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True,
            stream_options={"include_usage": True},
            extra_body={"speculation": {"method": "none"}}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == TEXT
        assert chunks[-1].usage.completion_tokens == len(text_ids) + 1
        assert chunks[-1].model_extra["speculation"]["method"] == "none"
        stream = client.completions.create(model=MODEL, prompt="x", max_tokens=40, stream=True)
        assert "".join(c.choices[0].text for c in stream) == TEXT
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
        with pytest.raises(openai.BadRequestError, match="temperature"):
            client.completions.create(model=MODEL, prompt="x", temperature=5)


def test_client_disconnect_cancels_the_verifier_call(redis_proc, tokenizer, prefix, fakes,
                                                     text_ids):
    import httpx

    fake = fakes(continue_text(text_ids * 4, per_round=1, delay=0.05))
    app = make_app(redis_proc, tokenizer, prefix, static_verifiers=(fake.address,))
    with uvicorn_server(app) as base, httpx.Client(base_url=base, timeout=10) as http:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 200, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            first = [next(lines) for _ in range(4)]  # two events (data + blank line each)
        assert first[0].startswith("data: {")
        assert wait_for(lambda: fake.cancelled == 1), "disconnect did not cancel upstream"
        session_id = fake.requests[0].session_id
        assert wait_for(lambda: asyncio.run(_session(redis_proc, prefix, session_id)).status
                        == "cancelled")
        record = asyncio.run(_session(redis_proc, prefix, session_id))
        assert 2 <= len(record.committed_token_ids) < 4 * len(text_ids)
        # not streaming: the gateway notices the disconnect between rounds
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json={**body, "stream": False}, timeout=0.3)
        assert wait_for(lambda: fake.cancelled == 2), "disconnect did not cancel upstream"


# ---- command line ----------------------------------------------------------------------------


def test_cli_registers_gateway_with_flags_and_env(monkeypatch, capsys, tmp_path):
    import argparse

    from gateway.cli import build_config
    from gateway.cli import register as register_cli

    monkeypatch.setenv("TANDEM_API_KEYS", "k1,k2")
    monkeypatch.setenv("TANDEM_GATEWAY_VERIFIERS", "10.0.0.1:50051")
    parser = argparse.ArgumentParser(prog="tandem")
    register_cli(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["gateway", "--help"])
    assert exc.value.code == 0 and "--verifier" in capsys.readouterr().out
    args = parser.parse_args(["gateway", "--port", "9000", "--verifier", "10.0.0.2:50051",
                              "--rate-limit-rpm", "30", "--context-length", "2048"])
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 4096}')
    config = build_config(args, "redis://127.0.0.1:6379/0", tmp_path)
    assert config.port == 9000 and [k.digest for k in config.api_keys] == [
        hashlib.sha256(k).hexdigest() for k in (b"k1", b"k2")]  # hashed: no plain key kept
    assert config.static_verifiers == ("10.0.0.2:50051",)  # the flag replaces the env list
    assert config.rate_limit_rpm == 30 and config.context_length == 2048
    config = build_config(parser.parse_args(["gateway"]), "redis://x:1/0", tmp_path)
    assert config.context_length == 4096 and config.static_verifiers == ("10.0.0.1:50051",)


def test_gateway_keeps_serving_while_redis_is_down(tokenizer, fakes, text_ids):
    fake = fakes(continue_text(text_ids))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    config = GatewayConfig(redis_url=f"redis://127.0.0.1:{dead_port}/0", model_name=MODEL,
                           static_verifiers=(fake.address,), rate_limit_rpm=10,
                           redis_timeout_s=0.3)
    app = create_app(config, redis=aioredis.Redis(port=dead_port, socket_connect_timeout=0.1),
                     tokenizer=tokenizer)
    with TestClient(app) as client:
        start = time.monotonic()
        for _ in range(3):
            resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                        "max_tokens": 40})
            assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == TEXT
        assert time.monotonic() - start < 3  # Redis is skipped after the first failure
        assert client.get("/health").json()["redis"] == "unavailable"


def test_a_draining_verifier_refuses_new_sessions_and_they_go_to_another(
        redis_proc, tokenizer, prefix, fakes, loop_thread, text_ids):
    """The real VerifyServicer after SIGUSR1 (Verifier.begin_drain) answers UNAVAILABLE; a
    gateway that still routes there (its registry entry not yet gone) resumes elsewhere."""
    from tandem.grpc_status import StatusInterceptor
    from tandem.spec import Method
    from verify_service.server import VerifyServicer

    draining = VerifyServicer(None, common_pb2.WorkerInfo(model_id=MODEL, max_sessions=8),
                              Method.NONE)
    draining.draining = True  # what Verifier.begin_drain sets

    async def start():
        server = grpc.aio.server(interceptors=[StatusInterceptor()])
        verify_pb2_grpc.add_VerifyServiceServicer_to_server(draining, server)
        return server, server.add_insecure_port("127.0.0.1:0")

    server, port = loop_thread.run(start())
    loop_thread.run(server.start())
    try:
        ok = fakes(continue_text(text_ids))
        refusing = f"127.0.0.1:{port}"
        register(redis_proc, prefix, verifier_rec(refusing, load=0),  # picked first
                 verifier_rec(ok.address, load=1))
        with gateway(redis_proc, tokenizer, prefix) as client:
            resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "Say hi",
                                                        "max_tokens": 60})
            assert resp.status_code == 200, resp.text
            record = asyncio.run(_session(redis_proc, prefix, ok.requests[0].session_id))
        assert resp.json()["choices"][0]["text"] == TEXT
        assert record.verifier == ok.address and record.attempts == 2
        assert list(ok.requests[0].committed_token_ids) == []  # nothing came from the first
    finally:
        loop_thread.run(server.stop(None))
