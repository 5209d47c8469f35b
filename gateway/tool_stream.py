"""Streamed tool calls as OpenAI sends them: a call's first delta carries its id, type and
function name (arguments ""), the next ones its arguments text as the model writes it.

The text is what the plan's grammar allows, so its shape is known: a named call is the
arguments alone; "required" a JSON list and "auto" `<tool_call>` blocks of objects whose
keys come in the grammar's order, `{"name": "...", "parameters"|"arguments": <value>}`. A
call's arguments are streamed from the text exactly (they end where that JSON value ends);
the finished text is still parsed by the grammar itself (tool_events) before "tool_calls".

The text is read once: each feed scans only what is new (plus at most one call head's worth
of text still waiting to match), so a long call costs time linear in its length.
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


@dataclass
class _Value:
    """Finds where a JSON value ends, reading the text as it grows (never twice)."""

    start: int
    at: int = -1  # the next character to read
    depth: int = 0
    in_str: bool = False
    escaped: bool = False

    def end(self, text: str) -> int | None:
        """Where the value ends (exclusive), None while it is not finished. A scalar ends
        at the enclosing object's `,` or `}`."""
        at = self.start if self.at < 0 else self.at
        for i, c in enumerate(text[at:], at):
            if self.in_str:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_str = False
                    if self.depth == 0:
                        return i + 1
            elif c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]" and self.depth == 0 or c == "," and self.depth == 0:
                return i
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        self.at = len(text)
        return None


def value_end(text: str, start: int) -> int | None:
    """Where the JSON value starting at text[start] ends (exclusive), None while it is not
    finished."""
    return _Value(start).end(text)


def _unescape(name: str) -> str:
    return json.loads(f'"{name}"') if "\\" in name else name


def _longest_head(plan: ToolPlan) -> int:
    """The most characters a head of one of the plan's calls can take: a head that has not
    matched yet cannot start further back than this from the end of the text."""
    names = plan.names or ("",)
    return len('{"name": ", "parameters": ') + max(len(json.dumps(n)) for n in names)


@dataclass
class _Calls:
    """The calls begun in a growing text: (name, arguments' start, end or None)."""

    longest_head: int
    found: list[list] = field(default_factory=list)  # [name, start, end | None]
    seek: int = 0  # where the next head may start
    value: _Value | None = None  # the arguments being read

    def read(self, text: str) -> None:
        while True:
            if self.value is None:
                m = _HEAD.search(text, self.seek)
                if m is None:  # not there yet: only its last possible start is kept
                    self.seek = max(self.seek, len(text) - self.longest_head + 1)
                    return
                self.found.append([_unescape(m.group(1)), m.end(), None])
                self.value = _Value(m.end())
            end = self.value.end(text)
            if end is None:
                return
            self.found[-1][2] = self.seek = end
            self.value = None


@dataclass
class CallStream:
    """Deltas for a tool-calling text that grows: feed() the whole text so far."""

    plan: ToolPlan
    ids: list[str] = field(default_factory=list)  # per call seen
    sent: list[int] = field(default_factory=list)  # per call: arguments characters sent
    _calls: _Calls | None = None
    _open: int = 0  # the first call whose arguments may still grow

    def feed(self, text: str) -> list[dict]:
        """The new deltas (OpenAI's `delta.tool_calls` entries) since the last feed."""
        if self.plan.mode == "named":
            found = [[self.plan.named, 0, None]]
        else:
            if self._calls is None:
                self._calls = _Calls(_longest_head(self.plan))
            self._calls.read(text)
            found = self._calls.found
        out = []
        for i in range(self._open, len(found)):
            name, start, end = found[i]
            if i == len(self.ids):  # a new call: its head first
                self.ids.append(call_id())
                self.sent.append(0)
                out.append({"index": i, "id": self.ids[i], "type": "function",
                            "function": {"name": name, "arguments": ""}})
            stop = len(text) if end is None else end
            if stop - start > self.sent[i]:
                out.append({"index": i,
                            "function": {"arguments": text[start + self.sent[i]:stop]}})
                self.sent[i] = stop - start
            if end is not None:
                self._open = i + 1  # sent whole: never looked at again
        return out

    def begun(self, text: str) -> list[tuple[str, str]]:
        """(name, arguments so far) of every call begun in `text`."""
        if self.plan.mode == "named":
            return [(self.plan.named, text)]
        calls = _Calls(_longest_head(self.plan))
        calls.read(text)
        return [(name, text[start:end]) for name, start, end in calls.found]
