"""Streamed tool calls are read once: a feed scans only its new text, so a long call costs
time linear in its length (it re-scanned the whole text per delta: 9.3 s of gateway CPU
for a 32 KB call), and the deltas are those of a reader that re-scans everything."""
import json
import random
import re

import pytest

from gateway.schemas import ChatCompletionRequest
from gateway.tool_stream import CallStream
from gateway.tools import CLOSE, OPEN, tool_plan

pytestmark = pytest.mark.unit
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
         for n in ("get_weather", "get_time")]
_HEAD = re.compile(r'\{"name": "((?:[^"\\]|\\.)*)", "(?:parameters|arguments)": ')


def _plan(choice):
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                tools=TOOLS, tool_choice=choice)
    return tool_plan(req.tools, req.tool_choice, None)


def _reference(plan, text):
    """The calls begun in `text`, read from its start every time (the old reader)."""
    if plan.mode == "named":
        return [(plan.named, text)]
    calls, at = [], 0
    while (m := _HEAD.search(text, at)) is not None:
        depth, in_str, esc, end = 0, False, False, None
        for i in range(m.end(), len(text)):
            c = text[i]
            if in_str:
                esc, in_str = (False, in_str) if esc else (c == "\\", c != '"')
                if not in_str and depth == 0:
                    end = i + 1
                    break
            elif c == '"':
                in_str = True
            elif c in "{[":
                depth += 1
            elif depth == 0 and c in "}],":
                end = i
                break
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    end = i + 1
                    break
        calls.append((m.group(1), text[m.end():end]))
        if end is None:
            break
        at = end
    return calls


class Counted(str):
    """A text that counts the characters read from it by index or slice."""

    read = 0

    def __getitem__(self, key):
        got = str.__getitem__(self, key)
        Counted.read += len(got)
        return got


def _big_args(size):
    rng = random.Random(size)
    items = [{"k": i, "s": 'x "q" \\ {[,' * rng.randint(0, 3), "n": [i, {"d": [1.5, None]}]}
             for i in range(size // 60)]
    return {"items": items, "tail": True}


def _texts(size):
    big = _big_args(size)
    dumps = lambda v: json.dumps(v, ensure_ascii=False)  # noqa: E731
    return {
        "named": dumps(big),
        "required": dumps([{"name": "get_weather", "parameters": big},
                           {"name": "get_time", "parameters": 7},
                           {"name": "get_time", "parameters": "a,}b"}]),
        "auto": "".join(OPEN + dumps({"name": n, "arguments": a}) + CLOSE
                        for n, a in (("get_time", big), ("get_weather", {"c": "Rome"}),
                                     ("get_time", False))),
    }


def _choice(mode):
    return {"type": "function", "function": {"name": "get_time"}} if mode == "named" else mode


@pytest.mark.parametrize("mode", ["named", "required", "auto"])
def test_deltas_are_those_of_the_reader_that_rescans(mode):
    plan, text = _plan(_choice(mode)), _texts(2000)[mode]
    rng, stream, at = random.Random(3), CallStream(plan), 0
    joined: dict[int, list] = {}
    while at < len(text):
        at = min(len(text), at + rng.randint(1, 9))
        for d in stream.feed(text[:at]):
            call = joined.setdefault(d["index"], [d["function"].get("name"), ""])
            call[1] += d["function"]["arguments"]
        # after every feed: exactly what the re-scanning reader reads so far
        assert [tuple(joined[i]) for i in sorted(joined)] == _reference(plan, text[:at])
    assert stream.begun(text) == _reference(plan, text)


@pytest.mark.parametrize("mode", ["named", "required", "auto"])
def test_a_long_call_is_read_once(mode):
    plan, text = _plan(_choice(mode)), _texts(8000)[mode]
    assert len(text) > 6000
    stream, Counted.read = CallStream(plan), 0
    for at in range(4, len(text) + 4, 4):  # 4 characters a delta, as a model writes
        stream.feed(Counted(text[:at]))
    # linear: each character read a bounded number of times (re-scanning: ~len/8 times)
    assert Counted.read <= 3 * len(text), Counted.read
