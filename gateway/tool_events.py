"""A tool-calling session's events: text that may be a tool call is held back, and a
finished call comes out as one ToolCalls event (finish_reason "tool_calls")."""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from gateway.generation import Finished, TextDelta
from gateway.tools import ToolPlan


@dataclass(frozen=True)
class ToolCalls:
    calls: list[dict]  # OpenAI's message.tool_calls


async def with_tool_calls(events: AsyncIterator, plan: ToolPlan,
                          captures: Callable[[str], list[str]]) -> AsyncIterator:
    """`events` with a call's text replaced by ToolCalls; `captures(text)`: the call JSONs
    the plan's grammar captures in a text (auto)."""
    held: list[TextDelta] = []
    text, holding = "", True
    async for ev in events:
        if holding and isinstance(ev, TextDelta):
            text += ev.text
            held.append(ev)
            if plan.holds(text):
                continue
            holding = False  # plain text (auto): send it as it comes
            for h in held:
                yield h
            continue
        if holding and isinstance(ev, Finished):
            calls = _calls(plan, text, captures) if ev.finish_reason == "stop" else None
            if calls:
                yield ToolCalls(calls)
                yield replace(ev, finish_reason="tool_calls")
                return
            for h in held:  # cut short (length), or text after all: as content
                yield h
        yield ev


def _calls(plan: ToolPlan, text: str, captures: Callable[[str], list[str]]
           ) -> list[dict] | None:
    try:
        return plan.calls(text, captures(text) if plan.mode == "auto" else None)
    except (ValueError, KeyError, TypeError):  # a stop string cut the grammar's text
        return None


def chunk(chat_head: tuple, calls: list[dict]) -> dict:
    """The streamed delta of finished tool calls (OpenAI's shape, whole arguments at once)."""
    _, rid, created, model = chat_head
    deltas = [{"index": i, **call} for i, call in enumerate(calls)]
    choice = {"index": 0, "delta": {"tool_calls": deltas}, "logprobs": None,
              "finish_reason": None}
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [choice]}
