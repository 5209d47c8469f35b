"""A tool-calling session's events: text that may be a tool call is held back. Whole (not
streamed), a finished call comes out as one ToolCalls event; streamed, as ToolCallDeltas
while the model writes it. Either way the finish_reason becomes "tool_calls" once the grammar
that produced the text reads calls in it."""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace

from gateway.generation import Finished, TextDelta
from gateway.tool_stream import CallStream
from gateway.tools import ToolPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolCalls:
    calls: list[dict]  # OpenAI's message.tool_calls
    index: int = 0  # the choice (n > 1)


@dataclass(frozen=True)
class ToolCallDeltas:
    deltas: list[dict]  # OpenAI's delta.tool_calls entries
    index: int = 0  # the choice (n > 1)


async def with_tool_calls(events: AsyncIterator, plan: ToolPlan,
                          captures: Callable[[str], Awaitable[list[str]]],
                          stream: bool = False) -> AsyncIterator:
    """`events` with a call's text replaced by ToolCalls (or ToolCallDeltas when `stream`);
    `captures(text)`: the call JSONs the plan's grammar captures in a text (auto)."""
    held: list[TextDelta] = []
    text, holding = "", True
    calls = CallStream(plan) if stream else None
    async for ev in events:
        if holding and isinstance(ev, TextDelta):
            text += ev.text
            held.append(ev)
            if plan.holds(text):
                if calls is not None and (deltas := calls.feed(text)):
                    yield ToolCallDeltas(deltas)
                continue
            holding = False  # plain text (auto): send it as it comes
            for h in held:
                yield h
            continue
        if holding and isinstance(ev, Finished):
            found = await _calls(plan, text, captures) if ev.finish_reason == "stop" else None
            if found and calls is not None:
                _check_streamed(calls, text, found)
                yield replace(ev, finish_reason="tool_calls")
                return
            if found:
                yield ToolCalls(found)
                yield replace(ev, finish_reason="tool_calls")
                return
            if calls is None or not calls.ids:  # cut short, or text after all: as content
                for h in held:
                    yield h
        yield ev


async def _calls(plan: ToolPlan, text: str,
                 captures: Callable[[str], Awaitable[list[str]]]) -> list[dict] | None:
    try:
        return plan.calls(text, await captures(text) if plan.mode == "auto" else None)
    except (ValueError, KeyError, TypeError):  # a stop string cut the grammar's text
        return None
    except RecursionError:  # a schema that allows any JSON: the model nested it too deep
        log.warning("tool calls nested too deeply to read (%d characters)", len(text))
        return None


def _check_streamed(calls: CallStream, text: str, found: list[dict]) -> None:
    """The streamed calls must be the ones the grammar reads (the same text, by two
    readers); a difference is a bug worth a log line, since the deltas are already out."""
    begun = calls.begun(text)
    parsed = [(c["function"]["name"], c["function"]["arguments"]) for c in found]
    try:
        streamed = [(n, json.loads(a)) for n, a in begun]
        same = streamed == [(n, json.loads(a)) for n, a in parsed]
    except (json.JSONDecodeError, RecursionError):
        same = False
    if not same:  # names and sizes only: arguments are the user's data
        log.warning("streamed tool calls %s differ from the grammar's %s",
                    [(n, f"{len(a)} chars") for n, a in begun],
                    [(n, f"{len(a)} chars") for n, a in parsed])


def chunk(chat_head: tuple, deltas: list[dict], index: int = 0) -> dict:
    """A streamed chunk of tool-call deltas (OpenAI's shape)."""
    _, session_id, created, model = chat_head
    choice = {"index": index, "delta": {"tool_calls": deltas}, "logprobs": None,
              "finish_reason": None}
    return {"id": session_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [choice]}
