"""JSON nested thousands deep inside a request (a schema as a string, a tool call's
arguments) is a 400 that says so, not a RecursionError answered as a 500 (issue 47)."""
from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from fastapi.testclient import TestClient
from test_gateway import MODEL, FakeVerifier, LoopThread, continue_text, make_app

from gateway.generation import Finished, TextDelta
from gateway.tool_events import with_tool_calls
from gateway.tools import ToolPlan
from gateway.user_json import MAX_DEPTH
from tandem.grammar import GrammarSpec

pytestmark = pytest.mark.contract
USER = [{"role": "user", "content": "x"}]


def deep(levels: int) -> str:
    return "[" * levels + "]" * levels


def deep_schema(levels: int) -> str:
    """A schema (as text) whose own nesting is 2 * levels + 1."""
    return '{"type": "object", "properties": {"a": ' * levels + "{}" + "}}" * levels


def call_message(arguments: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}


@pytest.fixture(scope="module")
def client(redis_proc, tokenizer):
    loop = LoopThread()
    fake = FakeVerifier(continue_text(tokenizer.encode("hi", add_special_tokens=False)))
    loop.run(fake.start())
    app = make_app(redis_proc, tokenizer, f"nest{uuid.uuid4().hex[:8]}",
                   static_verifiers=(fake.address,))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c
    loop.run(fake.server.stop(None))
    loop.close()


@pytest.mark.parametrize("field, extra", [
    ("guided_json", {"guided_json": deep_schema(3000)}),
    ("guided_json", {"guided_json": '{"type": "array", "x": ' + deep(5000) + "}"}),
    ("structured_outputs.json", {"structured_outputs": {"json": deep_schema(3000)}}),
    ("messages", {"messages": USER + [call_message(deep(5000)), *USER]}),
])
def test_deeply_nested_json_text_in_a_request_is_a_400(client, field, extra):
    resp = client.post("/v1/chat/completions",
                       json={"model": MODEL, "messages": USER, "max_tokens": 3, **extra})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == field and error["code"] == "nested_too_deeply"
    assert f"nested more than {MAX_DEPTH} levels" in error["message"]


@pytest.mark.parametrize("field, extra", [
    ("response_format.json_schema.schema",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": "@"}}}),
    ("guided_json", {"guided_json": {"type": "object", "properties": {"a": "@"}}}),
    ("tools[0].function.parameters",
     {"tools": [{"type": "function", "function": {"name": "f", "parameters": "@"}}]}),
])
def test_deeply_nested_schemas_in_a_request_are_a_400(client, field, extra):
    """Schemas as JSON values, as deep as a body may be (json.dumps would fail on them)."""
    body = json.dumps({"model": MODEL, "messages": USER, "max_tokens": 3, **extra})
    resp = client.post("/v1/chat/completions", content=body.replace('"@"', deep_schema(150)),
                       headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == field and error["code"] == "nested_too_deeply"


def test_the_limit_is_max_depth_levels(client):
    def post(levels):
        args = json.dumps(json.loads(deep(levels)))
        return client.post("/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 3, "messages": USER + [call_message(args), *USER]})

    assert post(MAX_DEPTH).status_code == 200
    assert post(MAX_DEPTH + 1).status_code == 400


def test_a_call_the_model_nested_too_deeply_is_answered_as_text():
    """A schema that allows any JSON lets the model nest past what Python can read back."""
    plan = ToolPlan("named", GrammarSpec.json_schema({}), ("f",), "f")
    text = deep(20000)

    async def events():
        yield TextDelta(text, tokens=1)
        yield Finished("stop", 1, {})

    async def run():
        return [ev async for ev in with_tool_calls(events(), plan, None)]

    out = asyncio.run(run())
    assert [type(ev) for ev in out] == [TextDelta, Finished]
    assert out[0].text == text and out[1].finish_reason == "stop"
