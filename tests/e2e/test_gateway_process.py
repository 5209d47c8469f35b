"""`tandem gateway` as a real process, the way a Deployment runs it: --require-api-keys,
REDIS_PASSWORD against a `redis-server --requirepass`, --metrics-port, --host=:: (dual stack),
SIGUSR1 (/health 503) and SIGTERM (open streams finish within --shutdown-grace-s).

The gateway dials a scripted VerifyService (grpc.aio on a loop thread) that streams a known
text one token at a time, slowly enough for signals to land mid-stream.
"""
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import httpx
import pytest

from tandem.netaddr import has_ipv6_loopback
from tandem.redis_server import start_redis
from tandem.v1 import common_pb2, verify_pb2, verify_pb2_grpc
from tools.launcher import free_port, http_healthy

pytestmark = pytest.mark.e2e
MODEL = "tandem-test"
TEXT = "One two three four five six seven eight nine ten."




class SlowVerifier(verify_pb2_grpc.VerifyServiceServicer):
    """Streams `ids` one token per `delay` seconds, resuming after the committed ones."""

    def __init__(self, ids: list[int], delay: float):
        self.ids, self.delay = ids, delay

    async def Generate(self, request, context):  # noqa: N802 (gRPC method name)
        done = len(request.committed_token_ids)
        for i, tok in enumerate(self.ids[done:], start=done + 1):
            await asyncio.sleep(self.delay)
            last = i == len(self.ids)
            yield verify_pb2.GenerateResponse(
                token_ids=[tok], num_committed=i, totals=verify_pb2.SessionStats(rounds=i),
                finish_reason=verify_pb2.FINISH_REASON_LENGTH if last else 0)

    async def Info(self, request, context):  # noqa: N802
        return common_pb2.WorkerInfo(role=common_pb2.WORKER_ROLE_VERIFIER, model_id=MODEL,
                                     max_sessions=8, max_context_length=2048)


