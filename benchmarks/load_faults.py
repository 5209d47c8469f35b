"""Overload and soak against a real local cluster (tools.launcher), loopback only.

  python benchmarks/load_faults.py overload [--streams 64] [--capacity 4] [--waves 3]
  python benchmarks/load_faults.py soak [--minutes 30] [--workers 4]

overload: a verifier taking `--capacity` sessions gets `--streams` concurrent streams per
  wave. Every request must end in 200 or 429 (with Retry-After), none in a 5xx or a reset; the
  429s must come fast (p50/p99 reported) and the processes' memory must stay bounded across
  waves (RSS per wave reported).
soak: `--workers` clients loop for `--minutes` over mixed traffic: greedy and sampled streams
  of every method, non-streamed requests, cancels mid-stream, odd inputs that must get 400.
  Reported: requests by kind, unexpected outcomes (5xx, resets, wrong status), RSS of every
  process at start and end, p50/p99 inter-token latency of the completed streams (the gap
  between streamed chunks: with speculation one chunk may carry several tokens).
Results go to results/<command>.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from tools.bench.client import chat_body, stream_chat
from tools.bench.stats import percentile
from tools.launcher import Cluster, ClusterConfig, free_port

PROMPTS = ["Explain how a bicycle works.", "Write a haiku about rain.", "Count to twenty.",
           "What is the capital of Italy? Answer briefly.", "Tell a story about a fox."]
METHODS = ["none", "ngram", "draft_model", "eagle", "suffix", "medusa"]
ODD = [b"{not json", b"[]", b'{"messages": "hi"}', b'{"messages": [{"role": "user"}]}',
       b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}',
       b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
       '{"messages": [{"role": "user", "content": "\ud800"}]}'.encode("utf-8", "surrogatepass"),
       b'{"messages": [{"role": "user", "content": "hi"}], "top_p": 0}',
       b'{"messages": [{"role": "user", "content": "hi"}], "speculation": {"method": "x"}}']


def rss_mb(cluster: Cluster) -> dict[str, float]:
    out = {}
    for name, proc in cluster.procs:
        try:
            out[name] = round(psutil.Process(proc.pid).memory_info().rss / 2**20, 1)
        except psutil.NoSuchProcess:
            out[name] = -1.0
    return out


def pct(values: list[float], q: float) -> float:
    """statistics.quantiles' percentile (tools.bench.stats), rounded; 0.0 for none."""
    return round(percentile(values, q, method="exclusive"), 1) if values else 0.0


async def one_stream(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body,
                                 timeout=300) as r:
            status, retry = r.status_code, r.headers.get("retry-after")
            first = time.perf_counter() - t0
            await r.aread()
        return {"status": status, "retry_after": retry, "s": first}
    except httpx.HTTPError as exc:
        return {"status": "reset", "error": repr(exc), "s": time.perf_counter() - t0}


async def overload(cluster: Cluster, args) -> dict:
    report = {"streams": args.streams, "capacity": args.capacity, "waves": []}
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None)) as client:
        for _ in range(args.waves):
            bodies = [chat_body(random.choice(PROMPTS), 32, 0.0, "draft_model", 4)
                      for _ in range(args.streams)]
            outs = await asyncio.gather(*[one_stream(client, cluster.gateway_url, b)
                                          for b in bodies])
            refused = [o["s"] * 1000 for o in outs if o["status"] == 429]
            report["waves"].append({
                "ok": sum(o["status"] == 200 for o in outs), "429": len(refused),
                "429_without_retry_after": sum(o["status"] == 429 and not o["retry_after"]
                                               for o in outs),
                "other": [o for o in outs if o["status"] not in (200, 429)],
                "429_ms_p50": pct(refused, 50), "429_ms_p99": pct(refused, 99),
                "rss_mb": rss_mb(cluster)})
            print(json.dumps(report["waves"][-1]), flush=True)
    return report


