"""Speculation under load through the gateway, every method beside plain decoding (issue 14).

  python benchmarks/load_methods.py [--levels 16,32] [--methods none,ngram,medusa,eagle]
                                    [--tokens 64] [--reps 2] [--out results/load_methods.json]

One local cluster (redis, verifier, draft worker, gateway; 1 torch thread per worker, the
verifier's cost curve calibrated at start-up as deployed). At each level, n concurrent
greedy streaming chat requests (the bench prompts in turn, EOS ignored: every method makes
n x tokens), each method in turn, the order rotated every rep so the host's drift hits all
alike. Every prompt is asked once before timing, so plain decoding and the others start
from a warm prefix cache (EAGLE sessions never use it: they need every position's
features). Reports the median total tokens/s per method and its ratio to none, TTFT and ITL
p50, and the share of the verifier's rounds that verified drafts (from its /metrics), as a
markdown table. --compare-plan runs a second cluster with the batch plan off
(verifier --batch-plan off), its arms interleaved with the first's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from tandem.models import resolve_model
from tools.bench.client import chat_body, run_concurrent
from tools.bench.config import SUFFIX_CACHE_OFF, load_prompts
from tools.bench.stats import percentile
from tools.launcher import Cluster, ClusterConfig, free_port

COUNTERS = ("tandem_verifier_rounds_total", "tandem_spec_num_drafts_total",
            "tandem_spec_num_draft_tokens_total")


def counters(metrics_url: str) -> dict[str, float]:
    """The verifier's round and draft counters (Prometheus text)."""
    text = httpx.get(metrics_url, timeout=10).text
    return {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines()
            if ln.split(" ")[0] in COUNTERS}


def one(cluster: Cluster, texts: list[str], method: str, tokens: int, k: int, tok) -> dict:
    """One arm: its throughput and latencies, and the share of the verifier's rounds that
    verified drafts (what the batch plan left) with their mean size."""
    metrics = cluster.metrics_urls["verifier-0"]
    before = counters(metrics)
    out = run_concurrent(cluster.gateway_url,
                         [chat_body(t, tokens, 0.0, method, k) for t in texts], tok)
    d = {key: v - before.get(key, 0.0) for key, v in counters(metrics).items()}
    rounds, drafts = d.get(COUNTERS[0], 0.0), d.get(COUNTERS[1], 0.0)
    return {"tps": out["total_tps"], "ttft_p50_s": percentile(out["ttft_s"], 50),
            "itl_p50_ms": percentile(out["itl_s"], 50) * 1e3,
            "draft_rounds": drafts / rounds if rounds else 0.0,
            "drafts_per_draft_round": d.get(COUNTERS[2], 0.0) / drafts if drafts else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default="16,32", help="concurrent sessions")
    ap.add_argument("--methods", default="none,ngram,draft_model,medusa,eagle")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--k", type=int, default=16, help="draft tokens per round at most")
    ap.add_argument("--reps", type=int, default=2, help="rotated repetitions per level")
    ap.add_argument("--out", default="results/load_methods.json")
    ap.add_argument("--compare-plan", action="store_true",
                    help="also run every speculative method on a second cluster whose "
                         "verifier has --batch-plan off (rows 'method, plan off')")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    methods = args.methods.split(",")
    tok = AutoTokenizer.from_pretrained(str(resolve_model("default").root))
    texts = [p["prompt"] for p in load_prompts()]
    envs = {"": dict(SUFFIX_CACHE_OFF)}
    if args.compare_plan:
        envs[", plan off"] = {**SUFFIX_CACHE_OFF, "TANDEM_VERIFIER_BATCH_PLAN": "off"}
    clusters = {tag: Cluster(ClusterConfig(gateway_port=free_port()), log=print,
                             output=subprocess.DEVNULL, env=env) for tag, env in envs.items()}
    runs: dict[str, dict[str, list[dict]]] = {}
    try:
        for c in clusters.values():
            c.start()
        arms = [(m + tag, clusters[tag], m) for tag in clusters for m in methods
                if not (tag and m == "none")]
        for _, c, m in arms:  # warm-up: connections, draft worker, the prompts' prefix cache
            one(c, texts, m, 4, args.k, tok)
        for rep in range(args.reps):
            for n in levels:
                batch = (texts * (n // len(texts) + 1))[:n]
                shift = rep % len(arms)
                for name, c, m in arms[shift:] + arms[:shift]:
                    r = one(c, batch, m, args.tokens, args.k, tok)
                    runs.setdefault(str(n), {}).setdefault(name, []).append(r)
                    print(f"rep {rep} n={n} {name}: {r['tps']:.1f} tok/s, TTFT p50 "
                          f"{r['ttft_p50_s']:.2f} s, ITL p50 {r['itl_p50_ms']:.0f} ms, "
                          f"drafts in {r['draft_rounds']:.0%} of rounds", flush=True)
    finally:
        for c in clusters.values():
            c.stop()
    report(runs, levels, [name for name, _, _ in arms], args)


def report(runs: dict, levels: list[int], methods: list[str], args) -> None:
    keys = ("tps", "ttft_p50_s", "itl_p50_ms", "draft_rounds", "drafts_per_draft_round")
    med = {n: {m: {key: statistics.median(r[key] for r in runs[str(n)][m]) for key in keys}
               for m in methods} for n in levels}
    print("| sessions | method | tokens/s | vs none | TTFT p50 s | ITL p50 ms | rounds with "
          "drafts | drafts per such round |")
    print("|---:|:---|---:|---:|---:|---:|---:|---:|")
    for n in levels:
        base = med[n].get("none", {}).get("tps")
        for m in methods:
            s = med[n][m]
            ratio = f"{s['tps'] / base:.2f}" if base else "-"
            print(f"| {n} | {m} | {s['tps']:.1f} | {ratio} | {s['ttft_p50_s']:.2f} | "
                  f"{s['itl_p50_ms']:.0f} | {s['draft_rounds']:.0%} | "
                  f"{s['drafts_per_draft_round']:.1f} |")
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args), "runs": runs,
           "median": {str(n): v for n, v in med.items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
