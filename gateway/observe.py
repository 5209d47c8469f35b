"""Per-request telemetry for the gateway: one server span and the latency histograms.

The streaming body outlives the route handler, so the span is ended by the event wrapper when
the last event has gone out (or the client left), not by the handler.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from opentelemetry import trace

from gateway.errors import APIError, redacted_reason
from gateway.generation import Finished, TextDelta
from tandem import telemetry


def start_request_span(tracer: trace.Tracer, headers, *, chat: bool, session_id: str,
                       req) -> trace.Span:
    """The request's span, continuing the caller's W3C trace if it sent one."""
    op = "chat" if chat else "text_completion"
    span = tracer.start_span(telemetry.SPAN_GATEWAY.format(operation=op),
                             context=telemetry.extract_context(dict(headers)),
                             kind=trace.SpanKind.SERVER)
    attrs = {telemetry.GEN_AI_OPERATION: op, telemetry.GEN_AI_SYSTEM: "tandem",
             telemetry.GEN_AI_REQUEST_MODEL: req.model or "", telemetry.ATTR_SESSION: session_id}
    for key, value in ((telemetry.GEN_AI_REQUEST_MAX_TOKENS, getattr(req, "max_tokens", None)),
                       (telemetry.GEN_AI_REQUEST_TEMPERATURE, getattr(req, "temperature", None))):
        if value is not None:
            attrs[key] = value
    span.set_attributes(attrs)
    return span


async def observed(events: AsyncIterator, span: trace.Span, metrics: telemetry.GatewayMetrics,
                   endpoint: str, prompt_tokens: int) -> AsyncIterator:
    """Pass events through; record TTFT, inter-token gaps, e2e latency; end the span."""
    start = last = time.perf_counter()
    first, outcome = True, "ok"
    metrics.in_flight.inc()
    try:
        while True:
            # The span is current only around the await (never across a yield), so the
            # verifier call and Redis spans nest under it without leaking the context.
            with trace.use_span(span, end_on_exit=False):
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
        span.end()
        await events.aclose()
