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
