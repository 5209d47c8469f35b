"""With API keys configured, the API's description and the metrics on the API port need a
key too (issue 47): they were served to anyone."""
from __future__ import annotations

import uuid

import pytest
from fastapi.testclient import TestClient
from test_gateway import make_app

pytestmark = pytest.mark.contract
SECRET = "sk-docs-0123456789"
PATHS = ("/openapi.json", "/docs", "/redoc", "/metrics")


def _client(redis_proc, tokenizer, **kw) -> TestClient:
    return TestClient(make_app(redis_proc, tokenizer, f"docs{uuid.uuid4().hex[:8]}", **kw))


def test_docs_and_metrics_need_a_key_when_keys_are_configured(redis_proc, tokenizer):
    with _client(redis_proc, tokenizer, api_keys=(SECRET,)) as client:
        for path in PATHS:
            for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
                resp = client.get(path, headers=headers)
                assert resp.status_code == 401, (path, headers)
                assert resp.json()["error"]["type"] == "authentication_error"
            assert client.get(path, headers={"Authorization": f"Bearer {SECRET}"}
                              ).status_code == 200, path
        spec = client.get("/openapi.json", headers={"Authorization": f"Bearer {SECRET}"}).json()
        assert "/v1/chat/completions" in spec["paths"]
    with _client(redis_proc, tokenizer) as client:  # without keys they stay open
        for path in PATHS:
            assert client.get(path).status_code == 200, path
