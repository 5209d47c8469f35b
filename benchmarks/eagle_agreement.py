"""Reaches inside: agreement at every position of a fixed text needs the proposer run directly.

An EAGLE head's first-draft agreement with the target, the trainer's way and the served way,
on the same sequences (tools.distill.eagle_agreement). An EAGLE-3 head (published layout) is
served three-layer features and scored by tools.distill.eagle3's validation.

  python benchmarks/eagle_agreement.py [--head DIR] [--source heldout|val|train|fresh]
      [--prompts 10] [--new-tokens 48] [--temperature T | --as-trained]
      [--eagle-vocab 4096 [0 ...]] [--single-path [DTYPE ...]] [--k 4]

--source heldout: the held-out chat prompts (draft_service/data/heldout_prompts.jsonl), which
no training run sees; val / train: the head's own training prompts (rebuilt from its card),
those its trainer held out / trained on; fresh: new prompts from the same generator as the
training prompts, the ones after those its data reached (none trained on). The target answers
each (greedy, or at --temperature with a per-prompt seed, or --as-trained: as the training
data was generated; val/train only).
Prints one JSON line per served variant beside the trainer's figure:
  trained: tools.distill.eagle.evaluate, top-1 at draft steps 1 and 2 (teacher-forced);
  served: EagleProposer's one greedy draft per position (recorded fp16 features), at each
          --eagle-vocab; --single-path also serves features recomputed along the same tokens
          one sequence and one token at a time (as this benchmark used to) by the target in
          each DTYPE (float32, bfloat16, float16, int8; default float32), unrounded.
--k > 1 adds the served chain: P(draft i right | drafts before it right) along greedy paths.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from draft_service.config import DraftConfig
from tandem.engine.eagle3_published import is_eagle3, layer_ids_of
from tandem.engine.llama import LlamaModel
from tandem.engine.model_runner import ModelRunner
from tandem.models import ModelPaths, resolve_model
from tandem.proposers.eagle import EagleProposer
from tandem.sampling_params import SamplingParams
from tandem.spec import DraftRequest
from tools.distill.acceptance import load_prompts
from tools.distill.config import EagleTrainConfig
from tools.distill.corpus import Prompt, build_prompts, encode_prompt
from tools.distill.eagle3 import aux_runner, evaluate3
from tools.distill.eagle3_head import EAGLE3_CARD, Eagle3TrainHead
from tools.distill.eagle_agreement import (
    GREEDY,
    record_answers,
    served_top1,
    single_path_features,
    trained_top1,
    training_split,
)


def chain_rates(prop: EagleProposer, seqs, k: int) -> list[float | None]:
    """Served chains of k greedy drafts from every answer position (greedy paths only)."""
    reached, hits = [0] * k, [0] * k
    for i, s in enumerate(seqs):
        path, feats = s.ids.tolist(), s.features.float()
        for n in range(s.gen_start, len(path) - k):
            ids = path[:n + 1]
            for j in range(k):
                res = prop.propose([DraftRequest(("c", i), list(ids), n + 1, k - j, GREEDY,
                                                 features=feats[:n])])[0]
                reached[j] += 1
                if not res.tokens or res.tokens[0].token_id != path[n + 1 + j]:
                    break
                hits[j] += 1
                ids.append(res.tokens[0].token_id)
        prop.release(("c", i))
    return [round(h / r, 4) if r else None for h, r in zip(hits, reached)]


def _prompts(args, card: dict) -> tuple[list[Prompt], list[SamplingParams]]:
    if args.source == "heldout":
        prompts = [Prompt("chat", t, "heldout") for t in load_prompts(None)[:args.prompts]]
        params = [GREEDY] * len(prompts)
    elif args.source == "fresh":
        d = card["data"]
        n = d["sequences"]  # the generator's next prompts: the data never reached them
        if d["mix"] == "self":
            raise SystemExit("--source fresh rebuilds a chat or corpus prompt set; this head's "
                             "came from the target (mix 'self'): use --source heldout")
        prompts = build_prompts(n + args.prompts, d["seed"], mix=d["mix"])
        seen = {p.text for p in prompts[:n]}
        prompts = [p for p in prompts[n:] if p.text not in seen]
        params = [GREEDY] * len(prompts)
    else:
        ordered, params, n_val = training_split(card, args.data_dir)
        pick = slice(0, n_val) if args.source == "val" else slice(n_val, None)
        prompts, params = ordered[pick][:args.prompts], params[pick][:args.prompts]
    if not args.as_trained:
        params = [GREEDY if not args.temperature else
                  SamplingParams(temperature=args.temperature, seed=1000 + i)
                  for i in range(len(prompts))]
    return prompts, params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", default="draft_service/weights/smollm2-135m-eagle")
    ap.add_argument("--target", default="SmolLM2-135M-Instruct")
    ap.add_argument("--source", choices=("heldout", "val", "train", "fresh"),
                    default="heldout")
    ap.add_argument("--data-dir", type=Path, default=None,
                    help="val/train of a head trained on self-written prompts: the run's "
                         "--data-dir (its prompts.jsonl)")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--as-trained", action="store_true",
                    help="val/train prompts: answered as the training data was (greedy or "
                         "seeded at its temperature, by shard)")
    ap.add_argument("--eagle-vocab", type=int, nargs="+", default=[DraftConfig.eagle_vocab],
                    help="served rows drafted from, as the worker's --eagle-vocab (0 = all)")
    ap.add_argument("--single-path", nargs="*", default=None, metavar="DTYPE")
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    head = ModelPaths(resolve_model(args.head).root)
    paths = resolve_model(args.target)
    three = is_eagle3(head.root)  # EAGLE-3: the target's three-layer features, its own vocab
    card_file = head.root / (EAGLE3_CARD if three else "tandem_eagle.json")
    card = json.loads(card_file.read_text()) if card_file.is_file() else {}
    if not card and args.source != "heldout":
        raise SystemExit(f"--source {args.source} needs the head's training card ({card_file})")
    tok = AutoTokenizer.from_pretrained(str(paths.root))
    model = LlamaModel.load(paths)
    runner = (aux_runner(model, 256, layer_ids_of(json.loads(
        (head.root / "config.json").read_text()))) if three else
        ModelRunner.with_memory(model, 256 << 20))
    prompts, params = _prompts(args, card)
    t0 = time.perf_counter()
    seqs = record_answers(runner, tok, [encode_prompt(tok, p, 256) for p in prompts], params,
                          args.new_tokens)
    base = {"head": args.head, "source": args.source, "prompts": len(seqs),
            "new_tokens": args.new_tokens, "temperature": args.temperature,
            "as_trained": args.as_trained}
    cfg = EagleTrainConfig(**card["train"]) if card else EagleTrainConfig()
    trained = (evaluate3(Eagle3TrainHead.from_export(head.root, paths), seqs, cfg) if three
               else trained_top1(head.root, seqs, cfg))
    print(json.dumps({**base, "trained": trained}), flush=True)
    variants = {"recorded-fp16": None}
    for dtype in ([] if args.single_path is None else args.single_path or ["float32"]):
        model = runner.model if dtype == "float32" else LlamaModel.load(paths, dtype)
        variants[f"single-{dtype}"] = single_path_features(
            ModelRunner.with_memory(model, 64 << 20, feature_layers=runner.feature_layers),
            seqs, fp16=False)  # an EAGLE-3 head's three layers too
    for v in [0] if three else args.eagle_vocab:  # an EAGLE-3 head has its own vocabulary
        prop = EagleProposer.load(head, 64 << 20, draft_vocab=v, target=paths)
        for name, feats in variants.items():
            out = served_top1(prop, seqs, feats)
            print(json.dumps({**base, "eagle_vocab": v, "features": name,
                              "trained_top1": round(trained["top1_step1"], 4), **out}),
                  flush=True)
        if args.k > 1:
            print(json.dumps({**base, "eagle_vocab": v, "chain": chain_rates(prop, seqs, args.k)}))
    print(json.dumps({"wall_s": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
