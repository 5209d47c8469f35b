"""Tandem's plain greedy decoding against transformers `generate`, token for token.

  python benchmarks/plain_identity.py [--dtype auto] [--tokens 128] [--threads 2]

The bench's prompts (tools/bench/prompts.jsonl), chat template applied, greedy, both sides
stopping at EOS. Tandem runs the engine's LocalGenerator at --dtype (auto: what the verifier
serves, int8 where every weight is exact); transformers runs the checkpoint in float32. Prints
each prompt's verdict (and the first differing position) and the count identical.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.device import place
from tandem.engine.exact_dtype import load_target
from tandem.engine.generate import LocalGenerator
from tandem.engine.model_runner import ModelRunner
from tandem.models import resolve_model
from tandem.sampling_params import SamplingParams

PROMPTS = Path(__file__).resolve().parents[1] / "tools" / "bench" / "prompts.jsonl"


def upto_eos(ids: list[int], eos: int) -> list[int]:
    return ids[:ids.index(eos) + 1] if eos in ids else ids


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto", help="Tandem's weights (default auto)")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens at most")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    paths = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(str(paths.root))
    eos = tok.eos_token_id
    hf = AutoModelForCausalLM.from_pretrained(str(paths.root), dtype=torch.float32).eval()
    model = load_target(paths, place("cpu", args.dtype))
    ours = LocalGenerator(ModelRunner(model, 4 * args.tokens // 16 + 64, 16))
    chosen = "int8" if not model.inexact_int8() else (
        "float32" if args.dtype == "auto" else args.dtype)
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    same = 0
    for row in rows:
        ids = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}],
                                      add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([ids]), max_new_tokens=args.tokens,
                                 do_sample=False)[0, len(ids):].tolist()
        mine = ours.generate([list(ids)], SamplingParams(temperature=0.0), args.tokens,
                             (eos,))[0]
        theirs, mine = upto_eos(theirs, eos), upto_eos(mine, eos)
        at = next((i for i, (a, b) in enumerate(zip(theirs, mine)) if a != b),
                  min(len(theirs), len(mine)))
        same += theirs == mine
        print(f"{row['id']}: " + ("identical" if theirs == mine else
                                  f"first difference at token {at}")
              + f" ({len(mine)} tokens)", flush=True)
    print(f"{same}/{len(rows)} identical (Tandem {chosen} against transformers float32)")
    return 0 if same == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
