"""Typed errors -> gRPC status codes, in one place (TGI does this with an interceptor).

Servicers raise `tandem.errors` exceptions (or ValueError for bad input); `StatusInterceptor`
turns them into `context.abort(code, message)` for every method shape, so no servicer picks a
status code by itself and none matches on an error message's text.

It also parses requests: a message that does not decode (corrupt bytes, invalid UTF-8 in a
string) is INVALID_ARGUMENT saying why, not grpc's UNKNOWN. In a request stream, reading such a
message raises InvalidArgument from that `__anext__` only; a servicer may report it and read on.
"""
from __future__ import annotations

import inspect
import logging

import grpc

from tandem.errors import FAILURE_TRAILER, InvalidArgument, SessionFailed, TandemError

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
    failed = isinstance(exc, SessionFailed)  # logged where it happened
    if code is grpc.StatusCode.INTERNAL and not failed:
        log.exception("unhandled error in a gRPC method")
    trailer = (FAILURE_TRAILER,) if failed else ()
    await context.abort(code, str(exc) or type(exc).__name__, trailing_metadata=trailer)


class _Malformed:
    """What the tolerant deserializer hands on for bytes that do not parse."""

    def __init__(self, message: str):
        self.message = message


def _tolerant(deserialize):
    if deserialize is None:
        return None

    def parse(data: bytes):
        try:
            return deserialize(data)
        except Exception as exc:  # DecodeError, or whatever a custom deserializer raises
            return _Malformed(f"malformed request, could not parse it: {exc}")
    return parse


class _CheckedRequests:
    """A request stream that raises InvalidArgument for each malformed message and can be read
    on after it (a plain `async for` stops there, and the call ends INVALID_ARGUMENT)."""

    def __init__(self, requests):
        self._source = requests
        self._requests = None  # opened on the first read: a handler that refuses the call
        # unread would otherwise leave grpc's receiver coroutine never awaited (a warning)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._requests is None:
            self._requests = self._source.__aiter__()
        msg = await self._requests.__anext__()
        if isinstance(msg, _Malformed):
            raise InvalidArgument(msg.message)
        return msg


def _checked(request_or_iterator, streaming: bool):
    if streaming:
        return _CheckedRequests(request_or_iterator)
    if isinstance(request_or_iterator, _Malformed):
        raise InvalidArgument(request_or_iterator.message)
    return request_or_iterator


def _wrap_unary(behavior, streaming: bool):
    async def call(request_or_iterator, context):
        try:
            return await behavior(_checked(request_or_iterator, streaming), context)
        except (TandemError, ValueError) as exc:
            await _abort(context, exc)
    return call


def _wrap_stream(behavior, streaming: bool):
    if not inspect.isasyncgenfunction(behavior):  # a coroutine writing with context.write()
        return _wrap_unary(behavior, streaming)

    async def call(request_or_iterator, context):
        try:
            async for item in behavior(_checked(request_or_iterator, streaming), context):
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
                return make(wrap(behavior, attr.startswith("stream")),
                            request_deserializer=_tolerant(handler.request_deserializer),
                            response_serializer=handler.response_serializer)
        return handler
