"""Runner speed on this machine, in one run (issue: foundation speed targets).

  python benchmarks/runner_speed.py [--tokens 128] [--out results/runner_speed.json]

1. batch-1 greedy decoding: transformers `generate` vs our runner, same prompts, tokens/s;
2. one forward over q new tokens on a cached prefix, relative to q = 1;
3. batch-16 decoding throughput relative to batch 1 (our runner).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.engine.generate import LocalGenerator
from tandem.engine.llama import LlamaModel
from tandem.engine.model_runner import ModelRunner, SeqChunk
from tandem.models import ModelPaths, fetch_default_target
from tandem.sampling_params import SamplingParams

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain photosynthesis to a ten year old.",
    "What are the benefits of regular exercise?",
]
GREEDY = SamplingParams(temperature=0.0)


def chat(tok, text):
    return list(tok.apply_chat_template([{"role": "user", "content": text}],
                                        add_generation_prompt=True, tokenize=True,
                                        return_dict=False))


def hf_tokens_per_s(hf, prompts, n):
    total_t, total_n = 0.0, 0
    for ids in tqdm(prompts, desc="transformers generate", leave=False):
        x = torch.tensor([ids])
        t = time.perf_counter()
        out = hf.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        total_t += time.perf_counter() - t
        total_n += out.shape[1] - len(ids)
    return total_n / total_t


def ours_tokens_per_s(gen, prompts, n):
    total_t, total_n = 0.0, 0
    for ids in tqdm(prompts, desc="our runner", leave=False):
        t = time.perf_counter()
        out = gen.generate([ids], GREEDY, n)  # no stop tokens: exactly n tokens, like min_new
        total_t += time.perf_counter() - t
        total_n += len(out[0])
    return total_n / total_t


def forward_cost(runner, prefix_len=200, qs=(1, 2, 3, 4, 5, 6, 8, 16), reps=15):
    seq = list(range(1000, 1000 + prefix_len + max(qs)))
    table = list(range((len(seq) + runner.block_size - 1) // runner.block_size))
    runner.forward([SeqChunk(seq, 0, table)])
    times = {q: [] for q in qs}
    for _ in tqdm(range(reps), desc="q-token forwards", leave=False):
        for q in qs:  # interleaved, so drift hits every q alike
            start = prefix_len + max(qs) - q
            t = time.perf_counter()
            runner.forward([SeqChunk(seq[start:], start, table, num_logits=q)])
            times[q].append(time.perf_counter() - t)
    med = {q: statistics.median(v) for q, v in times.items()}
    return {q: {"ms": med[q] * 1e3, "ratio_to_1": med[q] / med[1]} for q in qs}


def batch_throughput(gen, tok, n, batch):
    texts = [f"Tell me fact number {i} about the ocean." for i in range(batch)]
    prompts = [chat(tok, t) for t in texts]
    t = time.perf_counter()
    out = gen.generate(prompts, GREEDY, n)
    return sum(len(o) for o in out) / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per prompt")
    ap.add_argument("--out", default="results/runner_speed.json")
    args = ap.parse_args()
    paths = ModelPaths(fetch_default_target())
    tok = AutoTokenizer.from_pretrained(str(paths.root))
    hf = AutoModelForCausalLM.from_pretrained(str(paths.root), dtype=torch.float32).eval()
    runner = ModelRunner(LlamaModel.load(paths), num_blocks=1024, block_size=16)
    gen = LocalGenerator(runner)
    prompts = [chat(tok, p) for p in PROMPTS]
    gen.generate(prompts[:1], GREEDY, 8)  # warm-up
    hf.generate(torch.tensor([prompts[0]]), max_new_tokens=8, do_sample=False)
    with torch.inference_mode():
        hf_tps = hf_tokens_per_s(hf, prompts, args.tokens)
    ours_tps = ours_tokens_per_s(gen, prompts, args.tokens)
    costs = forward_cost(runner)
    b1 = batch_throughput(gen, tok, args.tokens // 2, 1)
    b16 = batch_throughput(gen, tok, args.tokens // 2, 16)
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} "
                   f"torch threads, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d"),
        "batch1_greedy_tokens_per_s": {"transformers_generate": hf_tps, "ours": ours_tps,
                                       "ratio": ours_tps / hf_tps},
        "forward_cost_on_cached_prefix": costs,
        "decode_throughput_tokens_per_s": {"batch1": b1, "batch16": b16, "ratio": b16 / b1},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"batch-1 greedy: transformers {hf_tps:.1f} tok/s, ours {ours_tps:.1f} tok/s "
          f"({ours_tps / hf_tps:.2f}x)")
    print("forward over q new tokens / 1-token forward: " + ", ".join(
        f"q={q}: {c['ratio_to_1']:.2f}x ({c['ms']:.1f} ms)" for q, c in costs.items()))
    print(f"decode throughput: batch 1 {b1:.1f} tok/s, batch 16 {b16:.1f} tok/s "
          f"({b16 / b1:.2f}x)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
