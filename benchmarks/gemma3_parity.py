"""Gemma 3 270M (the offline GGUF, dequantized) in Tandem's forward against transformers' Gemma 3
on the same weights: greedy text of 20 chat prompts, and the largest logit difference.

  python benchmarks/gemma3_parity.py [--tokens 64] [--out results/gemma3_parity.json]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

PROMPTS = [
    "Name three rivers in Europe.", "What is 12 times 7?", "Write a haiku about rain.",
    "Repeat exactly: the cat sat on the mat.", "Give two tips for sleeping well.",
    "What is the capital of Japan?", "Explain what a CPU does in one sentence.",
    "List the days of the week.", "Translate 'good morning' into French.",
    "Why is the sky blue? Answer briefly.", "Write a Python function that adds two numbers.",
    "What is photosynthesis?", "Sort these words: pear, apple, fig.",
    "Name a famous painter.", "How many legs does a spider have?",
    "Summarise: The meeting moved to Friday because the room was booked.",
    "What does HTTP stand for?", "Suggest a name for a cat.",
    "Correct the spelling: 'teh quick brwon fox'.", "Count from one to ten in words.",
]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--out", default="results/gemma3_parity.json")
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tandem.engine.generate import LocalGenerator
    from tandem.engine.llama import LlamaModel
    from tandem.engine.model_runner import ModelRunner, SeqChunk
    from tandem.models import ModelPaths, fetch_model, generation_eos_ids
    from tandem.sampling_params import SamplingParams

    paths = ModelPaths(fetch_model("gemma3-270m"))
    tok = AutoTokenizer.from_pretrained(str(paths.root))
    hf = AutoModelForCausalLM.from_pretrained(str(paths.root), dtype=torch.float32).eval()
    ours = LlamaModel.load(paths)
    eos = generation_eos_ids(paths)
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False) for p in PROMPTS]
    t0 = time.perf_counter()
    want = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                        max_new_tokens=args.tokens, do_sample=False, eos_token_id=list(eos),
                        pad_token_id=tok.pad_token_id)[0, len(p):].tolist() for p in ids]
    hf_s = time.perf_counter() - t0
    want = [w[:next((i + 1 for i, t in enumerate(w) if t in eos), len(w))] for w in want]
    t0 = time.perf_counter()
    got = LocalGenerator(ModelRunner(ours, 256, 16)).generate(
        ids, SamplingParams(temperature=0.0), args.tokens, eos)
    ours_s = time.perf_counter() - t0
    worst = 0.0
    with torch.no_grad():
        for p in ids[:5]:
            ref = hf(torch.tensor([p])).logits[0]
            mine = ModelRunner(ours, 64, 16).forward([SeqChunk(p, 0, list(range(16)),
                                                               num_logits=len(p))])
            worst = max(worst, (mine - ref).abs().max().item())
    same = sum(w == g for w, g in zip(want, got))
    result = {"prompts": len(PROMPTS), "identical": same, "tokens": args.tokens,
              "max_logit_diff_first_5": worst, "hf_s": hf_s, "ours_s": ours_s,
              "mismatches": [{"prompt": PROMPTS[i], "hf": tok.decode(w), "ours": tok.decode(g)}
                             for i, (w, g) in enumerate(zip(want, got)) if w != g]}
    print(json.dumps({k: v for k, v in result.items() if k != "mismatches"}, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
