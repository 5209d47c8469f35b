"""Reaches inside: it times one verify round alone, which the gateway's wall time cannot isolate.

What shipping EAGLE features costs the verifier (issue "Speculation that pays", part B).

  python benchmarks/features_cost.py [--reps 30] [--k 4] [--out results/features_cost.json]

One verify round (batch 1, a 200-token cached prefix, k drafts) through the real Executor,
interleaved with and without `want_features`: the round's time both ways, and the bytes the
commit then carries (fp16 rows of the kept positions) plus their protobuf encoding.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from tandem.engine.block_manager import BlockManager
from tandem.engine.llama import LlamaModel
from tandem.engine.model_runner import ModelRunner, SeqChunk
from tandem.models import ModelPaths, fetch_default_target
from tandem.sampling_params import SamplingParams
from tandem.spec import DraftToken
from verify_service.forward.executor import Executor
from verify_service.forward.step import StepInput


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = LlamaModel.load(ModelPaths(fetch_default_target()))
    runner = ModelRunner(model, 64, 16)
    blocks = BlockManager(64, 16)
    prefix = [(7 * j) % 1000 + 100 for j in range(200)]
    blocks.allocate("s", prefix + [0] * (args.k + 1))
    table = blocks.block_table("s")
    runner.forward([SeqChunk(prefix, 0, table)])
    executor = Executor(runner)
    drafts = [DraftToken(11 + i) for i in range(args.k)]  # rejected at once: kept = 1 row
    greedy = SamplingParams(temperature=0.0)

    def round_ms(want: bool) -> tuple[float, int]:
        inp = StepInput([prefix[-1], *[d.token_id for d in drafts]], len(prefix) - 1, table,
                        drafts, greedy, want_features=want)
        t0 = time.perf_counter()
        (out,), _ = executor.execute([inp])
        ms = (time.perf_counter() - t0) * 1e3
        return ms, 0 if out.features is None else len(out.features.data)

    times: dict[bool, list[float]] = {False: [], True: []}
    size = 0
    for _ in range(args.reps):
        for want in (False, True):
            ms, n = round_ms(want)
            times[want].append(ms)
            size = max(size, n)
    from tandem.v1 import draft_pb2

    rows_all = (args.k + 1) * 2 * model.cfg.hidden_size  # every draft accepted
    wire = len(draft_pb2.CommitTokens(session_id="s" * 16, token_ids=list(range(args.k + 1)),
                                      features=draft_pb2.TargetFeatures(
                                          hidden_size=576, data=b"\0" * rows_all))
               .SerializeToString())
    res = {"k": args.k, "reps": args.reps,
           "round_ms_plain": round(statistics.median(times[False]), 2),
           "round_ms_with_features": round(statistics.median(times[True]), 2),
           "overhead_ms": round(statistics.median(times[True]) - statistics.median(times[False]),
                                3),
           "bytes_per_kept_row": 2 * model.cfg.hidden_size,
           "bytes_one_row_kept": size, "commit_bytes_all_accepted": wire}
    print(json.dumps(res, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
