"""Tool calls: the grammar a request's tools and tool_choice allow, the prompt that shows the
model its tools, and the calls read back from the text by that same grammar.

As vLLM: a named tool_choice constrains the text to that function's arguments; "required" to
a JSON list of {"name", "parameters"} calls; "auto" lets the model answer in text or call
tools in Hermes' `<tool_call>` form, where the grammar captures each call's JSON.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from gateway import user_json
from gateway.errors import bad_request
from tandem.grammar import GrammarKind, GrammarSpec

OPEN, CLOSE = "<tool_call>\n", "\n</tool_call>\n"


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "named", "required" or "auto"
    grammar: GrammarSpec
    names: tuple[str, ...]  # the functions the text may call
    named: str = ""  # mode "named": the function

    def calls(self, text: str, captured: list[str] | None = None) -> list[dict] | None:
        """The tool calls of a finished text (OpenAI's message.tool_calls), None when the
        model answered in text (auto)."""
        if self.mode == "named":
            return [_call(self.named, json.loads(text))]
        if self.mode == "required":
            return [_call(c["name"], c["parameters"]) for c in json.loads(text)]
        if not captured:
            return None
        return [_call(c["name"], c["arguments"]) for c in map(json.loads, captured)]

    def holds(self, text: str) -> bool:
        """Whether streamed text so far may be (the start of) a tool call, so it is held back
        until the end instead of being sent as content."""
        return self.mode != "auto" or OPEN.startswith(text[:len(OPEN)])


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: Any) -> dict:
    return {"id": call_id(), "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def tool_plan(tools: list | None, choice: Any, parallel: bool | None) -> ToolPlan | None:
    """The plan for a chat request's tools; None when no tool may be called."""
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice: needs tools", param="tool_choice")
        return None
    if choice == "none":
        return None
    schemas = {t.function.name: user_json.check_depth(t.function.parameters or {"type": "object"},
                                                      f"tools[{i}].function.parameters")
               for i, t in enumerate(tools)}
    if len(schemas) != len(tools):
        raise bad_request("tools: function names must be unique", param="tools")
    if choice is not None and not isinstance(choice, str):
        name = choice.function.name
        if name not in schemas:
            raise bad_request(f"tool_choice: no tool named {name!r}", param="tool_choice")
        return ToolPlan("named", GrammarSpec.json_schema(schemas[name]), (name,), name)
    if choice == "required":
        item = {"anyOf": [_call_schema(n, s, "parameters") for n, s in schemas.items()]}
        array = {"type": "array", "items": item, "minItems": 1,
                 **({"maxItems": 1} if parallel is False else {})}
        return ToolPlan("required", GrammarSpec.json_schema(array), tuple(schemas))
    calls = {"anyOf": [_call_schema(n, s, "arguments") for n, s in schemas.items()]}
    repeat = "" if parallel is False else "+"
    lark = (f"start: text_reply | tool_call{repeat}\n"
            "text_reply: /[^<](.|\\n)*/\n"
            f"tool_call: {json.dumps(OPEN)} call {json.dumps(CLOSE)}\n"
            f"call[capture]: %json {json.dumps(calls)}\n")
    return ToolPlan("auto", GrammarSpec(GrammarKind.LARK, lark), tuple(schemas))


def _call_schema(name: str, parameters: dict, key: str) -> dict:
    return {"type": "object", "properties": {"name": {"const": name}, key: parameters},
            "required": ["name", key], "additionalProperties": False}


def system_prompt(tools: list, plan: ToolPlan) -> str:
    """What the model is told about its tools (the chat templates served have no tools
    section of their own)."""
    listed = "\n".join(json.dumps({"name": t.function.name,
                                   "description": t.function.description or "",
                                   "parameters": t.function.parameters or {"type": "object"}})
                       for t in tools if t.function.name in plan.names)
    how = {"named": f"Call the function {plan.named} by replying with its arguments as JSON.",
           "required": 'Reply with a JSON list of calls: [{"name": ..., "parameters": ...}].',
           "auto": ("To call a function, reply with <tool_call>\n{\"name\": ..., "
                    "\"arguments\": ...}\n</tool_call>; otherwise answer in text.")}[plan.mode]
    return f"You can call these functions:\n{listed}\n{how}"


def message_text(m: Any) -> str:
    """A chat message as the model sees it: an assistant's earlier tool calls in the form
    the auto grammar writes them."""
    text = m.text()
    for call in m.tool_calls or ():
        try:
            arguments = user_json.loads(call.function.arguments, "messages")
        except json.JSONDecodeError:
            raise bad_request("messages: a tool call's arguments must be a JSON string",
                              param="messages") from None
        text += OPEN + json.dumps({"name": call.function.name, "arguments": arguments}) + CLOSE
    return text
