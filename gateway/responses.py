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
from gateway.choices import ChoiceEnd
from gateway.errors import APIError
from gateway.generation import Finished, RoundEvent, TextDelta
from gateway.logprobs import LogprobsFormatter, TokenLogprobs
from gateway.prediction import usage_details
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
    n: int = 1  # choices returned (best_of more may be generated: collect keeps the n best)
    echo: str = ""  # completions' echo: the prompt's text, before each choice's

    def formatter(self) -> LogprobsFormatter | None:
        return None if self.decode is None else LogprobsFormatter(self.chat, self.decode)

    def head(self) -> tuple:
        return self.chat, self.session_id, self.created, self.model


@dataclass
class _Choice:
    """What one choice's events add up to."""

    parts: list[str]
    logprobs: list[TokenLogprobs]
    calls: list[dict] | None = None


async def collect(events: AsyncIterator, meta: ResponseMeta, request: Request) -> dict:
    """The whole response as one body (stream=false)."""
    got: dict[int, _Choice] = {}
    async with aclosing(events), _cancelled_on_disconnect(request):
        async for ev in events:
            c = got.setdefault(getattr(ev, "index", 0), _Choice([meta.echo], []))
            if isinstance(ev, ToolCalls):
                c.calls = ev.calls
            elif isinstance(ev, TextDelta):
                c.parts.append(ev.text)
                c.logprobs.extend(ev.logprobs)
            elif isinstance(ev, Finished):
                return _body(meta, got, ev)
    raise APIError(502, "generation ended without a result")


def _body(meta: ResponseMeta, got: dict[int, _Choice], fin: Finished) -> dict:
    ends = fin.choices or (ChoiceEnd(0, fin.finish_reason, fin.completion_tokens,
                                     fin.speculation),)
    # best_of: the n choices whose tokens are likeliest (vLLM's order: best first)
    kept = sorted(ends, key=lambda e: -e.logprob)[:meta.n] if len(ends) > meta.n else ends
    choices = []
    for index, end in enumerate(kept):
        c = got.get(end.index) or _Choice([meta.echo], [])
        fmt = meta.formatter()
        logprobs = None if fmt is None else fmt.format(c.logprobs)
        if meta.chat:
            choices.append(schemas.chat_choice(index, "".join(c.parts), end.finish_reason,
                                               logprobs, c.calls))
        else:
            choices.append(schemas.completion_choice(index, "".join(c.parts),
                                                     end.finish_reason, logprobs))
    usage = {**schemas.usage_dict(meta.prompt_tokens, fin.completion_tokens),
             **usage_details(fin.prediction)}
    return schemas.response_body(meta.chat, meta.session_id, meta.created, meta.model, choices,
                                 usage, fin.speculation)


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
            for index in range(meta.n):
                if meta.chat:
                    yield _sse(schemas.stream_chunk(*meta.head(), role=True, index=index))
                elif meta.echo:
                    yield _sse(schemas.stream_chunk(*meta.head(), text=meta.echo, index=index))
            ev, fmts = first, [meta.formatter() for _ in range(meta.n)]
            try:
                while ev is not None:
                    for chunk in _chunks(ev, meta, include_usage, fmts):
                        yield _sse(chunk)
                    ev = await anext(events, None)
            except APIError as exc:  # mid-stream failure: OpenAI-style error event
                yield _sse(exc.body())
            yield _sse("[DONE]")

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _chunks(ev: TextDelta | RoundEvent | ToolCallDeltas | ChoiceEnd | Finished,
            meta: ResponseMeta, include_usage: bool,
            fmts: list[LogprobsFormatter | None]) -> list[dict]:
    if isinstance(ev, ToolCallDeltas):
        return [chunk(meta.head(), ev.deltas, ev.index)]
    if isinstance(ev, RoundEvent):
        event = ev.as_dict() if meta.n == 1 else {"index": ev.index, **ev.as_dict()}
        return [schemas.round_chunk(*meta.head(), event)]
    if isinstance(ev, TextDelta):
        fmt = fmts[ev.index]
        return [schemas.stream_chunk(*meta.head(), text=ev.text, index=ev.index,
                                     logprobs=None if fmt is None else fmt.format(ev.logprobs))]
    last = schemas.stream_chunk(*meta.head(), finish=ev.finish_reason, index=ev.index)
    if isinstance(ev, ChoiceEnd):  # a choice ended; the request goes on
        return [last]
    usage = {**schemas.usage_dict(meta.prompt_tokens, ev.completion_tokens),
             **usage_details(ev.prediction)}
    if include_usage:
        return [last, schemas.usage_chunk(*meta.head(), usage, ev.speculation)]
    return [{**last, "usage": usage, "speculation": ev.speculation}]
