"""Request text never reaches the gateway's logs (issue 47): a prompt, a schema or a tool
call's arguments carrying a marker, through the paths that log (an unexpected error, tool
calls whose two readings differ), leave sizes, ids and types in the log, never the marker."""
from __future__ import annotations

import asyncio
import logging
import uuid

import httpx
import pytest
from test_gateway import MODEL, make_app, uvicorn_server

import gateway.app
from gateway.generation import Finished, TextDelta
from gateway.tool_events import ToolCallDeltas, with_tool_calls
from gateway.tools import ToolPlan
from tandem.grammar import GrammarSpec

pytestmark = pytest.mark.contract
MARKER = "zq-secret-marker-7731"


@pytest.fixture()
def logs(caplog):
    """Every record, the server's own (uvicorn does not propagate to the root) included."""
    server = logging.getLogger("uvicorn")
    server.addHandler(caplog.handler)
    caplog.set_level(logging.DEBUG)
    yield caplog
    server.removeHandler(caplog.handler)


def test_an_unexpected_error_logs_its_type_not_the_request(redis_proc, tokenizer, logs,
                                                          monkeypatch):
    async def broken(req, *args, **kwargs):  # a bug whose message quotes the request
        raise ValueError(f"cannot plan {req.messages[0].content!r}")

    monkeypatch.setattr(gateway.app, "build_plan", broken)
    app = make_app(redis_proc, tokenizer, f"logs{uuid.uuid4().hex[:8]}")
    with uvicorn_server(app) as url:
        resp = httpx.post(url + "/v1/chat/completions", timeout=10, json={
            "model": MODEL, "max_tokens": 3,
            "messages": [{"role": "user", "content": f"hello {MARKER}"}]})
    assert resp.status_code == 500
    assert resp.json()["error"]["message"] == "internal error: ValueError"
    assert MARKER not in logs.text
    assert "ValueError" in logs.text and "broken" in logs.text  # the type and where


def test_differing_tool_call_readings_log_sizes_not_arguments(logs, monkeypatch):
    plan = ToolPlan("named", GrammarSpec.json_schema({"type": "object"}), ("f",), "f")
    text = f'{{"q": "{MARKER}"}}'
    # the grammar's reading differs from the streamed one (a bug worth a log line)
    monkeypatch.setattr(ToolPlan, "calls", lambda self, text, captured=None: [
        {"id": "c", "type": "function",
         "function": {"name": "f", "arguments": f'{{"q": "other {MARKER}"}}'}}])

    async def events():
        yield TextDelta(text, tokens=1)
        yield Finished("stop", 1, {})

    async def run():
        return [ev async for ev in with_tool_calls(events(), plan, None, stream=True)]

    out = asyncio.run(run())
    assert isinstance(out[0], ToolCallDeltas) and out[-1].finish_reason == "tool_calls"
    assert MARKER not in logs.text
    assert "differ" in logs.text and "chars" in logs.text
