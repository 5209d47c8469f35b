"""Chunked prefill through the gateway: inter-token latency of decoding sessions while a long
prompt arrives, with the verifier's --prefill-chunk-tokens on and off, A/B in one run.

  python benchmarks/chunked_prefill.py [--trials 2] [--streams 4] [--prompt-tokens 1800]
                                       [--chunk 256]

Each trial starts a local cluster (tools.launcher: Redis, one verifier, one draft worker,
the gateway) once per setting, in alternating order. `--streams` greedy sessions decode
(plain decoding, so only the prefill differs); one second in, a request with a
`--prompt-tokens` prompt arrives. Reported per setting: the decoding sessions' gaps between
streamed tokens (p50 / p99 / max), the long request's TTFT, and the decoders' tokens/s.
Results go to results/chunked_prefill.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tools.bench.client import stream_chat
from tools.bench.stats import percentile
from tools.launcher import Cluster, ClusterConfig, free_port

FILLER = "The river flows past the old mill, under the stone bridge and into the valley. "


def body(text: str, max_tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "speculation": {"method": "none"}}


async def scenario(url: str, args) -> dict:
    long_text = "Summarise this: " + FILLER * (args.prompt_tokens // 17)
    async with httpx.AsyncClient() as client:
        await stream_chat(client, url, body("Warm up.", 4))
        decoders = [asyncio.create_task(stream_chat(client, url, body(
            f"Count from {i} to one hundred, one number per line.", args.decode_tokens)))
            for i in range(args.streams)]
        await asyncio.sleep(1.0)
        sent = time.perf_counter()
        long = await stream_chat(client, url, body(long_text, 4))
        done = await asyncio.gather(*decoders)
    gaps = [1e3 * (b - a) for d in done for a, b in zip(d["chunk_times"], d["chunk_times"][1:])
            if b > sent]  # the gaps after the long prompt arrived
    return {"gaps_ms": gaps, "long_ttft_s": long["ttft_s"],
            "decode_tps": sum(d["decode_tps"] for d in done)}


def run_setting(chunk: int, args) -> dict:
    env = {"TANDEM_VERIFIER_PREFILL_CHUNK_TOKENS": str(chunk)}
    cluster = Cluster(ClusterConfig(num_drafts=1, num_verifiers=1, gateway_port=free_port()),
                      log=lambda m: print(m, file=sys.stderr), env=env,
                      output=subprocess.DEVNULL)
    cluster.start()
    try:
        return asyncio.run(scenario(cluster.gateway_url, args))
    finally:
        cluster.stop()


def summarise(runs: list[dict]) -> dict:
    gaps = [g for r in runs for g in r["gaps_ms"]]
    p50, p99 = (percentile(gaps, q, method="exclusive") for q in (50, 99))
    return {"itl_p50_ms": round(p50, 1), "itl_p99_ms": round(p99, 1),
            "itl_max_ms": round(max(gaps), 1), "gaps": len(gaps),
            "long_ttft_s": round(statistics.median(r["long_ttft_s"] for r in runs), 2),
            "decode_tps": round(statistics.median(r["decode_tps"] for r in runs), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=2, help="A/B pairs (alternating order)")
    ap.add_argument("--streams", type=int, default=4, help="decoding sessions")
    ap.add_argument("--decode-tokens", type=int, default=96, help="tokens each decoder makes")
    ap.add_argument("--prompt-tokens", type=int, default=1800, help="size of the long prompt")
    ap.add_argument("--chunk", type=int, default=256, help="--prefill-chunk-tokens when on")
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for trial in range(args.trials):
        order = ["off", "on"] if trial % 2 == 0 else ["on", "off"]
        for name in order:
            print(f"trial {trial + 1}/{args.trials}: chunked prefill {name}", file=sys.stderr)
            runs[name].append(run_setting(args.chunk if name == "on" else 0, args))
    report = {"args": vars(args), **{name: summarise(r) for name, r in runs.items()}}
    out = Path("results/chunked_prefill.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**report, "runs": runs}, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
