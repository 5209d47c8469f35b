"""Streamed tool calls: deltas read from a growing text, joined back, are the calls the text
holds, however the text is cut into pieces."""
import json
import random

import pytest

from gateway.schemas import ChatCompletionRequest
from gateway.tool_stream import CallStream, value_end
from gateway.tools import CLOSE, OPEN, tool_plan

pytestmark = pytest.mark.unit
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
         for n in ("get_weather", "get_time")]
TRICKY = {"q": 'a "quoted" {brace} \\ and, comma', "n": [1, {"x": [2, 3]}], "u": "é"}


def _plan(choice):
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                tools=TOOLS, tool_choice=choice)
    return tool_plan(req.tools, req.tool_choice, None)


def _join(deltas):
    calls = {}
    for d in deltas:
        c = calls.setdefault(d["index"], {"arguments": ""})
        if "id" in d:
            assert d["type"] == "function" and d["function"]["arguments"] == ""
            c.update(id=d["id"], name=d["function"]["name"])
        c["arguments"] += d["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]


def _stream(plan, text, seed):
    """Feed `text` in random pieces; the joined deltas."""
    rng, stream, deltas, at = random.Random(seed), CallStream(plan), [], 0
    while at < len(text):
        at = min(len(text), at + rng.randint(1, 5))
        deltas += stream.feed(text[:at])
    return _join(deltas)


def _dumps(v):
    return json.dumps(v, ensure_ascii=False)


@pytest.mark.parametrize("seed", range(5))
def test_every_mode_streams_the_calls_it_holds(seed):
    args = [TRICKY, {"zone": "UTC"}]
    named = _stream(_plan({"type": "function", "function": {"name": "get_time"}}),
                    _dumps(TRICKY), seed)
    assert [(c["name"], json.loads(c["arguments"])) for c in named] == [("get_time", TRICKY)]
    required = _dumps([{"name": "get_weather", "parameters": args[0]},
                       {"name": "get_time", "parameters": args[1]}])
    auto = "".join(OPEN + _dumps({"name": n, "arguments": a}) + CLOSE
                   for n, a in zip(("get_weather", "get_time"), args))
    for choice, text in (("required", required), ("auto", auto)):
        calls = _stream(_plan(choice), text, seed)
        assert [c["name"] for c in calls] == ["get_weather", "get_time"]
        assert [c["arguments"] for c in calls] == [_dumps(a) for a in args]  # exactly the text
        assert len({c["id"] for c in calls}) == 2


def test_a_call_cut_short_streams_what_was_written():
    text = OPEN + '{"name": "get_weather", "arguments": {"city": "Ro'
    calls = _stream(_plan("auto"), text, 0)
    assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == '{"city": "Ro'


def test_a_head_is_sent_only_once_its_name_is_whole():
    stream = CallStream(_plan("required"))
    assert stream.feed('[{"name": "get_wea') == []
    first = stream.feed('[{"name": "get_weather", "parameters": ')
    assert [d["function"]["name"] for d in first] == ["get_weather"]


@pytest.mark.parametrize("text, end", [
    ('{"a": 1}', 8), ('[1, [2]]', 8), ('"x}"', 4), ('"a\\"b"', 6), ('12}', 2), ('true, ', 4),
    ('{"a": "}"', None), ('{"a": [', None), ('"abc', None)])
def test_value_end(text, end):
    assert value_end(text, 0) == end
