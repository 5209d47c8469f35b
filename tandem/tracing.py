"""Tracing through OpenTelemetry's own instrumentation: the gRPC server and client
interceptors, the FastAPI (ASGI) middleware and the Redis client wrapper give the standard
spans and carry W3C `traceparent` on every hop. The SDK reads the standard OTEL_* variables
(OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER[_ARG], OTEL_BSP_*, the
exporter's endpoint, headers and timeout; tandem.telemetry.setup_tracing picks the exporter).

What no library knows stays Tandem's: the verifier's speculation span with one event per round,
and the draft worker's span per session. A draft worker's Speculate stream carries many
sessions, so it is left out of the gRPC instrumentation and each session's context travels in
its Open message instead (inject / extract below).
"""
from __future__ import annotations

from collections.abc import Iterable

from opentelemetry import propagate, trace

# Speculate: one stream for hours and many sessions (traced per session, not per stream);
# health checks: a probe every few seconds is not worth a trace.
_UNTRACED_METHODS = ("Speculate", "Check", "Watch")


def _grpc_filter():
    from opentelemetry.instrumentation.grpc import filters

    return filters.negate(filters.any_of(*map(filters.method_name, _UNTRACED_METHODS)))


def grpc_server_interceptors() -> list:
    """The interceptor that continues the caller's trace in a gRPC server span."""
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(filter_=_grpc_filter())]


def grpc_client_interceptors() -> list:
    """The interceptors that put a channel's calls in the current trace."""
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return aio_client_interceptors(filter_=_grpc_filter())


def instrument_app(app, excluded_urls: str = "/metrics,/health,/ready") -> None:
    """The FastAPI server span per request, continuing a client's `traceparent`; no span per
    streamed chunk (send / receive)."""
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    FastAPIInstrumentor.instrument_app(app, excluded_urls=excluded_urls,
                                       exclude_spans=["send", "receive"])


def instrument_redis(client) -> None:
    """A client span per Redis command (arguments replaced by `?`: no request text)."""
    from opentelemetry.instrumentation.redis import RedisInstrumentor

    if not getattr(client, "_is_instrumented_by_opentelemetry", False):
        RedisInstrumentor.instrument_client(client)


def inject(span: trace.Span) -> tuple[tuple[str, str], ...]:
    """W3C headers for `span`, for a message that carries one session of a shared stream."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return tuple(carrier.items())


def extract(pairs: Iterable[tuple[str, str]] | dict | None):
    """The parent context in such a message (None: a new root)."""
    if not pairs:
        return None
    items = pairs.items() if hasattr(pairs, "items") else pairs  # dicts, protobuf maps
    return propagate.extract({str(k).lower(): str(v) for k, v in items})
