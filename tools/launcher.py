"""`tandem up`: a whole local cluster as separate processes, healthy before it says so.

Redis (started here unless REDIS_URL is given), one or more verifiers, N draft workers and the
gateway, each its own `tandem <role>` process registering itself in Redis. Every child that
exits is started again, with backoff, until one keeps dying (tools/supervisor.py). Our own
Redis listens on loopback alone and needs a password made for this launch. Ctrl-C or SIGTERM
stops everything (the workers drain first).
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.models import DEFAULT_TARGET, resolve_model
from tandem.netaddr import free_port, join_host_port
from tandem.redis_conn import PASSWORD_ENV
from tandem.tls import TlsConfig, open_sync_channel, tls_args
from tools.cluster_config import ClusterConfig
from tools.supervisor import ClusterFailed, RestartPolicy, restart_dead

STARTUP_TIMEOUT_S = 180.0


def _dialable(host: str) -> str:
    """Where to reach a server bound to `host` from this machine (not the wildcard)."""
    return "127.0.0.1" if host.strip("[]") in ("0.0.0.0", "::", "") else host


def grpc_healthy(address: str, timeout: float = 1.0, tls: TlsConfig | None = None) -> bool:
    try:
        with open_sync_channel(address, tls) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                        timeout=timeout)
        return resp.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def http_healthy(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200
    except OSError:
        return False


class Cluster:
    """Owns the child processes; `stop()` terminates them in reverse start order."""

    def __init__(self, config: ClusterConfig, log=print, env: dict | None = None,
                 output=None):
        self.config, self.log = config, log
        self.env = env or {}  # extra environment for the children (e.g. OTEL_*)
        self.output = output  # children's stdout/stderr (None = inherit)
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.args: dict[str, list[str]] = {}  # child name -> its command line, for restarts
        self.policy = RestartPolicy()  # when a dead child starts again, when to give up
        self.addresses: dict[str, str] = {}  # worker name -> host:port
        self.metrics_urls: dict[str, str] = {}
        self.stack = ExitStack()
        self.redis_url = config.redis_url
        self.redis = None  # the RedisProcess we started (None when REDIS_URL was given)
        gateway = join_host_port(_dialable(config.gateway_host), config.gateway_port)
        self.gateway_url = f"http://{gateway}"

    @property
    def redis_password(self) -> str:
        """Our own Redis's password ("" when REDIS_URL was given)."""
        return self.redis.password if self.redis is not None else ""

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        self.args[name] = args
        proc = self._popen(args)
        self.procs.append((name, proc))
        return proc

    def _popen(self, args: list[str]) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "tools.cli", *args]
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        return subprocess.Popen(cmd, env=env, start_new_session=True,
                                stdout=self.output, stderr=self.output)

    def _wait(self, name: str, proc: subprocess.Popen, check) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not check():
            if proc.poll() is not None:
                raise ClusterFailed(f"{name} exited with code {proc.returncode} during startup")
            if time.monotonic() > deadline:
                raise ClusterFailed(f"{name} not healthy after {STARTUP_TIMEOUT_S:.0f} s")
            time.sleep(0.3)
        self.log(f"  {name} healthy")

    def start(self) -> None:
        cfg = self.config
        if not self.redis_url:
            from tandem.redis_server import start_redis

            # Loopback only, and a password new each launch: another local user or a page in
            # a browser must not read or fill the cluster's state. Passed in the children's
            # environment (a command line shows in ps).
            password = secrets.token_urlsafe(24)
            self.redis = self.stack.enter_context(start_redis(password=password))
            self.redis_url = self.redis.url
            self.env = {**self.env, PASSWORD_ENV: password}
            self.log(f"  redis-server on {self.redis.url} (password in {PASSWORD_ENV})")
        common = ["--redis-url", self.redis_url, f"--host={cfg.worker_host}",
                  *tls_args(cfg.tls), *cfg.placement_args()]
        host = _dialable(cfg.worker_host)
        # Groups start together (imports, loads overlap), each healthy before the next: draft
        # workers (verifiers link to them), then verifiers with the gateway (it needs none).
        drafts = []
        for i in range(cfg.num_drafts):
            port, mport = free_port(host), free_port(host)
            extra = [*self._draft_args(), *cfg.draft_args, "--metrics-port", str(mport)]
            drafts.append(self._start_worker(
                f"draft-{i}", ["draft", "--port", str(port), "--threads", str(cfg.threads),
                               *common, *extra], port, mport))
        self._wait_all(drafts)
        verifiers = []
        for i in range(cfg.num_verifiers):
            port, mport = free_port(host), free_port(host)
            extra = [*(["--model", cfg.model] if cfg.model else []), "--metrics-port",
                     str(mport), *self._eagle3_args()[0], *cfg.verifier_args]
            verifiers.append(self._start_worker(
                f"verifier-{i}", ["verifier", "--port", str(port), "--threads",
                                  str(cfg.verifier_thread_count()), "--narrow-threads", "1",
                                  *common, *extra], port, mport))
        gateway = self._start_gateway()
        self._wait_all(verifiers)
        self._wait(f"gateway ({self.gateway_url})", gateway,
                   lambda: http_healthy(self.gateway_url + "/health"))
        self.metrics_urls["gateway"] = self.gateway_url + "/metrics"
        for name, url in self.metrics_urls.items():
            self.log(f"  metrics of {name}: {url}")

    def _start_gateway(self) -> subprocess.Popen:
        cfg = self.config
        extra = (["--model", cfg.model] if cfg.model else []) + (
            ["--method-preference", cfg.method_preference] if cfg.method_preference else [])
        return self._spawn("gateway", ["gateway", "--host", cfg.gateway_host, "--port",
                                       str(cfg.gateway_port), "--redis-url", self.redis_url,
                                       "--auto-model-drafts", "off",  # one host: shared cores
                                       *tls_args(cfg.tls, serves=False), *extra,
                                       *cfg.gateway_args])

    def _draft_args(self) -> list[str]:
        """A draft worker's model flags. The shipped draft and head belong to the default
        target: for another target the workers name the target's tokenizer so that its
        verifiers pair with them, and draft by token history alone, or with --draft-model
        (bridged when its tokenizer is another: tandem/proposers/bridged.py)."""
        cfg = self.config
        if cfg.model and cfg.model not in ("default", DEFAULT_TARGET):
            return ["--model", cfg.draft_model or "none", "--eagle", cfg.eagle or "none",
                    "--tokenizer", str(resolve_model(cfg.model).root)]
        return (["--model", cfg.draft_model] if cfg.draft_model else []) + (
            ["--eagle", cfg.eagle] if cfg.eagle else []) + self._eagle3_args()[1]

    def _eagle3_args(self) -> tuple[list[str], list[str]]:
        """(verifier, draft worker) flags for a published EAGLE-3 head (--eagle): the
        verifiers ship its three layers (and so run no Medusa heads); the workers name the
        target, whose embedding it may need."""
        from tandem.engine.eagle3_published import is_eagle3, layer_ids_of

        eagle = self.config.eagle
        if not eagle or eagle == "none" or not is_eagle3(Path(eagle)):
            return [], []
        ids = layer_ids_of(json.loads((Path(eagle) / "config.json").read_text()))
        layers = ",".join(map(str, ids)) if ids else "eagle3"
        target = str(resolve_model(self.config.model or DEFAULT_TARGET).root)
        return (["--eagle-feature-layers", layers, "--medusa", "off"],
                ["--tokenizer", target] if self.config.model in ("", "default",
                                                                 DEFAULT_TARGET) else [])

    def _start_worker(self, name: str, args: list[str], port: int, metrics_port: int):
        """Spawned, not waited for: (label, process, health check) for _wait_all."""
        host = _dialable(self.config.worker_host)
        self.metrics_urls[name] = f"http://{join_host_port(host, metrics_port)}/metrics"
        address = self.addresses[name] = join_host_port(host, port)
        proc = self._spawn(name, args)
        return (f"{name} ({address})", proc,
                lambda: grpc_healthy(address, tls=self.config.tls))

    def _wait_all(self, started) -> None:
        for label, proc, check in started:
            self._wait(label, proc, check)

    def stop(self) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.log(f"  {name} did not drain in time; killing it")
                proc.kill()
                proc.wait()
        self.procs.clear()
        self.stack.close()

    def _children(self) -> list:
        """(name, why it is dead or None, restart) for every child we started."""
        out = []
        if self.redis is not None:
            redis = self.redis
            out.append(("redis-server", lambda: None if redis.is_running() else "died",
                        redis.restart))
        for i, (name, proc) in enumerate(self.procs):
            out.append((name, lambda p=proc: None if p.poll() is None
                        else f"exited with code {p.returncode}",
                        lambda i=i, name=name: self._respawn(i, name)))
        return out

    def _respawn(self, index: int, name: str) -> None:
        self.procs[index] = (name, self._popen(self.args[name]))

    def supervise(self, clock=time.monotonic) -> list[str]:
        """Start again every child that died, each after a backoff that doubles per restart
        in a row (1 s to 30 s); the names restarted. Meanwhile the others ride it out: the
        verifiers serve plainly without draft workers, the gateway routes to the verifiers
        left, everyone re-registers in a Redis restarted empty. Raises ClusterFailed when one
        child keeps dying (tools.supervisor)."""
        return restart_dead(self._children(), self.policy, self.log, clock)

    def wait(self) -> None:
        """Keep every child running until signalled (KeyboardInterrupt) or one keeps dying."""
        while True:
            self.supervise()
            time.sleep(0.5)


def demo_completion(gateway_url: str, prompt: str, max_tokens: int = 48) -> tuple[str, dict]:
    """The reply's text and body: a chat message, or, for a model without a chat template (a
    base model: chat is a 400), the prompt continued by /v1/completions."""
    def post(path: str, body: dict) -> dict:
        req = urllib.request.Request(gateway_url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as resp:
            return json.loads(resp.read())

    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": max_tokens, "temperature": 0}
    try:
        reply = post("/v1/chat/completions",
                     {**body, "messages": [{"role": "user", "content": prompt}]})
        return reply["choices"][0]["message"]["content"], reply
    except urllib.error.HTTPError as exc:
        if exc.code != 400 or b"chat_template_missing" not in exc.read():
            raise
    reply = post("/v1/completions", {**body, "prompt": prompt})
    return prompt + reply["choices"][0]["text"], reply
