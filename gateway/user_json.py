"""JSON a request carries inside it (a schema, a schema sent as a string, a tool call's
arguments), bounded in nesting before anything walks it.

Python's json and every recursive walk of a value (json.dumps, the grammar's spec) recurse
once per level: a value nested thousands deep raises RecursionError, a 500. Nothing real
needs more than MAX_DEPTH levels (llguidance, which compiles the schemas, stops at 128 too).
"""
from __future__ import annotations

import json
from typing import Any

from gateway.errors import APIError, bad_request

MAX_DEPTH = 128


def too_deep(param: str) -> APIError:
    return bad_request(f"{param}: JSON nested more than {MAX_DEPTH} levels deep",
                       param=param, code="nested_too_deeply")


def check_depth(value: Any, param: str) -> Any:
    """`value` itself, or a 400 naming `param` when it nests more than MAX_DEPTH levels.
    Iterative: the check must not recurse itself."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        if depth > MAX_DEPTH:
            raise too_deep(param)
        stack.extend((c, depth + 1) for c in v if isinstance(c, dict | list))
    return value


def loads(text: str, param: str) -> Any:
    """The JSON value of a request's `param`; a 400 naming it when nested too deeply
    (JSONDecodeError is raised as json.loads does: callers word that one)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise too_deep(param) from None
    return check_depth(value, param)
