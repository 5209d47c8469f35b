"""The gateway's request body limit (GatewayConfig.max_request_bytes): a larger body is a 413
in OpenAI's error format, refused before authentication, rate limits or JSON parsing spend
anything on it."""
from __future__ import annotations

from gateway.errors import APIError


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes",
                    code="request_too_large", type_="invalid_request_error")


class BodyLimit:
    """ASGI middleware. A declared Content-Length over the limit is answered at once; a body
    without one (chunked) is counted as the app reads it, and the read that crosses the limit
    raises the same APIError, which gateway.errors' handler answers."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await too_large(self.max_bytes).response()(scope, receive, send)
            return
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise too_large(self.max_bytes)
            return message

        await self.app(scope, counted, send)


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:  # the HTTP server refuses these itself; count the body instead
                return None
    return None
