"""A client's W3C `traceparent` continues through gateway -> verifier -> draft worker: one trace
with the client's trace id, the hops made by OpenTelemetry's FastAPI, gRPC and Redis
instrumentation, Tandem's own spans (verify with its round events, draft per session) inside
it, and no request text in any span. Real in-process servers on loopback, a tiny random Llama.
"""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis.asyncio as aioredis
from fastapi.testclient import TestClient
from grpc_servers import save_tiny_llama
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from draft_service.config import DraftConfig
from draft_service.main import build_app
from gateway.app import create_app
from gateway.config import GatewayConfig
from tandem import telemetry
from verify_service.config import VerifierConfig
from verify_service.main import start_verifier

pytestmark = pytest.mark.contract
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
MARKER = "zq-trace-marker-5521"
SERVER, CLIENT = trace.SpanKind.SERVER, trace.SpanKind.CLIENT
GENERATE = "/tandem.v1.VerifyService/Generate"


@pytest.fixture(scope="module")
def exporter():
    """The process's tracer provider (OpenTelemetry allows setting it once)."""
    exp = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exp))
    yield exp
    exp.shutdown()  # later tests' spans are not kept


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, target_paths, tokenizer, redis_proc, exporter):
    model = str(save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), target_paths.root))
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(120)

    draft = run(build_app(DraftConfig(port=0, model=None, tokenizer=str(target_paths.root))))
    run(draft.server.start())
    verifier = run(start_verifier(VerifierConfig(
        model=model, kv_cache_mb=2, calibrate_reps=0, medusa="off", layer_skip="off",
        draft_addresses=(f"127.0.0.1:{draft.port}",), history_drafts="worker")))
    config = GatewayConfig(redis_url=redis_proc.url, redis_prefix="trace", model_name="tiny",
                           static_verifiers=(f"127.0.0.1:{verifier.port}",),
                           static_drafts=(f"127.0.0.1:{draft.port}",))
    app = create_app(config, redis=aioredis.Redis.from_url(redis_proc.url), tokenizer=tokenizer)
    with TestClient(app) as client:
        yield client
    run(verifier.drain_and_stop(0))
    run(draft.drain(0))
    loop.call_soon_threadsafe(loop.stop)


def _spans_of_one_request(client, exporter):
    exporter.clear()
    r = client.post("/v1/completions", headers={
        "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}, json={
        "model": "tiny", "prompt": f"red green blue {MARKER} red green blue red green",
        "max_tokens": 8, "temperature": 0,
        "speculation": {"method": "ngram", "num_speculative_tokens": 4}})
    assert r.status_code == 200, r.text
    # The gateway's Generate span ends when its call is let go (a loop tick after the answer).
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        spans = [s for s in exporter.get_finished_spans()
                 if s.context.trace_id == int(TRACE_ID, 16)]
        if any(s.kind == CLIENT and s.name == GENERATE for s in spans):
            break
        time.sleep(0.02)
    return spans


def _one(spans, pred, what):
    found = [s for s in spans if pred(s)]
    assert len(found) == 1, (what, [(s.name, s.kind) for s in spans])
    return found[0]


def test_a_client_traceparent_spans_gateway_verifier_and_draft_worker(gateway, exporter):
    spans = _spans_of_one_request(gateway, exporter)
    http = _one(spans, lambda s: s.kind == SERVER and s.name.startswith("POST"), "gateway")
    assert http.parent.span_id == int(CLIENT_SPAN, 16)  # the client's span, continued
    call = _one(spans, lambda s: s.kind == CLIENT and s.name == GENERATE, "gateway's call")
    served = _one(spans, lambda s: s.kind == SERVER and s.name == GENERATE, "verifier's")
    verify = _one(spans, lambda s: s.name == telemetry.SPAN_VERIFY, "verify")
    draft = _one(spans, lambda s: s.name == telemetry.SPAN_DRAFT, "draft worker")
    assert call.parent.span_id == http.context.span_id
    assert served.parent.span_id == call.context.span_id  # over gRPC metadata
    assert verify.parent.span_id == served.context.span_id
    assert draft.parent.span_id == verify.context.span_id  # over OpenSession.trace_context
    assert any(s.kind == CLIENT and s.attributes.get("db.system") == "redis" for s in spans)
    assert http.attributes[telemetry.GEN_AI_OPERATION] == "text_completion"
    assert http.attributes[telemetry.GEN_AI_USAGE_OUTPUT] >= 1
    rounds = [e for e in verify.events if e.name == telemetry.EVENT_ROUND]
    assert rounds and all(telemetry.ATTR_ACCEPTED in e.attributes for e in rounds)
    assert draft.attributes[telemetry.ATTR_TOKENS_DRAFTED] >= 0


def test_no_span_carries_request_text(gateway, exporter):
    spans = _spans_of_one_request(gateway, exporter)
    assert len(spans) >= 5
    for s in spans:
        text = repr((s.name, dict(s.attributes), [(e.name, dict(e.attributes))
                                                  for e in s.events]))
        assert MARKER not in text and "green" not in text, s.name


def test_the_speculate_stream_and_health_checks_are_not_traced(gateway, exporter):
    exporter.clear()
    assert gateway.get("/health").status_code in (200, 503)
    _spans_of_one_request(gateway, exporter)
    names = {s.name for s in exporter.get_finished_spans()}
    assert not any("Speculate" in n or "Health" in n for n in names), names
