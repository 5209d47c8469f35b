"""EAGLE heads scored on one distillation cache's validation split (and as many of its training
conversations), with the trainer's own teacher-forced computation: how a head did on the data
a run trained another head on, e.g. the shipped head before and after a fine-tune.

    python benchmarks/eagle_val_split.py --data-dir DATA --seed 2 HEAD_BEFORE HEAD_AFTER

--seed and --val-fraction must be the run's (`tandem distill --seed`, EagleTrainConfig's
val_fraction): they rebuild its split (conversations shuffled with Random(seed), the first
val_fraction held out).
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from tools.distill.config import EagleTrainConfig
from tools.distill.eagle import evaluate, load_feature_seqs
from tools.distill.eagle_head import EagleTrainHead


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("heads", nargs="+", type=Path, help="exported EAGLE head directories")
    ap.add_argument("--data-dir", type=Path, required=True, help="the run's --data-dir")
    ap.add_argument("--seed", type=int, required=True, help="the run's --seed")
    ap.add_argument("--val-fraction", type=float, default=EagleTrainConfig.val_fraction)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    seqs = load_feature_seqs(args.data_dir)
    if len(seqs) < 2:
        ap.error(f"{args.data_dir}: fewer than 2 conversations with features")
    random.Random(args.seed).shuffle(seqs)
    n = max(1, int(len(seqs) * args.val_fraction))
    sets = {"val": seqs[:n], "train_sample": seqs[n:2 * n]}
    for head_dir in args.heads:
        head = EagleTrainHead.from_export(head_dir)
        cfg = EagleTrainConfig(vocab=len(head.vocab.target_ids))
        for name, part in sets.items():
            got = evaluate(head, part, cfg)
            print(json.dumps({"head": str(head_dir), "set": name, "conversations": len(part),
                              **{k: round(v, 4) for k, v in got.items()}}), flush=True)


if __name__ == "__main__":
    main()
