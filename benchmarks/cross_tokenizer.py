"""Reaches inside: the worker's TextBridge time and k=1 agreement are in no response or metric.

A draft with another tokenizer: SmolLM2-135M-Instruct drafting for Gemma 3 270M, against
plain decoding, greedy, one session at a time, in one run (interleaved per prompt).

The verifier's engine and a real DraftWorker (the bridged proposer, on its own forward thread)
share one process, linked without gRPC (tools/bench/inproc.py), as the engine tests run them.
Reports tokens/s, acceptance (accepted / drafted), tokens per round, whether the text equals
plain decoding's, the time the draft worker spent re-encoding text (TextBridge), and, along
plain's text, how often the draft's greedy token is the target's (k = 1 acceptance free of
the verifier's timing decisions) with the cost of a draft step against a target step.

    OMP_NUM_THREADS=1 python benchmarks/cross_tokenizer.py [--prompts 6] [--tokens 64] [--k 4]
"""
from __future__ import annotations

import argparse
import asyncio
import time

from draft_service.limits import Limits
from draft_service.worker import DraftWorker
from tandem.engine.block_manager import BlockManager
from tandem.engine.llama import LlamaModel
from tandem.engine.model_runner import ModelRunner
from tandem.models import ModelPaths, fetch_model, generation_eos_ids, resolve_model
from tandem.proposers.bridged import BridgedProposer
from tandem.sampling_params import SamplingParams
from tandem.spec import DraftRequest, Method
from tandem.spec.cost import CostModel
from tools.bench.inproc import OnePool, WorkerLink
from verify_service.config import SchedulerConfig
from verify_service.engine import Engine, EngineConfig
from verify_service.forward.executor import Executor
from verify_service.policy.scheduler import Scheduler
from verify_service.session.params import GenerateParams

PROMPTS = ["Name three rivers in Europe.", "Repeat exactly: the cat sat on the mat.",
           "What is 12 times 7?", "Write a short poem about the sea.",
           "Explain what a noun is, in two sentences.", "List the days of the week.",
           "Give three tips for sleeping well.", "Translate 'good morning' into French."]


async def _generate(model, proposer, prompt, method, max_new, k, eos) -> tuple:
    """(tokens, seconds, drafted, accepted, rounds) of one greedy session."""
    runner = ModelRunner(model, 256, 16)
    sched = Scheduler(BlockManager(256, 16), SchedulerConfig(max_spec_tokens=k), CostModel())
    engine = Engine(Executor(runner, None), sched, EngineConfig(max_sessions=8),
                    model.cfg.vocab_size)
    worker = DraftWorker({Method.DRAFT_MODEL: proposer},
                         Limits(model.cfg.vocab_size, 8192, max_sessions=8))
    engine.drafts.pool = OnePool(WorkerLink(engine, worker))
    loop = asyncio.create_task(engine.run())
    start = time.perf_counter()
    q = engine.submit(GenerateParams(
        session_id="bench", prompt=tuple(prompt), committed=(),
        sampling=SamplingParams(temperature=0.0), max_new_tokens=max_new,
        stop_token_ids=frozenset(eos), method=method, num_speculative_tokens=k), None)
    tokens, last = [], None
    while last is None or last.finish_reason is None:
        last = await q.get()
        tokens += last.token_ids
    seconds = time.perf_counter() - start
    loop.cancel()
    await worker.aclose()
    return tokens, seconds, last.drafted_total, last.accepted_total, last.rounds


def _agreement(proposer: BridgedProposer, prompt: list[int], tokens: list[int]) -> tuple:
    """Along plain greedy text: (positions where the bridged draft's greedy proposal is the
    target's token, positions, seconds drafting): k = 1 acceptance, without timing effects."""
    hits, start = 0, time.perf_counter()
    for i, want in enumerate(tokens):
        ids = prompt + tokens[:i]
        req = DraftRequest(session_key="agree", token_ids=ids, num_committed=len(ids), max_tokens=1)
        (res,) = proposer.propose([req])
        hits += bool(res.tokens) and res.tokens[0].token_id == want
    proposer.release("agree")
    return hits, len(tokens), time.perf_counter() - start


def _timed_bridge(proposer: BridgedProposer) -> list[float]:
    """Accumulates the seconds the bridge spends turning target ids into draft ids."""
    spent, inner = [0.0], proposer.bridge.draft_ids

    def draft_ids(*args):
        t = time.perf_counter()
        try:
            return inner(*args)
        finally:
            spent[0] += time.perf_counter() - t
    proposer.bridge.draft_ids = draft_ids
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens cap")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    target = ModelPaths(fetch_model("gemma3-270m"))
    tok = AutoTokenizer.from_pretrained(str(target.root))
    model = LlamaModel.load(target)
    proposer = BridgedProposer.load(resolve_model("SmolLM2-135M-Instruct"), target, 64 << 20)
    bridge_s = _timed_bridge(proposer)
    eos = generation_eos_ids(target)
    tot = {m: [0, 0.0, 0, 0, 0] for m in (Method.NONE, Method.DRAFT_MODEL)}
    same, agree = 0, [0, 0, 0.0]
    prompts = PROMPTS[:args.prompts]
    for text in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                      add_generation_prompt=True, return_dict=False)
        out = {}
        for method in (Method.NONE, Method.DRAFT_MODEL):  # interleaved per prompt
            tokens, s, d, a, r = asyncio.run(
                _generate(model, proposer, ids, method, args.tokens, args.k, eos))
            out[method] = tokens
            for i, v in enumerate((len(tokens), s, d, a, r)):
                tot[method][i] += v
        same += out[Method.NONE] == out[Method.DRAFT_MODEL]
        for i, v in enumerate(_agreement(proposer, ids, out[Method.NONE])):
            agree[i] += v
    plain, spec = tot[Method.NONE], tot[Method.DRAFT_MODEL]
    plain_tps, spec_tps = plain[0] / plain[1], spec[0] / spec[1]
    print(f"gemma3-270m target, SmolLM2-135M-Instruct draft ({proposer.bridge.vocab.size} "
          f"shared tokens), {len(prompts)} chat prompts x {args.tokens} tokens, greedy, "
          f"k<={args.k}")
    print(f"plain:         {plain_tps:.2f} tokens/s")
    print(f"bridged draft: {spec_tps:.2f} tokens/s ({spec_tps / plain_tps:.2f}x), "
          f"acceptance {spec[3] / max(spec[2], 1):.2f} ({spec[3]}/{spec[2]}), "
          f"{spec[0] / max(spec[4], 1):.2f} tokens a round")
    print(f"along plain's text the draft's greedy token is the target's at "
          f"{agree[0]}/{agree[1]} positions ({agree[0] / max(agree[1], 1):.2f}); a draft "
          f"step (bridge included) {1e3 * agree[2] / max(agree[1], 1):.1f} ms, a plain "
          f"target step {1e3 * plain[1] / max(plain[0], 1):.1f} ms")
    print(f"text identical to plain: {same}/{len(prompts)}; re-encoding took "
          f"{1e3 * bridge_s[0]:.1f} ms of the draft worker's {spec[1]:.1f} s")


if __name__ == "__main__":
    main()
