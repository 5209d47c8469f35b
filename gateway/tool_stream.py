"""Streamed tool calls as OpenAI sends them: a call's first delta carries its id, type and
function name (arguments ""), the next ones its arguments text as the model writes it.

The text is what the plan's grammar allows, so its shape is known: a named call is the
arguments alone; "required" a JSON list and "auto" `<tool_call>` blocks of objects whose
keys come in the grammar's order, `{"name": "...", "parameters"|"arguments": <value>}`. A
call's arguments are streamed from the text exactly (they end where that JSON value ends);
the finished text is still parsed by the grammar itself (tool_events) before "tool_calls".
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from gateway.tools import ToolPlan, call_id

# A call's head up to its arguments' first character (the grammar's JSON style: ", " and
# ": " separators). Inside a JSON string every quote is escaped, so this cannot match there;
# it is searched only past the previous call's arguments, never inside them.
_HEAD = re.compile(r'\{"name": "((?:[^"\\]|\\.)*)", "(?:parameters|arguments)": ')


def value_end(text: str, start: int) -> int | None:
    """Where the JSON value starting at text[start] ends (exclusive), None while it is not
    finished. A scalar ends at the enclosing object's `,` or `}`."""
    depth, in_str, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_str:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_str = False
                if depth == 0:
                    return i + 1
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]" and depth == 0 or c == "," and depth == 0:
            return i
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _unescape(name: str) -> str:
    return json.loads(f'"{name}"') if "\\" in name else name


@dataclass
class CallStream:
    """Deltas for a tool-calling text that grows: feed() the whole text so far."""

    plan: ToolPlan
    ids: list[str] = field(default_factory=list)  # per call seen
    sent: list[int] = field(default_factory=list)  # per call: arguments characters sent

    def feed(self, text: str) -> list[dict]:
        """The new deltas (OpenAI's `delta.tool_calls` entries) since the last feed."""
        out = []
        for i, (name, args) in enumerate(self.begun(text)):
            if i == len(self.ids):  # a new call: its head first
                self.ids.append(call_id())
                self.sent.append(0)
                out.append({"index": i, "id": self.ids[i], "type": "function",
                            "function": {"name": name, "arguments": ""}})
            if len(args) > self.sent[i]:
                out.append({"index": i, "function": {"arguments": args[self.sent[i]:]}})
                self.sent[i] = len(args)
        return out

    def begun(self, text: str) -> list[tuple[str, str]]:
        """(name, arguments so far) of every call begun in `text`."""
        if self.plan.mode == "named":
            return [(self.plan.named, text)]
        calls, at = [], 0
        while (m := _HEAD.search(text, at)) is not None:
            end = value_end(text, m.end())
            calls.append((_unescape(m.group(1)), text[m.end():end]))
            if end is None:
                break
            at = end
        return calls
