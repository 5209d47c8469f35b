"""What batch-invariant mode buys and costs: greedy text alone vs batched, and decode speed.

For each mode (default, --batch-invariant) the same chat prompts are decoded greedily one at a
time and then all together in one batch; a prompt "flips" when its two texts differ (a near-tie
argmax that the batch shape decided). Speed: decode tokens/s at batch 1 and batch N, the two
modes interleaved rep by rep so host drift hits both alike.

    python benchmarks/batch_invariance.py --prompts 16 --max-tokens 48 --threads 1
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from tandem.engine.generate import LocalGenerator
from tandem.engine.llama import LlamaModel
from tandem.engine.model_runner import ModelRunner
from tandem.models import ModelPaths, fetch_default_target
from tandem.sampling_params import SamplingParams

TOPICS = ["the moon", "volcanoes", "bread", "chess", "rainbows", "bees", "glaciers", "jazz",
          "the printing press", "tides", "penguins", "coffee", "the internet", "deserts",
          "photosynthesis", "bridges", "comets", "whales", "maps", "the violin"]
ASKS = ["Explain {} to a child.", "Give three facts about {}.", "Write a short poem about {}.",
        "What is surprising about {}?"]


def prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text = ASKS[i % len(ASKS)].format(TOPICS[i % len(TOPICS)])
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             tokenize=False, add_generation_prompt=True)
        out.append(list(tokenizer(chat)["input_ids"]))
    return out


def decode(model, batch: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    gen = LocalGenerator(ModelRunner(model, num_blocks=512, block_size=16), prefix_caching=False)
    t = time.perf_counter()
    out = gen.generate(batch, SamplingParams(temperature=0.0), max_tokens)
    return out, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--speed-reps", type=int, default=3)
    ap.add_argument("--out", default="results/batch_invariance.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    paths = ModelPaths(fetch_default_target())
    tok = AutoTokenizer.from_pretrained(str(paths.root))
    default = LlamaModel.load(paths)
    modes = {"default": default, "batch_invariant": default.batch_invariant_view()}
    ps = prompts(tok, args.prompts)
    report = {"threads": args.threads, "prompts": len(ps), "max_tokens": args.max_tokens,
              "invariant_rows": modes["batch_invariant"].linear.invariant_rows}
    for name, model in modes.items():
        alone = [decode(model, [p], args.max_tokens)[0][0] for p in ps]
        together = decode(model, ps, args.max_tokens)[0]
        report[f"{name}_flips"] = sum(a != b for a, b in zip(alone, together))
        print(f"{name}: {report[f'{name}_flips']}/{len(ps)} prompts' greedy text differs "
              "alone vs batched", flush=True)
    for batch in (1, len(ps)):
        times = {name: [] for name in modes}
        for _ in range(args.speed_reps):  # interleaved A/B
            for name, model in modes.items():
                out, secs = decode(model, ps[:batch], args.max_tokens)
                times[name].append(sum(map(len, out)) / secs)
        for name in modes:
            report[f"{name}_tok_s_batch{batch}"] = round(max(times[name]), 1)
        report[f"cost_batch{batch}"] = round(times["default"][0] and
                                             max(times["default"]) /
                                             max(times["batch_invariant"]), 2)
        print(f"batch {batch}: " + ", ".join(f"{n} {max(t):.1f} tok/s"
                                            for n, t in times.items()), flush=True)
    print(json.dumps(report, indent=1))
    from pathlib import Path

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
