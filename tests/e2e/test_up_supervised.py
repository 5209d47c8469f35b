"""`tandem up`'s cluster heals: a killed verifier or gateway is started again by the
launcher's supervision and the cluster serves again; its private Redis listens on loopback
alone and refuses a client without the launch's password (issue 47). Real processes:
redis-server, one lean verifier, the gateway."""
import os
import signal
import time

import httpx
import pytest
import redis

from tools.launcher import Cluster, ClusterConfig, free_port

pytestmark = pytest.mark.e2e
LEAN = {"TANDEM_VERIFIER_CALIBRATE_REPS": "0", "TANDEM_VERIFIER_KV_CACHE_MB": "64",
        "TANDEM_VERIFIER_LAYER_SKIP": "off", "TANDEM_VERIFIER_MEDUSA": "off"}


@pytest.fixture(scope="module")
def cluster(target_paths):
    lines: list[str] = []
    c = Cluster(ClusterConfig(num_drafts=0, num_verifiers=1, gateway_port=free_port(),
                              model=str(target_paths.root), threads=1),
                log=lines.append, env=LEAN)
    c.lines = lines
    try:
        c.start()
        yield c
    finally:
        c.stop()


def supervise_until(cluster, ready, timeout_s: float = 120.0) -> bool:
    """Run what `tandem up`'s wait() runs every 0.5 s until ready() holds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        cluster.supervise()
        try:
            if ready():
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return False


def health(cluster) -> dict:
    r = httpx.get(cluster.gateway_url + "/health", timeout=5)
    return r.json() if r.status_code == 200 else {}


def complete(cluster) -> str:
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 4, "temperature": 0,
            "speculation": {"method": "none"},
            "messages": [{"role": "user", "content": "Say hi."}]}
    r = httpx.post(cluster.gateway_url + "/v1/chat/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def test_private_redis_needs_the_launch_password_and_listens_on_loopback(cluster):
    assert len(cluster.redis_password) >= 20
    assert cluster.redis_password not in cluster.redis_url  # not on any command line
    anonymous = redis.Redis.from_url(cluster.redis_url)
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    client = redis.Redis.from_url(cluster.redis_url, password=cluster.redis_password)
    assert client.config_get("bind")["bind"] == "127.0.0.1"
    # every child got the password: the verifier registered, the gateway reads Redis
    assert client.smembers("tandem:workers:verifier")
    assert health(cluster)["redis"] == "ok"


def test_a_killed_verifier_then_gateway_are_restarted_and_the_cluster_serves(cluster):
    reference = complete(cluster)
    verifier = dict(cluster.procs)["verifier-0"]
    os.kill(verifier.pid, signal.SIGKILL)
    verifier.wait()
    assert supervise_until(cluster, lambda: dict(cluster.procs)["verifier-0"] is not verifier)
    assert any(m.startswith("  verifier-0 exited with code -9; starting it again")
               for m in cluster.lines)
    # the new verifier loads, registers with the password, and the gateway routes to it
    assert supervise_until(cluster, lambda: complete(cluster) == reference)
    gateway = dict(cluster.procs)["gateway"]
    os.kill(gateway.pid, signal.SIGKILL)
    gateway.wait()
    assert supervise_until(cluster, lambda: health(cluster).get("verifiers") == 1, 60)
    assert dict(cluster.procs)["gateway"] is not gateway
    assert complete(cluster) == reference
