"""tools/bench/sse.py: the one reader of the gateway's streamed chat completions (tools/bench
and benchmarks/)."""
import asyncio
import contextlib
import json

import httpx
import pytest

from tools.bench import sse

pytestmark = pytest.mark.unit

LINES = [": keep-alive", "",
         "data: " + json.dumps({"choices": [{"delta": {"role": "assistant"}}]}),
         "data: " + json.dumps({"choices": [{"delta": {"content": "Hel"}}]}),
         "data: " + json.dumps({"choices": [{"delta": {"tool_calls": [
             {"function": {"name": "f", "arguments": "{\"a\""}}]}}]}),
         "data: " + json.dumps({"choices": [], "usage": {"completion_tokens": 3}}),
         "data: [DONE]"]


def test_chunks_are_the_data_lines_without_done():
    got = list(sse.chunks(LINES))
    assert len(got) == 4 and got[-1]["usage"] == {"completion_tokens": 3}
    assert sse.sse_chunk("data: [DONE]") is None and sse.sse_chunk(": ping") is None
    with pytest.raises(json.JSONDecodeError):  # a broken chunk is not skipped silently
        sse.sse_chunk("data: {oops")


def test_async_chunks_equal_the_sync_ones():
    async def lines():
        for line in LINES:
            yield line

    async def read():
        return [c async for c in sse.achunks(lines())]
    assert asyncio.run(read()) == list(sse.chunks(LINES))


def test_choice_text_content_then_tool_arguments_when_asked():
    choices = [c["choices"][0] for c in list(sse.chunks(LINES))[:3]]
    assert [sse.choice_text(c) for c in choices] == ["", "Hel", ""]
    assert [sse.choice_text(c, tool_arguments=True) for c in choices] == ["", "Hel", "{\"a\""]
    assert sse.choice_text({}) == "" and sse.choice_text({"delta": None}) == ""


def test_chat_stream_posts_the_body_and_reads_its_chunks(monkeypatch):
    seen = {}

    def reply(request: httpx.Request) -> httpx.Response:
        seen.update(url=str(request.url), body=json.loads(request.content),
                    auth=request.headers.get("authorization"))
        return httpx.Response(200, text="\n".join(LINES) + "\n")

    @contextlib.contextmanager
    def stream(method, url, **kw):
        with httpx.Client(transport=httpx.MockTransport(reply)) as client, \
                client.stream(method, url, **kw) as r:
            yield r
    monkeypatch.setattr(sse.httpx, "stream", stream)
    with sse.chat_stream("http://gw", {"stream": True}, timeout=5,
                         headers={"Authorization": "Bearer k"}) as (r, chunks):
        assert r.status_code == 200
        got = list(chunks)
    assert seen == {"url": "http://gw/v1/chat/completions", "body": {"stream": True},
                    "auth": "Bearer k"}
    assert got == list(sse.chunks(LINES))
