"""Typed errors -> gRPC status codes, in one place (TGI does this with an interceptor).

Servicers raise `tandem.errors` exceptions (or ValueError for bad input); `StatusInterceptor`
turns them into `context.abort(code, message)` for every method shape, so no servicer picks a
status code by itself and none matches on an error message's text.
"""
from __future__ import annotations

import inspect
import logging

import grpc

from tandem.errors import TandemError

log = logging.getLogger(__name__)


def status_of(exc: BaseException) -> grpc.StatusCode:
    """The status a failed call reports: typed errors by class, other ValueErrors are bad input."""
    if isinstance(exc, TandemError):
        return grpc.StatusCode[exc.status]
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


async def _abort(context: grpc.aio.ServicerContext, exc: Exception):
    code = status_of(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("unhandled error in a gRPC method")
    await context.abort(code, str(exc) or type(exc).__name__)


def _wrap_unary(behavior):
    async def call(request_or_iterator, context):
        try:
            return await behavior(request_or_iterator, context)
        except (TandemError, ValueError) as exc:
            await _abort(context, exc)
    return call


def _wrap_stream(behavior):
    if not inspect.isasyncgenfunction(behavior):  # a coroutine writing with context.write()
        return _wrap_unary(behavior)

    async def call(request_or_iterator, context):
        try:
            async for item in behavior(request_or_iterator, context):
                yield item
        except (TandemError, ValueError) as exc:
            await _abort(context, exc)
    return call


class StatusInterceptor(grpc.aio.ServerInterceptor):
    """Maps typed errors raised by any handler to their status code (see status_of)."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        kinds = (("unary_unary", grpc.unary_unary_rpc_method_handler, _wrap_unary),
                 ("stream_unary", grpc.stream_unary_rpc_method_handler, _wrap_unary),
                 ("unary_stream", grpc.unary_stream_rpc_method_handler, _wrap_stream),
                 ("stream_stream", grpc.stream_stream_rpc_method_handler, _wrap_stream))
        for attr, make, wrap in kinds:
            behavior = getattr(handler, attr)
            if behavior is not None:
                return make(wrap(behavior), request_deserializer=handler.request_deserializer,
                            response_serializer=handler.response_serializer)
        return handler
