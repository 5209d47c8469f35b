"""A session's events as the HTTP answer: one JSON body, or a server-sent event stream."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import StreamingResponse

from gateway import schemas
from gateway.errors import APIError
from gateway.generation import Finished, RoundEvent, TextDelta
from gateway.logprobs import LogprobsFormatter, TokenLogprobs
from gateway.tool_events import ToolCallDeltas, ToolCalls, chunk


@dataclass(frozen=True)
class ResponseMeta:
    """What every body or chunk of one response repeats."""

    chat: bool
    session_id: str  # also the response's OpenAI "id" (chatcmpl-... / cmpl-...)
    created: int
    model: str
    prompt_tokens: int
    decode: Callable[[int], str] | None = None  # a token's text; None = no logprobs asked

    def formatter(self) -> LogprobsFormatter | None:
        return None if self.decode is None else LogprobsFormatter(self.chat, self.decode)

    def head(self) -> tuple:
        return self.chat, self.session_id, self.created, self.model


async def collect(events: AsyncIterator, meta: ResponseMeta, request: Request) -> dict:
    """The whole response as one body (stream=false)."""
    parts: list[str] = []
    logprobs: list[TokenLogprobs] = []
    calls = None
    async with aclosing(events), _cancelled_on_disconnect(request):
        async for ev in events:
            if isinstance(ev, ToolCalls):
                calls = ev.calls
            elif isinstance(ev, TextDelta):
                parts.append(ev.text)
                logprobs.extend(ev.logprobs)
            elif isinstance(ev, Finished):
                usage = schemas.usage_dict(meta.prompt_tokens, ev.completion_tokens)
                fmt = meta.formatter()
                args = (meta.session_id, meta.created, meta.model, "".join(parts), ev.finish_reason,
                        usage, ev.speculation, None if fmt is None else fmt.format(logprobs))
                if meta.chat:
                    return schemas.chat_response(*args, tool_calls=calls)
                return schemas.completion_response(*args)
    raise APIError(502, "generation ended without a result")


@asynccontextmanager
async def _cancelled_on_disconnect(request: Request) -> AsyncIterator[None]:
    """Cancels the work inside when the client goes away, as a 499. Watched apart from the
    events: a tool call holds every event back until the end, and a prefill sends none.
    (Closing the events then cancels the verifier's work.)"""
    task, gone = asyncio.current_task(), False

    async def watch() -> None:
        nonlocal gone
        while (await request.receive())["type"] != "http.disconnect":
            pass  # the rest of a body already read: nothing more comes but the disconnect
        gone = True
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        yield
    except asyncio.CancelledError:
        if not gone:
            raise
        if hasattr(task, "uncancel"):  # 3.11+: this cancel is answered, not pending
            task.uncancel()
        raise APIError(499, "client disconnected", code="client_closed") from None
    finally:
        watcher.cancel()


def _sse(obj: dict | str) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n"


async def stream(events: AsyncIterator, meta: ResponseMeta, include_usage: bool,
                 request: Request) -> StreamingResponse:
    """The response as server-sent events (stream=true), ending with `data: [DONE]`."""
    # Wait for the first event before answering: refusals (429, 503, a verifier's 400) then
    # arrive as real HTTP statuses instead of errors inside a 200 stream.
    try:
        async with _cancelled_on_disconnect(request):
            first = await anext(events)
    except BaseException:
        await events.aclose()
        raise

    async def body() -> AsyncIterator[str]:
        async with aclosing(events):
            if meta.chat:
                yield _sse(schemas.stream_chunk(*meta.head(), role=True))
            ev, fmt = first, meta.formatter()
            try:
                while ev is not None:
                    for chunk in _chunks(ev, meta, include_usage, fmt):
                        yield _sse(chunk)
                    ev = await anext(events, None)
            except APIError as exc:  # mid-stream failure: OpenAI-style error event
                yield _sse(exc.body())
            yield _sse("[DONE]")

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _chunks(ev: TextDelta | RoundEvent | ToolCallDeltas | Finished, meta: ResponseMeta,
            include_usage: bool, fmt: LogprobsFormatter | None) -> list[dict]:
    if isinstance(ev, ToolCallDeltas):
        return [chunk(meta.head(), ev.deltas)]
    if isinstance(ev, RoundEvent):
        return [schemas.round_chunk(*meta.head(), ev.as_dict())]
    if isinstance(ev, TextDelta):
        return [schemas.stream_chunk(*meta.head(), text=ev.text,
                                     logprobs=None if fmt is None else fmt.format(ev.logprobs))]
    usage = schemas.usage_dict(meta.prompt_tokens, ev.completion_tokens)
    last = schemas.stream_chunk(*meta.head(), finish=ev.finish_reason)
    if include_usage:
        return [last, schemas.usage_chunk(*meta.head(), usage, ev.speculation)]
    return [{**last, "usage": usage, "speculation": ev.speculation}]
