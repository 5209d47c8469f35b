"""The gateway's streamed chat completions as a client reads them (server-sent events), in one
place for tools/bench and benchmarks/: each `data: {...}` line is one chunk (a dict), and
`data: [DONE]` ends the stream.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from contextlib import contextmanager

import httpx

CHAT_PATH = "/v1/chat/completions"
DONE = "data: [DONE]"


def sse_chunk(line: str) -> dict | None:
    """The chunk a `data:` line carries; None for other lines (comments, blanks) and DONE."""
    if not line.startswith("data: ") or line == DONE:
        return None
    return json.loads(line[6:])


def chunks(lines: Iterable[str]) -> Iterator[dict]:
    """The chunks of a stream's lines, in order."""
    for line in lines:
        if (chunk := sse_chunk(line)) is not None:
            yield chunk


async def achunks(lines: AsyncIterable[str]) -> AsyncIterator[dict]:
    """The chunks of a stream's lines, in order (an async response's aiter_lines())."""
    async for line in lines:
        if (chunk := sse_chunk(line)) is not None:
            yield chunk


def choice_text(choice: dict, *, tool_arguments: bool = False) -> str:
    """The text a chunk's choice adds: its delta's content; with `tool_arguments`, when it has
    none, the arguments its tool calls add (what a tool-call grammar generates)."""
    delta = choice.get("delta") or {}
    text = delta.get("content") or ""
    if text or not tool_arguments:
        return text
    return "".join(t["function"].get("arguments", "") for t in delta.get("tool_calls") or [])


@contextmanager
def chat_stream(url: str, body: dict, *, timeout: float, headers: dict | None = None
                ) -> Iterator[tuple[httpx.Response, Iterator[dict]]]:
    """POST a streamed chat completion (sync): the response (status, headers) and its chunks.
    Reading the chunks of a response that is not 200 is the caller's choice."""
    with httpx.stream("POST", url + CHAT_PATH, json=body, timeout=timeout,
                      headers=headers) as r:
        yield r, chunks(r.iter_lines())
