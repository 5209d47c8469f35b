"""Per-round overhead of the network path, and single-session speed through the gateway.

  python benchmarks/service_overhead.py [--tokens 128] [--out results/service_overhead.json]

Starts a real local cluster (redis, 1 verifier, 1 draft worker, gateway; 1 torch thread each).
1. Calls the verifier's Generate directly over gRPC: for every round, the client-observed gap
   between consecutive responses minus what the verifier reports for the round (draft wait +
   verification forward + rejection) is the overhead of serialization, gRPC, scheduling and
   the engine loop. Reported in ms and as a share of the round.
2. Single-session tokens/s through the gateway (streaming), draft_model and ngram vs none,
   same run, same prompts.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import grpc
from transformers import AutoTokenizer

from tandem.models import resolve_model
from tandem.spec.methods import Method
from tandem.v1 import common_pb2, verify_pb2, verify_pb2_grpc
from tools.bench.sse import chat_stream
from tools.launcher import Cluster, ClusterConfig, free_port

PROMPTS = ["Write a short story about a lighthouse keeper and a storm.",
           "Repeat this list twice: apples, pears, plums, cherries, figs, dates.",
           "Explain how a bicycle works."]
METHODS = {m.api_name: int(m) for m in Method if m is not Method.UNSPECIFIED}  # name -> wire


def grpc_rounds(address: str, ids: list[int], method: str, n: int) -> list[dict]:
    req = verify_pb2.GenerateRequest(
        session_id=f"bench-{time.monotonic_ns()}", prompt_token_ids=ids,
        sampling=common_pb2.SamplingParams(temperature=0),
        stopping=verify_pb2.StoppingCriteria(max_new_tokens=n, ignore_eos=True),
        speculation=verify_pb2.SpeculationConfig(method=METHODS[method],
                                                 num_speculative_tokens=4))
    rounds, last = [], None
    with grpc.insecure_channel(address) as ch:
        for resp in verify_pb2_grpc.VerifyServiceStub(ch).Generate(req, timeout=600):
            now = time.perf_counter()
            if last is not None:  # the first response also carries the prefill
                r = resp.round
                gap = (now - last) * 1e3
                inside = r.draft_wait_ms + r.verify_ms + r.rejection_ms
                rounds.append({"gap_ms": gap, "inside_ms": inside, "overhead_ms": gap - inside,
                               "tokens": len(resp.token_ids)})
            last = now
    return rounds


def gateway_tps(url: str, prompt: str, method: str, n: int) -> float:
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": n, "temperature": 0,
            "stream": True, "messages": [{"role": "user", "content": prompt}],
            "speculation": {"method": method, "num_speculative_tokens": 4},
            "stream_options": {"include_usage": True}}
    first = end = None
    tokens = 0
    with chat_stream(url, body, timeout=600) as (_, chunks):
        for chunk in chunks:
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif first is None:
                first = time.perf_counter()
            end = time.perf_counter()
    return (tokens - 1) / (end - first) if tokens > 1 and end > first else 0.0


def summarize(rounds: list[dict]) -> dict:
    over = [r["overhead_ms"] for r in rounds]
    gaps = [r["gap_ms"] for r in rounds]
    return {"rounds": len(rounds), "overhead_ms_mean": statistics.mean(over),
            "overhead_ms_median": statistics.median(over),
            "round_ms_mean": statistics.mean(gaps),
            "overhead_share": statistics.mean(over) / statistics.mean(gaps),
            "tokens_per_round": statistics.mean(r["tokens"] for r in rounds)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", default="results/service_overhead.json")
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(str(resolve_model("default").root))
    cluster = Cluster(ClusterConfig(gateway_port=free_port()), log=print,
                      output=subprocess.DEVNULL)
    cluster.start()
    try:
        verifier = cluster.addresses["verifier-0"]
        result: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "grpc": {}, "gateway": {}}
        for method in METHODS:
            rounds = []
            for p in PROMPTS:
                ids = tok.apply_chat_template([{"role": "user", "content": p}],
                                              add_generation_prompt=True, tokenize=True,
                                              return_dict=False)
                rounds += grpc_rounds(verifier, list(ids), method, args.tokens)
            result["grpc"][method] = summarize(rounds)
            tps = [gateway_tps(cluster.gateway_url, p, method, args.tokens) for p in PROMPTS]
            result["gateway"][method] = {"tokens_per_s": statistics.mean(tps), "per_prompt": tps}
            print(method, json.dumps(result["grpc"][method]), result["gateway"][method])
        base = result["gateway"][Method.NONE.api_name]["tokens_per_s"]
        for method in METHODS:
            result["gateway"][method]["speedup_vs_none"] = (
                result["gateway"][method]["tokens_per_s"] / base if base else 0.0)
    finally:
        cluster.stop()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
