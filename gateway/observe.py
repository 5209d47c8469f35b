"""Per-request telemetry for the gateway: the GenAI attributes on the request's server span
(OpenTelemetry's FastAPI instrumentation starts and ends it, continuing a client's
`traceparent`) and the latency histograms. No request text goes into a span.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from opentelemetry import trace

from gateway.errors import APIError, redacted_reason
from gateway.generation import Finished, TextDelta
from tandem import telemetry


def annotate_request(*, chat: bool, session_id: str, req) -> trace.Span:
    """The current (server) span, given the request's GenAI attributes."""
    op = "chat" if chat else "text_completion"
    attrs = {telemetry.GEN_AI_OPERATION: op, telemetry.GEN_AI_SYSTEM: "tandem",
             telemetry.GEN_AI_REQUEST_MODEL: req.model or "", telemetry.ATTR_SESSION: session_id}
    for key, value in ((telemetry.GEN_AI_REQUEST_MAX_TOKENS, getattr(req, "max_tokens", None)),
                       (telemetry.GEN_AI_REQUEST_TEMPERATURE, getattr(req, "temperature", None))):
        if value is not None:
            attrs[key] = value
    span = trace.get_current_span()
    span.set_attributes(attrs)
    return span


async def observed(events: AsyncIterator, span: trace.Span, metrics: telemetry.GatewayMetrics,
                   endpoint: str, prompt_tokens: int) -> AsyncIterator:
    """Pass events through; record TTFT, inter-token gaps, e2e latency on the metrics and
    `span` (the server span stays current: the verifier call and Redis spans nest under it)."""
    start = last = time.perf_counter()
    first, outcome = True, "ok"
    metrics.in_flight.inc()
    try:
        while True:
            try:
                ev = await anext(events)
            except StopAsyncIteration:
                break
            now = time.perf_counter()
            if isinstance(ev, TextDelta):
                if first:
                    metrics.ttft.observe(now - start)
                    span.set_attribute(telemetry.ATTR_TTFT_MS, (now - start) * 1e3)
                    first = False
                else:
                    metrics.itl.observe(now - last)
                last = now
            elif isinstance(ev, Finished):
                span.set_attributes({telemetry.GEN_AI_USAGE_INPUT: prompt_tokens,
                                     telemetry.GEN_AI_USAGE_OUTPUT: ev.completion_tokens,
                                     telemetry.GEN_AI_FINISH_REASONS: [ev.finish_reason]})
            yield ev
    except APIError as exc:
        outcome = str(exc.status)
        span.set_status(trace.StatusCode.ERROR, redacted_reason(exc))
        raise
    except BaseException:
        outcome = "cancelled"
        raise
    finally:
        metrics.in_flight.dec()
        metrics.e2e.observe(time.perf_counter() - start)
        metrics.requests.labels(endpoint=endpoint, status=outcome).inc()
        await events.aclose()
