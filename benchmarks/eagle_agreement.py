"""How often an EAGLE head's chained greedy drafts match the target, through the real proposer.

  python benchmarks/eagle_agreement.py [--head DIR] [--prompts 10] [--new-tokens 48] [--k 4]
                                       [--eagle-vocab 4096]

Along the target's own greedy answer to each held-out chat prompt
(draft_service/data/heldout_prompts.jsonl), a round starts at every position: the
`EagleProposer` (as a draft worker serves it) drafts k tokens from the true prefix and the
target's true features, and position i counts a hit while drafts 1..i equal the target's
tokens. Prints P(draft i right | drafts before it right): position 1 is the issue's
"greedy agreement at the first draft position".
"""
from __future__ import annotations

import argparse
import json

import torch

from draft_service.config import DraftConfig
from draft_service.proposers.eagle import EagleProposer
from tandem.engine.llama import LlamaModel
from tandem.engine.model_runner import ModelRunner, SeqChunk
from tandem.models import ModelPaths, resolve_model
from tandem.sampling_params import SamplingParams
from tandem.spec import DraftRequest
from tools.distill.acceptance import load_prompts
from tools.distill.corpus import Prompt, encode_prompt

GREEDY = SamplingParams(temperature=0.0)


def greedy_path(runner: ModelRunner, prompt: list[int], new: int):
    """The target's greedy continuation and its feature (final normed state) per position."""
    table = list(range(-(-(len(prompt) + new + 1) // runner.block_size)))
    path = list(prompt)
    logits, hidden = runner.forward([SeqChunk(path, 0, table, 1)], with_hidden=True)
    feats = [*hidden]
    for _ in range(new):
        path.append(int(logits[-1].argmax()))
        logits, hidden = runner.forward([SeqChunk(path[-1:], len(path) - 1, table, 1)],
                                        with_hidden=True)
        feats.append(hidden[0])
    return path, torch.stack(feats)  # [len(path)], [len(path), hidden]


def chain_hits(prop: EagleProposer, key, path, feats, start: int, k: int):
    """(positions reached, hits) of rounds started at every position after `start`."""
    reached, hits = [0] * k, [0] * k
    for n in range(start, len(path) - k):
        ids = path[:n + 1]  # position n is the fresh bonus token: no feature for it yet
        for j in range(k):
            res = prop.propose([DraftRequest(key, list(ids), n + 1, k - j, GREEDY,
                                             features=feats[:n])])[0]
            reached[j] += 1
            if not res.tokens or res.tokens[0].token_id != path[n + 1 + j]:
                break
            hits[j] += 1
            ids.append(res.tokens[0].token_id)
    return reached, hits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", default="draft_service/weights/smollm2-135m-eagle")
    ap.add_argument("--target", default="SmolLM2-135M-Instruct")
    ap.add_argument("--prompts", type=int, default=10, help="held-out prompts used")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--eagle-vocab", type=int, default=DraftConfig.eagle_vocab,
                    help="rows drafted from, as the worker's --eagle-vocab (0 = all)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    paths = resolve_model(args.target)
    tok = AutoTokenizer.from_pretrained(str(paths.root))
    runner = ModelRunner.with_memory(LlamaModel.load(paths), 64 << 20)
    prop = EagleProposer.load(ModelPaths(resolve_model(args.head).root), 32 << 20,
                              draft_vocab=args.eagle_vocab)
    reached, hits = [0] * args.k, [0] * args.k
    for i, text in enumerate(load_prompts(None)[:args.prompts]):
        prompt = encode_prompt(tok, Prompt("chat", text, "heldout"), 256)
        path, feats = greedy_path(runner, prompt, args.new_tokens)
        r, h = chain_hits(prop, ("p", i), path, feats, len(prompt), args.k)
        prop.release(("p", i))
        reached = [a + b for a, b in zip(reached, r)]
        hits = [a + b for a, b in zip(hits, h)]
    rates = [round(h / r, 3) if r else None for h, r in zip(hits, reached)]
    print(json.dumps({"head": args.head, "eagle_vocab": args.eagle_vocab,
                      "prompts": args.prompts, "per_position": rates, "reached": reached}))


if __name__ == "__main__":
    main()
