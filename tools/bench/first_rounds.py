"""Where a short answer's rounds go, in one process (no gateway, no network): the real
verifier engine and its history drafts (ngram, suffix, auto) on the categories workload's
prompts, one session at a time, greedy, the cross-request suffix cache off; the cost model
from the target's forwards timed here. Prints, per prompt and method, the decode rounds, the
round of the first accepted draft, and each round's (drafted, accepted).

  python -m tools.bench.first_rounds [--prompts 0,1,2] [--methods ngram,suffix,auto]
                                     [--tokens 192] [--curve '{"1": 30, "16": 90}']

--curve fixes the cost model (ms by tokens verified) instead of timing the forwards here, so
that two runs (before and after a change) size their rounds alike on a noisy host; each
answer's modelled decode time is then the sum of its rounds' costs on that curve, and plain's
its tokens times cost(1).
"""
from __future__ import annotations

import argparse
import asyncio
import json

from tandem.engine.block_manager import BlockManager
from tandem.engine.model_runner import ModelRunner
from tandem.proposers.suffix import SuffixConfig
from tandem.sampling_params import SamplingParams
from tandem.spec import Method
from tandem.spec.cost import CostModel
from tools.bench.category_prompts import TASKS
from verify_service.config import SchedulerConfig
from verify_service.drafts.history import HistoryDrafts
from verify_service.engine import Engine, EngineConfig
from verify_service.forward.executor import Executor
from verify_service.policy.scheduler import Scheduler
from verify_service.session.params import GenerateParams


def play(model, prompt: list[int], method: Method, tokens: int, eos: int,
         cost: CostModel) -> list[tuple[int, int]]:
    """One session through a fresh engine: (drafted, accepted) per round after the prefill."""

    async def main():
        sched = Scheduler(BlockManager(512, 16), SchedulerConfig(max_spec_tokens=16),
                          CostModel(dict(cost.ms)))
        engine = Engine(Executor(ModelRunner(model, 512, 16)), sched, EngineConfig(),
                        model.cfg.vocab_size,
                        history=HistoryDrafts(16, SuffixConfig(per_tenant=True, cache_tokens=0)))
        loop = asyncio.create_task(engine.run())
        q = engine.submit(GenerateParams(
            session_id="s", prompt=tuple(prompt), committed=(),
            sampling=SamplingParams(temperature=0.0), max_new_tokens=tokens,
            stop_token_ids=frozenset({eos}), method=method))
        rounds, last = [], None
        while last is None or last.finish_reason is None:
            last = await asyncio.wait_for(q.get(), 300)
            rounds.append((last.drafted, last.accepted))
        loop.cancel()
        return rounds[1:]  # the first output is the prefill's token

    return asyncio.run(main())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default="0,1,2", help="indices into category_prompts.TASKS")
    ap.add_argument("--methods", default="ngram,suffix,auto")
    ap.add_argument("--tokens", type=int, default=192)
    ap.add_argument("--curve", default="", help="JSON {tokens: ms}: a fixed cost model")
    args = ap.parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    from tandem.engine.llama import LlamaModel
    from tandem.models import resolve_model
    from verify_service.policy.calibration import calibrate

    torch.set_num_threads(1)
    paths = resolve_model("default")
    model, tok = LlamaModel.load(paths), AutoTokenizer.from_pretrained(str(paths.root))
    cost = CostModel({int(q): float(v) for q, v in json.loads(args.curve).items()}
                     if args.curve else
                     calibrate(ModelRunner(model, 64, 16), (1, 2, 4, 8, 12, 16, 17), reps=3))
    print("verify ms by tokens:", {q: round(v, 1) for q, v in cost.ms.items()})
    for i in (int(x) for x in args.prompts.split(",")):
        prompt = tok.apply_chat_template([{"role": "user", "content": TASKS[i][1]}],
                                         add_generation_prompt=True, tokenize=True,
                                         return_dict=False)
        for name in args.methods.split(","):
            rounds = play(model, prompt, Method[name.upper()], args.tokens, tok.eos_token_id,
                          cost)
            first = next((j + 1 for j, (_, a) in enumerate(rounds) if a), None)
            made = len(rounds) + sum(a for _, a in rounds)  # each round: accepted + one
            ms = sum(cost.cost(d + 1) for d, _ in rounds)
            print(f"prompt {i} ({TASKS[i][0]}) {name}: {made} tokens in {len(rounds)} decode "
                  f"rounds, modelled {made * cost.cost(1) / ms:.2f}x plain's decode; first "
                  f"accepted draft in round {first}; (drafted, accepted): {rounds[:12]}")


if __name__ == "__main__":
    main()
