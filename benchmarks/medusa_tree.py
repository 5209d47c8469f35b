"""Reaches inside: a forced tree size and a chain of the same heads are no request or flag option.

Medusa chain vs tree in the real verifier engine (in-process, no gateway): tokens committed
per round, ms per token against plain decoding, interleaved per prompt, and the Leviathan-style
bound (1 + expected accepted) / cost(n + 1) from the heads' measured accuracy and this
machine's measured verify-cost curve.

    python benchmarks/medusa_tree.py [--prompts 8] [--max-tokens 64] [--json out.json]

Each configuration runs twice per prompt: with the tree size forced to the whole tree (what
the tree can commit per round) and with the cost model choosing it (what serving does).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from tandem.engine.block_manager import BlockManager
from tandem.engine.llama import LlamaModel
from tandem.engine.medusa import MedusaHeads, find_medusa, load_for
from tandem.engine.model_runner import ModelRunner
from tandem.models import resolve_model
from tandem.sampling_params import SamplingParams
from tandem.spec import Method
from tandem.spec.cost import CostModel
from verify_service.config import SchedulerConfig
from verify_service.engine import Engine, EngineConfig
from verify_service.forward.executor import Executor
from verify_service.policy.calibration import calibrate
from verify_service.policy.scheduler import Scheduler
from verify_service.session.params import GenerateParams

PROMPTS = Path(__file__).resolve().parents[1] / "draft_service" / "data" / "heldout_prompts.jsonl"
CHAIN = ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))


def with_choices(heads: MedusaHeads, choices) -> MedusaHeads:
    other = MedusaHeads(replace(heads.cfg, choices=tuple(choices)), heads.lm_rows)
    other.load_state_dict(heads.state_dict())
    return other.eval()


async def generate(model, heads, method, prompt, max_new, cost: CostModel):
    """(tokens, rounds, seconds) of one greedy session alone in a fresh engine."""
    runner = ModelRunner(model, 256, 16)
    sched = Scheduler(BlockManager(256, 16), SchedulerConfig(max_spec_tokens=16),
                      CostModel(dict(cost.ms)), tree_reach=heads.cfg.reach if heads else ())
    engine = Engine(Executor(runner, heads), sched, EngineConfig(), model.cfg.vocab_size)
    task = asyncio.create_task(engine.run())
    t0 = time.perf_counter()
    q = engine.submit(GenerateParams("b", tuple(prompt), (), SamplingParams(temperature=0.0),
                                     max_new, frozenset(), method=method))
    tokens, last = [], None
    while last is None or last.finish_reason is None:
        last = await q.get()
        tokens += last.token_ids
    elapsed = time.perf_counter() - t0
    task.cancel()
    return tokens, last.rounds, elapsed


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    paths = resolve_model("SmolLM2-135M-Instruct")
    model = LlamaModel.load(paths)
    tok = AutoTokenizer.from_pretrained(str(paths.root))
    rows = [json.loads(x) for x in PROMPTS.read_text().splitlines()][:args.prompts]
    prompts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                       add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for r in rows]
    tree = load_for(model, paths, str(find_medusa(paths)))
    chain = with_choices(tree, CHAIN)
    calib = calibrate(ModelRunner(model, 64, 16), tuple(range(1, 18)), reps=3)
    measured = CostModel(dict(calib))
    forced = CostModel({q: 1.0 for q in range(1, 40)})  # every node always pays
    configs = {"plain": (None, Method.NONE, measured),
               "chain (forced)": (chain, Method.MEDUSA, forced),
               "tree (forced)": (tree, Method.MEDUSA, forced),
               "chain (cost model)": (chain, Method.MEDUSA, measured),
               "tree (cost model)": (tree, Method.MEDUSA, measured)}
    out = {name: {"tokens": 0, "rounds": 0, "s": 0.0, "texts": []} for name in configs}
    for prompt in prompts:  # interleaved: drift hits every configuration alike
        for name, (heads, method, cost) in configs.items():
            toks, rounds, s = asyncio.run(generate(model, heads, method, prompt,
                                                   args.max_tokens, cost))
            o = out[name]
            o["tokens"] += len(toks)
            o["rounds"] += rounds
            o["s"] += s
            o["texts"].append(toks)
    base = out["plain"]["s"] / out["plain"]["tokens"]
    rel = {q: ms / calib[1] for q, ms in calib.items()}
    report = {"calibrated_ms": calib, "configs": {}}
    print(f"verify cost relative to one token: { {q: round(r, 2) for q, r in rel.items()} }")
    print(f"{'config':20s} {'tok/round':>9s} {'ms/token':>9s} {'speedup':>8s} {'bound':>6s}"
          f" identical")
    for name, o in out.items():
        heads = configs[name][0]
        n = len(heads.cfg.choices) if heads is not None else 0
        bound = (1 + sum(heads.cfg.reach)) / rel[n + 1] if heads is not None else 1.0
        row = {"tokens_per_round": o["tokens"] / o["rounds"],
               "ms_per_token": 1e3 * o["s"] / o["tokens"],
               "speedup": base / (o["s"] / o["tokens"]), "bound_full_tree": bound,
               "identical_to_plain": o["texts"] == out["plain"]["texts"]}
        report["configs"][name] = row
        print(f"{name:20s} {row['tokens_per_round']:9.2f} {row['ms_per_token']:9.1f} "
              f"{row['speedup']:8.2f} {bound:6.2f} {row['identical_to_plain']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
