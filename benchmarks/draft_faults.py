"""A slow and a partitioned draft worker: decoding keeps plain speed, and drafts return after.

    python benchmarks/draft_faults.py [--requests 4] [--max-tokens 48] [--delay-ms 300]
                                      [--prompts copy|chat] [--method ngram|draft_model]

Real processes on loopback: redis, one verifier, the gateway (tools.launcher) and one draft
worker that registers a TCP proxy's address as its own, so every verifier->draft byte crosses
the proxy. Phases, each with --method (k = 4; ngram drafts on the worker here, over the
proxied link) and plain requests interleaved:
  healthy      the proxy forwards
  slow         every chunk waits --delay-ms before it is forwarded (a slow draft)
  partitioned  nothing is forwarded or closed: the connection is black-holed
  healed       forwarding again (what was held is delivered)
Per phase: tokens/s, the worst inter-token gap, drafted and accepted tokens, errors. The claim:
speculating requests stay near plain speed in every phase (no stall past the verifier's draft
wait), and drafts are accepted again once healed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from tools.bench.copy_prompts import PROMPTS as COPY_PROMPTS
from tools.bench.sse import chat_stream, choice_text
from tools.launcher import Cluster, ClusterConfig, free_port, grpc_healthy

CHAT = ["Explain how a bicycle works.", "Write a short story about a lighthouse keeper.",
        "List the planets of the solar system with one fact each."]
# Copy tasks: the draft model agrees with the target there (~0.8), so a draft that is
# back but not used shows; on chat it agrees ~0.3 and k mostly probes either way.
COPY = [COPY_PROMPTS[0], COPY_PROMPTS[2], COPY_PROMPTS[3]]


class Proxy:
    """TCP forwarder on 127.0.0.1 whose links can be slowed or paused without closing."""

    def __init__(self, target_port: int):
        self.port, self.target = free_port(), target_port
        self.delay_s, self._open = 0.0, None
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._serve(), self.loop).result()

    async def _serve(self):
        self._open = asyncio.Event()
        self._open.set()
        await asyncio.start_server(self._link, "127.0.0.1", self.port)

    async def _pipe(self, reader, writer):
        try:
            while data := await reader.read(65536):
                await self._open.wait()  # paused: hold the bytes, close nothing
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _link(self, reader, writer):
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target)
        await asyncio.gather(self._pipe(reader, up_w), self._pipe(up_r, writer))

    def set(self, *, delay_s: float = 0.0, paused: bool = False):
        def apply():
            self.delay_s = delay_s
            (self._open.clear if paused else self._open.set)()
        self.loop.call_soon_threadsafe(apply)


def stream(url: str, prompt: str, method: str, max_tokens: int) -> dict:
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": prompt}],
            "speculation": {"method": method, "num_speculative_tokens": 4}}
    t0 = time.perf_counter()
    stamps, last = [], {}
    with chat_stream(url, body, timeout=300) as (r, chunks):
        if r.status_code != 200:
            return {"error": r.status_code}
        for last in chunks:
            if any(choice_text(c) for c in last.get("choices", [])):
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    spec = last.get("speculation") or {}
    tokens = (last.get("usage") or {}).get("completion_tokens", 0)
    return {"tok_s": tokens / (time.perf_counter() - t0), "max_gap_ms": 1000 * max(gaps or [0]),
            "drafted": spec.get("drafted_tokens", 0), "accepted": spec.get("accepted_tokens", 0)}


def phase(url: str, n: int, max_tokens: int, prompts: list[str], method: str) -> dict:
    runs = {method: [], "none": []}
    for i in range(n):  # interleaved A/B
        for arm in runs:
            runs[arm].append(stream(url, prompts[i % len(prompts)], arm, max_tokens))
    out = {}
    for arm, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        out[arm] = {"errors": len(rs) - len(ok),
                    "tok_s": round(statistics.median(r["tok_s"] for r in ok), 2) if ok else 0,
                    "max_gap_ms": round(max((r["max_gap_ms"] for r in ok), default=0)),
                    "drafted": sum(r["drafted"] for r in ok),
                    "accepted": sum(r["accepted"] for r in ok)}
    out["speed_vs_plain"] = round(out[method]["tok_s"] / max(out["none"]["tok_s"], 1e-9), 2)
    return out


def start_draft(cluster: Cluster) -> tuple[subprocess.Popen, Proxy]:
    port = free_port()
    proxy = Proxy(port)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tools.cli", "draft", "--port", str(port), "--threads", "1",
         "--redis-url", cluster.redis_url, "--advertise-address", f"127.0.0.1:{proxy.port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 180
    while not grpc_healthy(f"127.0.0.1:{port}"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("draft worker did not start")
        time.sleep(0.3)
    time.sleep(3)  # registered: the next heartbeat has run
    return proc, proxy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=4, help="per method and phase")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--delay-ms", type=float, default=300.0)
    ap.add_argument("--prompts", choices=("copy", "chat"), default="copy",
                    help="copy tasks (the draft agrees: recovery shows) or chat")
    ap.add_argument("--method", choices=("ngram", "draft_model"), default="ngram",
                    help="what the worker drafts (ngram: high acceptance on copy tasks)")
    ap.add_argument("--out", default="results/draft_faults.json")
    args = ap.parse_args()
    cluster = Cluster(ClusterConfig(num_drafts=0, num_verifiers=1, gateway_port=free_port()),
                      log=lambda m: print(m, file=sys.stderr), output=subprocess.DEVNULL,
                      # ngram over the link (the verifier would otherwise draft it itself)
                      env={"TANDEM_VERIFIER_HISTORY_DRAFTS": "worker"})
    cluster.start()
    draft = None
    try:
        draft, proxy = start_draft(cluster)
        report = {"delay_ms": args.delay_ms}
        for name, kw in [("healthy", {}), ("slow", {"delay_s": args.delay_ms / 1000}),
                         ("partitioned", {"paused": True}), ("healed", {})]:
            proxy.set(**kw)
            report[name] = phase(cluster.gateway_url, args.requests, args.max_tokens,
                                 COPY if args.prompts == "copy" else CHAT, args.method)
            print(name, json.dumps(report[name]), flush=True)
    finally:
        if draft is not None:
            draft.terminate()
        cluster.stop()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
