"""Reaches inside: making every round verify all its drafts needs the engine's cost model swapped.

EAGLE chain vs EAGLE tree: what each commits per round when every round verifies all the
drafts that arrived (the size forced), in the real verifier engine with the real draft worker
and the shipped head, in one process (tools.bench.inproc; no gRPC, no gateway).

    python benchmarks/eagle_tree.py [--prompts 6] [--max-tokens 48] [--nodes 4,8,16]

Greedy; every text is checked against plain decoding. Tokens per round and acceptance are
counts, not timings: the draft worker and the verifier share this process, so speed is
measured through the gateway by `tandem bench` (its chain-vs-tree phase) instead.
"""
from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import torch

from draft_service.limits import Limits
from draft_service.weights import default_eagle_dir
from draft_service.worker import DraftWorker
from tandem.engine.block_manager import BlockManager
from tandem.engine.generate import LocalGenerator
from tandem.engine.llama import LlamaModel
from tandem.engine.model_runner import ModelRunner
from tandem.models import ModelPaths, resolve_model
from tandem.proposers.eagle import EagleProposer
from tandem.sampling_params import SamplingParams
from tandem.spec import Method
from tandem.spec.cost import CostModel
from tools.bench.inproc import OnePool, WorkerLink
from verify_service.config import SchedulerConfig
from verify_service.engine import Engine, EngineConfig
from verify_service.forward.executor import Executor
from verify_service.policy.scheduler import Scheduler
from verify_service.session.params import GenerateParams

PROMPTS = Path(__file__).resolve().parents[1] / "draft_service" / "data" / "heldout_prompts.jsonl"
GREEDY = SamplingParams(temperature=0.0)


class Forced(CostModel):
    """Verification made dear at every size and never re-measured: next to it the drafting
    wait is nothing and every node with any estimated reach pays, so a round verifies all the
    drafts that arrived."""

    def __init__(self):
        super().__init__({q: 1000.0 for q in range(1, 40)})

    def observe(self, num_tokens: int, elapsed_ms: float) -> None:
        pass


async def _generate(model, proposer, prompts, max_new, nodes: int, tree: bool):
    sched = Scheduler(BlockManager(1024, 16), SchedulerConfig(max_spec_tokens=nodes), Forced())
    engine = Engine(Executor(ModelRunner(model, 1024, 16)), sched,
                    EngineConfig(max_draft_wait_ms=500), model.cfg.vocab_size)
    worker = DraftWorker({Method.EAGLE: proposer}, Limits(model.cfg.vocab_size, 8192))
    link = WorkerLink(engine, worker)
    engine.drafts.pool = OnePool(link)
    loop = asyncio.create_task(engine.run())
    texts, rounds, drafted, accepted, with_drafts = [], 0, 0, 0, 0
    for i, p in enumerate(prompts):  # one session at a time: single-session rounds
        q = engine.submit(GenerateParams(f"s{i}", tuple(p), (), GREEDY, max_new, frozenset(),
                                         method=Method.EAGLE, tree=tree))
        tokens, last = [], None
        while last is None or last.finish_reason is None:
            last = await asyncio.wait_for(q.get(), 300)
            tokens += last.token_ids
            with_drafts += last.drafted > 0
        texts.append(tokens)
        rounds, drafted, accepted = (rounds + last.rounds, drafted + last.drafted_total,
                                     accepted + last.accepted_total)
    loop.cancel()
    await worker.aclose()
    return texts, {"rounds": rounds, "rounds_with_drafts": with_drafts, "drafted": drafted,
                   "accepted": accepted}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--nodes", default="4,8,16", help="drafts per round at most (k / nodes)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    paths = resolve_model("default")
    model = LlamaModel.load(paths)
    tok = AutoTokenizer.from_pretrained(str(paths.root))
    rows = [json.loads(x) for x in PROMPTS.read_text().splitlines()][:args.prompts]
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                            add_generation_prompt=True, tokenize=True,
                                            return_dict=False)) for r in rows]
    plain = LocalGenerator(ModelRunner(model, 1024, 16)).generate(prompts, GREEDY,
                                                                  args.max_tokens)
    proposer = EagleProposer.load(ModelPaths(default_eagle_dir()), 64 << 20, 16,
                                  draft_vocab=4096)
    report = {}
    print(f"{'shape':6s} {'nodes':>5s} {'tok/round':>9s} {'accepted/round':>14s} "
          f"{'drafts/round':>12s} {'rounds w/ drafts':>16s} identical")
    for nodes in (int(x) for x in args.nodes.split(",")):
        for tree in (False, True):
            texts, st = asyncio.run(_generate(model, proposer, prompts, args.max_tokens,
                                              nodes, tree))
            r = max(st["rounds"], 1)
            row = {**st, "tokens_per_round": sum(map(len, texts)) / r,
                   "accepted_per_round": st["accepted"] / r,
                   "drafted_per_round": st["drafted"] / r, "identical": texts == plain}
            shape = "tree" if tree else "chain"
            report[f"{shape}-{nodes}"] = row
            print(f"{shape:6s} {nodes:5d} {row['tokens_per_round']:9.2f} "
                  f"{row['accepted_per_round']:14.2f} {row['drafted_per_round']:12.2f} "
                  f"{st['rounds_with_drafts'] / r:16.0%} {row['identical']}", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
