"""One trace across gateway, verifier and draft worker; /metrics agree with the responses."""
import asyncio
import threading

import pytest
import redis.asyncio as aioredis
from fastapi.testclient import TestClient
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from draft_service.config import DraftConfig
from draft_service.main import build_app, draft_metrics
from gateway.app import create_app
from gateway.config import GatewayConfig
from tandem import telemetry
from tandem.redis_server import start_redis
from verify_service.config import VerifierConfig
from verify_service.main import start_verifier

pytestmark = pytest.mark.integration
PROMPT = "Repeat exactly: red green blue red green blue red green blue"


@pytest.fixture(scope="module")
def exporter():
    """The process's tracer provider (OpenTelemetry allows setting it once)."""
    exp = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exp))
    return exp


@pytest.fixture(scope="module")
def services(target_model, target_paths, tokenizer, exporter):
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(120)

    draft = run(build_app(DraftConfig(port=0, model=None, tokenizer=str(target_paths.root))))
    run(draft.server.start())
    # ngram over the draft link (not in the verifier's step): the draft side's spans and
    # metrics are under test here too.
    verifier = run(start_verifier(VerifierConfig(kv_cache_mb=64, draft_addresses=(
        f"127.0.0.1:{draft.port}",), history_drafts="worker"), model=target_model))
    redis_proc = start_redis()
    config = GatewayConfig(redis_url=redis_proc.url, model_name="SmolLM2-135M-Instruct",
                           static_verifiers=(f"127.0.0.1:{verifier.port}",),
                           static_drafts=(f"127.0.0.1:{draft.port}",))
    app = create_app(config, redis=aioredis.Redis.from_url(redis_proc.url), tokenizer=tokenizer)
    with TestClient(app) as client:
        yield client, verifier, draft
    run(verifier.drain_and_stop(0))
    run(draft.drain(0))
    redis_proc.stop()
    loop.call_soon_threadsafe(loop.stop)


def ask(client, method="ngram", stream=False):
    r = client.post("/v1/chat/completions", json={
        "model": "SmolLM2-135M-Instruct", "max_tokens": 24, "temperature": 0, "stream": stream,
        "messages": [{"role": "user", "content": PROMPT}],
        "speculation": {"method": method, "num_speculative_tokens": 4}})
    assert r.status_code == 200, r.text
    return r


def test_one_trace_spans_all_three_services(services, exporter):
    client, _, _ = services
    exporter.clear()
    ask(client)
    spans = exporter.get_finished_spans()
    by_name = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    gw = by_name["POST /v1/chat/completions"][0]  # OpenTelemetry's FastAPI server span
    verify = by_name[telemetry.SPAN_VERIFY][0]
    draft = by_name[telemetry.SPAN_DRAFT][0]
    trace_id = gw.context.trace_id
    assert verify.context.trace_id == trace_id and draft.context.trace_id == trace_id
    served = by_name["/tandem.v1.VerifyService/Generate"]  # gRPC client and server spans
    assert {s.kind for s in served} == {trace.SpanKind.CLIENT, trace.SpanKind.SERVER}
    assert verify.parent.span_id in {s.context.span_id for s in served}
    assert draft.parent.span_id == verify.context.span_id  # across OpenSession.trace_context
    # Session records written during the request are Redis client spans (one per command or
    # pipeline, from OpenTelemetry's Redis instrumentation) in its trace.
    assert any(s.attributes.get("db.system") == "redis" and s.context.trace_id == trace_id
               for s in spans)
    a = gw.attributes
    assert a[telemetry.GEN_AI_OPERATION] == "chat"
    assert a[telemetry.GEN_AI_REQUEST_MODEL] == "SmolLM2-135M-Instruct"
    assert a[telemetry.GEN_AI_REQUEST_MAX_TOKENS] == 24
    assert a[telemetry.GEN_AI_USAGE_OUTPUT] >= 1 and a[telemetry.GEN_AI_USAGE_INPUT] > 10
    assert tuple(a[telemetry.GEN_AI_FINISH_REASONS]) in {("stop",), ("length",)}
    rounds = [e for e in verify.events if e.name == telemetry.EVENT_ROUND]
    assert rounds and sum(e.attributes[telemetry.ATTR_DRAFTED] for e in rounds) > 0
    for e in rounds:
        for key in (telemetry.ATTR_ACCEPTED, telemetry.ATTR_DRAFT_WAIT_MS,
                    telemetry.ATTR_VERIFY_MS, telemetry.ATTR_REJECTION_MS):
            assert key in e.attributes
    assert verify.attributes[telemetry.ATTR_TTFT_MS] > 0


def metric_values(text: str) -> dict:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_metrics_parse_and_agree_with_responses(services):
    client, verifier, draft = services
    registry = verifier.servicer.metrics.registry
    before = metric_values(telemetry.render(registry).decode())
    stats = [ask(client, m).json()["speculation"] for m in ("ngram", "ngram", "none")]
    after = metric_values(telemetry.render(registry).decode())

    def delta(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert delta("tandem_spec_num_draft_tokens_total") == sum(s["drafted_tokens"] for s in stats)
    assert delta("tandem_spec_num_accepted_tokens_total") == sum(
        s["accepted_tokens"] for s in stats)
    per_pos = sum(delta("tandem_spec_num_accepted_tokens_per_pos_total", (("position", str(p)),))
                  for p in range(8))
    assert per_pos == sum(s["accepted_tokens"] for s in stats)
    assert delta("tandem_verifier_rounds_total") == sum(s["rounds"] for s in stats)
    assert ("tandem_verifier_kv_cache_usage_ratio", ()) in after
    gw = metric_values(client.get("/metrics").text)
    assert gw[("tandem_time_to_first_token_seconds_count", ())] >= 3
    assert gw[("tandem_gateway_requests_in_flight", ())] == 0
    d = metric_values(telemetry.render(draft_metrics(draft.worker).registry).decode())
    assert ("tandem_draft_queue_depth", ()) in d and d[("tandem_draft_tokens_drafted", ())] > 0


def test_worker_metrics_endpoint_serves_metrics_and_404s_elsewhere():
    import urllib.error
    import urllib.request

    from prometheus_client import CollectorRegistry, Counter

    registry = CollectorRegistry()
    Counter("tandem_probe_total", "a probe", registry=registry).inc()
    port = telemetry.start_metrics_server(0, registry, "127.0.0.1")
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "tandem_probe_total 1.0" in body
    for path in ("/", "/nothing", "/metricsx"):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5)
        assert err.value.code == 404
