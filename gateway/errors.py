"""OpenAI-compatible errors: `{"error": {"message", "type", "param", "code"}}` bodies."""
from __future__ import annotations

import logging
import traceback
from types import MappingProxyType

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = MappingProxyType({
    400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
    429: "rate_limit_error", 503: "service_unavailable", 504: "timeout"})


class APIError(Exception):
    """An error the client gets as an OpenAI error body with this HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type_: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _TYPES.get(status, "api_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type_: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def rate_limited(message: str, retry_after_s: int) -> APIError:
    return APIError(429, message, code="rate_limit_exceeded",
                    headers={"Retry-After": str(max(1, int(retry_after_s)))})


def unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})


def unavailable(message: str) -> APIError:
    return APIError(503, message, code="no_verifier_available")


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _loc_to_param(loc: tuple) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def from_validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """The first problem, naming the field: clients fix one thing at a time anyway."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request")
    params = [_param(e) for e in errors]
    param = params[0]
    # A value matching no member of a union fails once per member: show them together.
    msgs = list(dict.fromkeys(e.get("msg", "invalid value") for e, p in zip(errors, params)
                              if p == param))
    msg = msgs[0] if len(msgs) == 1 else "; or ".join(msgs[:4])
    others = sum(p != param for p in params)
    more = f" (and {others} more problem(s))" if others else ""
    text = f"{param}: {msg}{more}" if param else f"{msg}{more}"
    return bad_request(text, param=param, code="invalid_value")


def _param(error: dict) -> str | None:
    loc = tuple(p for p in error.get("loc", ()) if p != "body")
    # Union members show up as extra loc parts ('prompt', 'str'); they do not name a field.
    loc = tuple(p for p in loc if not (isinstance(p, str) and (p in _TYPE_NAMES or "[" in p)))
    return _loc_to_param(loc) or None


def install_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI body; nothing unexpected takes the process down."""

    async def on_api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_error(exc).response()

    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}))
        return err.response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    # Not an Exception handler: Starlette re-raises after one, and the server then logs the
    # exception's message, which may quote the request (a prompt, a schema, tool arguments).
    app.add_middleware(_Unexpected)


class _Unexpected:
    """Any other exception: a 500 naming its type; logged with its traceback, not its
    message (request text must not reach the logs)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            log.error("unhandled %s in the gateway (message withheld):\n%s", type(exc).__name__,
                      "".join(traceback.format_tb(exc.__traceback__)).rstrip())
            if not started:  # else the response is cut short: all a server can do then
                await APIError(500, f"internal error: {type(exc).__name__}").response()(
                    scope, receive, send)


def redacted_reason(exc: BaseException) -> str:
    """What a trace or the session record may keep of a refusal: its status and code, not
    its message, which may quote the request (a tool name, a grammar, a prompt's length)."""
    if isinstance(exc, APIError):
        return f"{exc.status} {exc.code or exc.type}"
    return type(exc).__name__


def check_chars_fit(param: str, chars: int, context_length: int, max_token_chars: int) -> None:
    """400 for text (a prompt, a prediction) that needs more tokens than the context holds
    even if every token were the longest one (`max_token_chars`; 0: not checked): refused
    before it is tokenized, which for a huge body takes seconds."""
    if max_token_chars and chars > context_length * max_token_chars:
        raise bad_request(f"{param}: {chars} characters cannot fit in the context length of "
                          f"{context_length} tokens", param=param,
                          code="context_length_exceeded")