@pytest.fixture(scope="module")
def verifier(tokenizer):
    """(address, token count) of a SlowVerifier streaming TEXT at 0.15 s a token."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def start():
        server = grpc.aio.server()
        verify_pb2_grpc.add_VerifyServiceServicer_to_server(SlowVerifier(ids, 0.15), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    yield f"127.0.0.1:{port}", len(ids)
    asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)


def gateway_cmd(target_paths, redis_url: str, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tools.cli", "gateway", "--model", str(target_paths.root),
            "--served-model-name", MODEL, "--redis-url", redis_url, "--port", str(port), *extra]


def clean_env(**extra: str) -> dict:
    drop = ("REDIS_PASSWORD", "TANDEM_API_KEYS", "TANDEM_API_KEYS_FILE",
            "TANDEM_REQUIRE_API_KEYS", "TANDEM_GATEWAY_METRICS_PORT", "TANDEM_GATEWAY_HOST")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


class Gateway:
    """A started gateway process; stop() kills what is left of it."""

    def __init__(self, cmd: list[str], env: dict, url: str):
        self.url = url
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not http_healthy(url + "/health"):
            if self.proc.poll() is not None:
                raise AssertionError(f"gateway exited {self.proc.returncode}: "
                                     f"{self.proc.stderr.read()[-2000:]}")
            assert time.monotonic() < deadline, "gateway not healthy after 120 s"
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def completion_stream(url: str, lines: list, errors: list | None = None) -> None:
    """POST a streaming completion; every SSE data line lands in `lines` as it arrives, and a
    connection cut short in `errors` (when given)."""
    body = {"model": MODEL, "prompt": "Count.", "max_tokens": 64, "stream": True,
            "speculation": {"method": "none"}}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
    except httpx.TransportError as exc:
        if errors is None:
            raise
        errors.append(exc)


def streamed_text(lines: list) -> str:
    return "".join(json.loads(x)["choices"][0]["text"] for x in lines
                   if x != "[DONE]" and json.loads(x)["choices"])


def test_require_api_keys_without_a_key_exits_2_with_one_line(target_paths):
    proc = subprocess.run(gateway_cmd(target_paths, "redis://127.0.0.1:1/0", free_port()),
                          env=clean_env(TANDEM_REQUIRE_API_KEYS="1"), capture_output=True,
                          text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "--require-api-keys" in lines[0] and "--api-keys-file" in lines[0]


def test_a_redis_password_missing_is_exit_2_and_never_printed(target_paths):
    with start_redis(password="pw-e2e-1") as redis:
        proc = subprocess.run(gateway_cmd(target_paths, redis.url, free_port()),
                              env=clean_env(), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "REDIS_PASSWORD" in proc.stderr, proc.stderr
        proc = subprocess.run(gateway_cmd(target_paths, redis.url, free_port()),
                              env=clean_env(REDIS_PASSWORD="pw-wrong"), capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2 and "password was refused" in proc.stderr
        assert "pw-wrong" not in proc.stderr


def test_metrics_port_password_and_dual_stack(target_paths, verifier):
    """--metrics-port: /metrics there only; REDIS_PASSWORD used; --host=:: takes v4 and v6."""
    v6 = has_ipv6_loopback()
    port, mport = free_port(), free_port()
    with start_redis(password="pw-e2e-2") as redis:
        gw = Gateway(gateway_cmd(target_paths, redis.url, port, "--verifier", verifier[0]),
                     clean_env(REDIS_PASSWORD="pw-e2e-2", TANDEM_GATEWAY_METRICS_PORT=str(mport),
                               TANDEM_GATEWAY_HOST="::" if v6 else "0.0.0.0"),
                     f"http://127.0.0.1:{port}")
        try:
            health = httpx.get(gw.url + "/health", timeout=10).json()
            assert health["redis"] == "ok" and health["verifiers"] == 1  # authenticated
            lines: list = []
            completion_stream(gw.url, lines)
            assert streamed_text(lines) == TEXT
            assert httpx.get(gw.url + "/metrics", timeout=10).status_code == 404
            scrape = httpx.get(f"http://127.0.0.1:{mport}/metrics", timeout=10)
            assert scrape.status_code == 200
            assert 'tandem_gateway_requests_total{endpoint="completions"' in scrape.text
            assert httpx.get(f"http://127.0.0.1:{mport}/health", timeout=10).status_code == 404
            if v6:
                assert httpx.get(f"http://[::1]:{port}/health", timeout=10).status_code == 200
                assert httpx.get(f"http://[::1]:{mport}/metrics", timeout=10).status_code == 200
        finally:
            gw.stop()


def test_sigusr1_fails_readiness_sigterm_lets_open_streams_finish(target_paths, verifier):
    port = free_port()
    with start_redis() as redis:
        gw = Gateway(gateway_cmd(target_paths, redis.url, port, "--verifier", verifier[0],
                                 "--shutdown-grace-s", "30"),
                     clean_env(), f"http://127.0.0.1:{port}")
        try:
            assert httpx.get(gw.url + "/metrics", timeout=10).status_code == 200  # default
            gw.proc.send_signal(signal.SIGUSR1)  # `tandem drain`
            deadline = time.monotonic() + 5
            while (r := httpx.get(gw.url + "/health", timeout=10)).status_code != 503:
                assert time.monotonic() < deadline, "/health still 200 after SIGUSR1"
                time.sleep(0.05)
            assert r.json()["status"] == "draining"
            assert httpx.get(gw.url + "/v1/models", timeout=10).status_code == 200  # serving on
            lines: list = []
            stream = threading.Thread(target=completion_stream, args=(gw.url, lines))
            stream.start()
            while len(lines) < 2:  # the stream is under way (~0.15 s a token)
                time.sleep(0.02)
            gw.proc.send_signal(signal.SIGTERM)
            stream.join(30)
            assert lines[-1] == "[DONE]" and streamed_text(lines) == TEXT  # not cut short
            assert gw.proc.wait(30) in (0, -signal.SIGTERM)
            assert not http_healthy(gw.url + "/health", timeout=1)
        finally:
            gw.stop()


def test_the_shutdown_grace_bounds_how_long_a_stream_keeps_the_gateway_alive(
        target_paths, verifier):
    port = free_port()
    with start_redis() as redis:
        gw = Gateway(gateway_cmd(target_paths, redis.url, port, "--verifier", verifier[0]),
                     clean_env(TANDEM_GATEWAY_SHUTDOWN_GRACE_S="0.5"),
                     f"http://127.0.0.1:{port}")
        try:
            lines: list = []
            errors: list = []
            stream = threading.Thread(target=completion_stream, args=(gw.url, lines, errors),
                                      daemon=True)
            stream.start()
            while not lines:
                time.sleep(0.02)
            start = time.monotonic()
            gw.proc.send_signal(signal.SIGTERM)
            gw.proc.wait(20)
            # the text takes ~verifier[1] * 0.15 s; the gateway left well before it ended
            assert time.monotonic() - start < verifier[1] * 0.15
            stream.join(10)
            assert "[DONE]" not in lines and isinstance(errors[0], httpx.RemoteProtocolError)
        finally:
            gw.stop()
