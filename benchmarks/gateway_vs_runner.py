"""Plain decoding through the whole service path against the model runner alone (issue 14).

  python benchmarks/gateway_vs_runner.py [--tokens 64] [--levels 1,16] [--reps 3]
                                         [--out results/gateway_vs_runner.json]

Same prompts, same greedy decoding, same torch threads (1), in one run, A/B interleaved rep
by rep (the order flips every rep, so drift hits both alike):
- runner: LocalGenerator over the ModelRunner in this process (no gRPC, no gateway), n prompts
  as one batch;
- gateway: a real local cluster (redis, verifier, draft worker, gateway; 1 torch thread per
  worker), n concurrent streaming chat requests with method none.
Throughput is generated tokens over the wall time of the whole batch (prefill included), as
`tandem bench` counts it; with EOS ignored both generate exactly n x tokens.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from tandem.engine.generate import LocalGenerator
from tandem.engine.llama import LlamaModel
from tandem.engine.model_runner import ModelRunner
from tandem.models import resolve_model
from tandem.sampling_params import SamplingParams
from tools.bench.client import run_concurrent
from tools.bench.config import load_prompts
from tools.launcher import Cluster, ClusterConfig, free_port


def runner_tps(gen: LocalGenerator, prompts: list[list[int]], n: int) -> float:
    t0 = time.perf_counter()
    out = gen.generate(prompts, SamplingParams(temperature=0.0), n)
    return sum(len(o) for o in out) / (time.perf_counter() - t0)


def gateway_tps(url: str, texts: list[str], n: int, tok) -> float:
    bodies = [{"model": "SmolLM2-135M-Instruct", "max_tokens": n, "temperature": 0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
               "messages": [{"role": "user", "content": t}],
               "speculation": {"method": "none"}} for t in texts]
    return run_concurrent(url, bodies, tok)["total_tps"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--levels", default="1,16", help="concurrent sessions / batch sizes")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions per level")
    ap.add_argument("--out", default="results/gateway_vs_runner.json")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    torch.set_num_threads(1)
    paths = resolve_model("default")
    tok = AutoTokenizer.from_pretrained(str(paths.root))
    texts = [p["prompt"] for p in load_prompts()]
    texts = (texts * (max(levels) // len(texts) + 1))[:max(levels)]
    ids = [list(tok.apply_chat_template([{"role": "user", "content": t}],
                                        add_generation_prompt=True, tokenize=True,
                                        return_dict=False)) for t in texts]
    gen = LocalGenerator(ModelRunner(LlamaModel.load(paths), 1024, 16))
    gen.generate(ids[:2], SamplingParams(temperature=0.0), 4)  # warm up
    cluster = Cluster(ClusterConfig(gateway_port=free_port()), log=print,
                      output=subprocess.DEVNULL)
    cluster.start()
    runs: dict[str, dict[str, list[float]]] = {}
    try:
        gateway_tps(cluster.gateway_url, texts[:2], 4, tok)  # warm up
        for rep in range(args.reps):
            for n in levels:
                r = runs.setdefault(str(n), {"runner": [], "gateway": []})
                order = ("runner", "gateway") if rep % 2 == 0 else ("gateway", "runner")
                for system in order:
                    tps = (runner_tps(gen, ids[:n], args.tokens) if system == "runner" else
                           gateway_tps(cluster.gateway_url, texts[:n], args.tokens, tok))
                    r[system].append(tps)
                    print(f"rep {rep} n={n} {system}: {tps:.1f} tokens/s", flush=True)
    finally:
        cluster.stop()
    report(runs, levels, args)


def report(runs: dict, levels: list[int], args) -> None:
    summary = {}
    for n in levels:
        r = runs[str(n)]
        runner, gateway = statistics.median(r["runner"]), statistics.median(r["gateway"])
        summary[str(n)] = {"runner_tps": runner, "gateway_tps": gateway,
                           "gateway_vs_runner": gateway / runner}
    base = summary[str(levels[0])]
    for n in levels:
        s = summary[str(n)]
        s["runner_scaling"] = s["runner_tps"] / base["runner_tps"]
        s["gateway_scaling"] = s["gateway_tps"] / base["gateway_tps"]
    print("| sessions | runner alone tokens/s | gateway plain tokens/s | gateway / runner | "
          f"runner vs {levels[0]} | gateway vs {levels[0]} |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in levels:
        s = summary[str(n)]
        print(f"| {n} | {s['runner_tps']:.1f} | {s['gateway_tps']:.1f} | "
              f"{s['gateway_vs_runner']:.2f} | {s['runner_scaling']:.2f}x | "
              f"{s['gateway_scaling']:.2f}x |")
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "tokens": args.tokens, "reps": args.reps,
           "runs": runs, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
