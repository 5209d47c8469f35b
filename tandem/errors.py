"""Typed errors for every layer; tandem/grpc_status.py maps them to gRPC status codes in one
place and the gateway to HTTP statuses. Each subclasses the builtin it refines, so callers that
catch ValueError (bad input) keep working."""
from __future__ import annotations


class TandemError(Exception):
    """Base class; `status` names the gRPC status code (grpc.StatusCode member name)."""

    status = "INTERNAL"


class InvalidArgument(TandemError, ValueError):
    """The request is malformed or outside a limit (HTTP 400)."""

    status = "INVALID_ARGUMENT"


class NotFound(TandemError, LookupError):
    """An unknown session or model (HTTP 404)."""

    status = "NOT_FOUND"


class AlreadyExists(TandemError, ValueError):
    """A session id that is already generating here (HTTP 409)."""

    status = "ALREADY_EXISTS"


class ResourceExhausted(TandemError):
    """No room for the work: sessions, KV blocks, rate limits (HTTP 429)."""

    status = "RESOURCE_EXHAUSTED"


class Unavailable(TandemError):
    """Draining or not ready: retry elsewhere (HTTP 503)."""

    status = "UNAVAILABLE"


class SessionFailed(TandemError):
    """This session's own step failed here (a bug or a library error its input triggered):
    the client gets a 500, and the gateway does not replay it on the next verifier, where
    it would fail (or crash) the same way. Marked by the `FAILURE_TRAILER` trailer."""

    status = "INTERNAL"


# Trailing metadata that tells a SessionFailed INTERNAL from a transport's INTERNAL.
FAILURE_TRAILER = ("tandem-failure", "session")


def recoverable(exc: BaseException) -> bool:
    """Whether a step may catch `exc` and go on: any error, including the BaseException a
    native extension raises on a panic (pyo3's PanicException), but not a cancellation,
    an interrupt or an exit."""
    import asyncio

    return not isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt, SystemExit,
                                GeneratorExit))