async def soak_request(client, url: str, rng: random.Random, stats: dict) -> None:
    kind = rng.choice(["stream", "stream", "sampled", "plain", "cancel", "odd"])
    stats["kinds"][kind] = stats["kinds"].get(kind, 0) + 1
    body = chat_body(rng.choice(PROMPTS), rng.randint(8, 64), 0.0, rng.choice(METHODS), 4)
    try:
        if kind == "odd":
            r = await client.post(url + "/v1/chat/completions", content=rng.choice(ODD),
                                  headers={"content-type": "application/json"}, timeout=60)
            if r.status_code != 400:
                stats["unexpected"].append(f"odd input got {r.status_code}")
            return
        if kind == "cancel":
            async with client.stream("POST", url + "/v1/chat/completions", json=body,
                                     timeout=300) as r:
                async for _ in r.aiter_lines():
                    break  # the client walks away after the first line
            return
        if kind == "plain":
            r = await client.post(url + "/v1/chat/completions",
                                  json={**body, "stream": False}, timeout=300)
            if r.status_code != 200:
                stats["unexpected"].append(f"plain got {r.status_code}: {r.text[:200]}")
            return
        if kind == "sampled":
            body.update(temperature=0.8, top_p=0.9, seed=rng.choice([None, rng.randint(0, 99)]))
        times = (await stream_chat(client, url, body))["chunk_times"]
        # a chunk is one round's tokens: a gap is what a reader waits for the next text
        stats["itl_ms"].extend(1000 * (b - a) for a, b in zip(times, times[1:]))
    except (httpx.HTTPError, RuntimeError) as exc:
        stats["unexpected"].append(f"{kind}: {exc!r}"[:300])


async def soak(cluster: Cluster, args) -> dict:
    stats = {"kinds": {}, "unexpected": [], "itl_ms": []}
    start_rss, end = rss_mb(cluster), time.monotonic() + 60 * args.minutes
    samples = [start_rss]

    async def worker(seed: int):
        rng = random.Random(seed)
        async with httpx.AsyncClient() as client:
            while time.monotonic() < end:
                await soak_request(client, cluster.gateway_url, rng, stats)

    async def sampler():
        while time.monotonic() < end:
            await asyncio.sleep(60)
            samples.append(rss_mb(cluster))
            print(json.dumps({"rss_mb": samples[-1], "requests": stats["kinds"],
                              "unexpected": len(stats["unexpected"])}), flush=True)

    await asyncio.gather(sampler(), *[worker(i) for i in range(args.workers)])
    itl = stats.pop("itl_ms")
    return {**stats, "minutes": args.minutes, "workers": args.workers,
            "requests": sum(stats["kinds"].values()), "rss_mb_start": start_rss,
            "rss_mb_end": rss_mb(cluster), "rss_mb_samples": samples,
            "itl_ms_p50": pct(itl, 50), "itl_ms_p99": pct(itl, 99), "itl_samples": len(itl)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    ov = sub.add_parser("overload", help="far more concurrent streams than capacity")
    ov.add_argument("--streams", type=int, default=64)
    ov.add_argument("--capacity", type=int, default=4, help="the verifier's --max-sessions")
    ov.add_argument("--waves", type=int, default=3)
    so = sub.add_parser("soak", help="mixed traffic for a while")
    so.add_argument("--minutes", type=float, default=30.0)
    so.add_argument("--workers", type=int, default=4)
    args = ap.parse_args()
    env = {"TANDEM_VERIFIER_MAX_SESSIONS": str(args.capacity)} if args.command == "overload" \
        else {}
    cluster = Cluster(ClusterConfig(num_drafts=1, num_verifiers=1, gateway_port=free_port()),
                      log=lambda m: print(m, file=sys.stderr), env=env,
                      output=subprocess.DEVNULL)
    cluster.start()
    try:
        run = overload if args.command == "overload" else soak
        report = asyncio.run(run(cluster, args))
    finally:
        cluster.stop()
    out = Path(f"results/{args.command}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "rss_mb_samples"}, indent=1))


if __name__ == "__main__":
    main()
