"""A request's structured-output fields as one grammar (or none), checked before any token
is generated: response_format, vLLM's structured_outputs (and its older guided_* fields),
and a chat request's tools. The grammar itself is compiled by tandem.grammar."""
from __future__ import annotations

import json
from typing import Any

from gateway import user_json
from gateway.errors import bad_request
from gateway.tools import ToolPlan, tool_plan
from tandem.errors import InvalidArgument
from tandem.grammar import GrammarKind, GrammarSpec

JSON_OBJECT = {"type": "object"}


def constraint(req: Any) -> tuple[GrammarSpec | None, ToolPlan | None]:
    """(the grammar the text must follow, the tool plan when tools may be called)."""
    found = [(name, spec) for name, spec in _asked(req) if spec is not None]
    tools = tool_plan(getattr(req, "tools", None), getattr(req, "tool_choice", None),
                      getattr(req, "parallel_tool_calls", None))
    if tools is not None:
        found.append(("tools", tools.grammar))
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise bad_request(f"{names}: only one structured-output constraint per request",
                          param=found[1][0])
    return (found[0][1] if found else None), tools


def _asked(req: Any) -> list[tuple[str, GrammarSpec | None]]:
    out = [("response_format", _response_format(req.response_format))]
    if req.structured_outputs is not None:
        out.append(("structured_outputs", _structured(req.structured_outputs)))
    for field, kind in (("guided_json", GrammarKind.JSON_SCHEMA),
                        ("guided_regex", GrammarKind.REGEX),
                        ("guided_choice", GrammarKind.CHOICE),
                        ("guided_grammar", GrammarKind.LARK)):
        value = getattr(req, field)
        if value is not None:
            out.append((field, _spec(field, kind, value)))
    return out


def _response_format(rf: Any) -> GrammarSpec | None:
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return GrammarSpec.json_schema(JSON_OBJECT)
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise bad_request("response_format.json_schema.schema: required for type json_schema",
                          param="response_format.json_schema")
    return _spec("response_format.json_schema.schema", GrammarKind.JSON_SCHEMA,
                 rf.json_schema.schema_)


def _structured(so: Any) -> GrammarSpec:
    given = [(name, kind, value) for name, kind, value in (
        ("json", GrammarKind.JSON_SCHEMA, so.json_),
        ("regex", GrammarKind.REGEX, so.regex),
        ("choice", GrammarKind.CHOICE, so.choice),
        ("grammar", GrammarKind.LARK, so.grammar),
        ("json_object", GrammarKind.JSON_SCHEMA, JSON_OBJECT if so.json_object else None),
    ) if value is not None]
    if len(given) != 1:
        raise bad_request("structured_outputs: give exactly one of json, regex, choice, "
                          f"grammar, json_object (got {len(given)})", param="structured_outputs")
    name, kind, value = given[0]
    return _spec(f"structured_outputs.{name}", kind, value)


def _spec(param: str, kind: GrammarKind, value: Any) -> GrammarSpec:
    try:
        if kind is GrammarKind.JSON_SCHEMA and isinstance(value, str):
            # a schema sent as a JSON string (vLLM allows both)
            value = user_json.loads(value, param)
        if kind is GrammarKind.JSON_SCHEMA:
            if not isinstance(value, dict | bool):
                raise InvalidArgument("a JSON schema is an object")
            return GrammarSpec.json_schema(user_json.check_depth(value, param))
        if kind is GrammarKind.CHOICE:
            return GrammarSpec.choice(value)
        return GrammarSpec(kind, value)
    except json.JSONDecodeError as exc:
        raise bad_request(f"{param}: not JSON: {exc}", param=param) from None
    except InvalidArgument as exc:
        raise bad_request(f"{param}: {exc}", param=param) from None
