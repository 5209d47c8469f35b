"""One agreement figure from training to service: an EAGLE head's first-draft agreement with
the target, computed the trainer's way and the served way on the very same sequences.

The target answers prompts through the distillation data path (tools.distill.data: the
recording generator, a shard, `load_feature_seqs`), so both computations read the same tokens,
the same teacher top-1 and the same fp16 features the trainer reads:

- trained: `tools.distill.eagle.evaluate` (the trainer's held-out validation, teacher-forced)
  on the exported head loaded back as the training module;
- served: the real `EagleProposer`, asked for one draft at every position from the true
  prefix and the target's true features there, as a draft worker is after a commit.

Both score the entries the trainer scores: entry t (reading feature t-1 and token t) drafts
token t+1, for every t from the prompt's last token on; agreement = the draft equals the
target's top-1 token there. A draft worker never drafts the first answer token (the target
samples it in prefill), so the served figure is also given without it (`served_from_answer`).
"""
from __future__ import annotations

import json
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.proposers.eagle import EagleProposer
from tandem.sampling_params import SamplingParams
from tandem.spec import DraftRequest
from tools.distill.acceptance import load_prompts
from tools.distill.config import DataConfig, EagleTrainConfig
from tools.distill.corpus import Prompt, build_prompts, encode_prompt
from tools.distill.data import _RecordingGenerator, generate_shard
from tools.distill.eagle import FeatureSeq, evaluate, load_feature_seqs
from tools.distill.eagle_head import EagleTrainHead

GREEDY = SamplingParams(temperature=0.0)


def record_answers(runner, tokenizer, prompts: list[list[int]], params: list[SamplingParams],
                   max_new_tokens: int, batch: int = 8) -> list[FeatureSeq]:
    """The target's answers (prompt i under params[i]) with its top-K and fp16 features,
    exactly as the trainer's data: shards of the recording generator, read back by
    load_feature_seqs. Greedy prompts go in batches, seeded ones alone (their seed is
    the prompt's own)."""
    gen = _RecordingGenerator(runner, DataConfig.top_k, features=True)
    cfg = DataConfig(max_new_tokens=max_new_tokens, features=True, dtype="float32")
    stop = tuple(t for t in [tokenizer.eos_token_id] if t is not None)
    groups, cur = [], []
    for i, p in enumerate(params):
        if cur and (not p.is_greedy or not params[cur[0]].is_greedy or len(cur) == batch):
            groups.append(cur)
            cur = []
        cur.append(i)
    groups += [cur] if cur else []
    with tempfile.TemporaryDirectory() as tmp:
        for n, g in enumerate(groups):
            generate_shard(gen, [prompts[i] for i in g], params[g[0]], cfg, stop,
                           Path(tmp) / f"shard-{n:05d}.safetensors")
        return load_feature_seqs(Path(tmp))


def trained_top1(head_dir: Path, seqs: list[FeatureSeq], cfg: EagleTrainConfig) -> dict:
    """The trainer's validation figures for the exported head on `seqs`."""
    return evaluate(EagleTrainHead.from_export(head_dir), seqs, cfg)


def heldout_agreement(runner, tokenizer, head: EagleTrainHead, cfg: EagleTrainConfig,
                      prompts: int, new_tokens: int, evaluate=evaluate) -> dict:
    """The trainer's validation (`evaluate`, EAGLE-1's unless given) on the target's greedy
    answers to the held-out chat prompts (draft_service/data/heldout_prompts.jsonl, never in
    any training set), with the runner's features: the figure the served proposer
    reproduces (benchmarks/eagle_agreement.py)."""
    texts = load_prompts(None)[:prompts]
    ids = [encode_prompt(tokenizer, Prompt("chat", t, "heldout"), 256) for t in texts]
    seqs = record_answers(runner, tokenizer, ids, [GREEDY] * len(ids), new_tokens)
    return {**evaluate(head, seqs, cfg), "prompts": len(seqs), "new_tokens": new_tokens}


@dataclass
class Tally:
    hits: int = 0
    n: int = 0

    def rate(self) -> float | None:
        return round(self.hits / self.n, 4) if self.n else None


def served_top1(prop: EagleProposer, seqs: list[FeatureSeq], features=None) -> dict:
    """First-draft agreement through the proposer along each sequence's own tokens.
    `features`: per sequence, features to serve instead of the recorded ones (a variant)."""
    every, answer = Tally(), Tally()
    for i, s in enumerate(seqs):
        feats = s.features.float() if features is None else features[i]
        ids = s.ids.tolist()
        for t in range(max(s.gen_start - 1, 1), len(s.features)):  # entry t drafts t + 1
            want = int(s.topk_ids[t + 1 - s.gen_start, 0])
            res = prop.propose([DraftRequest(("agree", i), ids[:t + 1], t + 1, 1, GREEDY,
                                             features=feats[:t])])[0]
            hit = bool(res.tokens) and res.tokens[0].token_id == want
            every.hits, every.n = every.hits + hit, every.n + 1
            if t >= s.gen_start:
                answer.hits, answer.n = answer.hits + hit, answer.n + 1
        prop.release(("agree", i))
    return {"served": every.rate(), "served_from_answer": answer.rate(), "positions": every.n}


def training_split(card: dict, data_dir: Path | None = None
                   ) -> tuple[list[Prompt], list[SamplingParams], int]:
    """The prompts of the head's own training run, each with the sampling it was answered
    under, rebuilt from the card: the prompt set `tandem distill` generated from, its shards
    in order (every `sampled_every`-th at temperature, seeded per shard and batch row) and
    the trainer's seeded shuffle, whose first n_val sequences were held out. Returns
    (prompts in that shuffled order, their params, n_val). Assumes every prompt of the
    first `sequences` gave a sequence (>= 2 tokens) and no shard was missing. A "self" mix
    was sampled from the target: its prompts are read from the run's `data_dir`."""
    d, t = card["data"], card["train"]
    prompts = data_prompts(d, data_dir)[:d["sequences"]]
    data = DataConfig(sampled_every=d["sampled_every"], temperature=d["temperature"],
                      seed=d["seed"])
    params = []
    for i in range(len(prompts)):
        p = data.shard_params(i // d["batch_size"])
        params.append(p if p.is_greedy else SamplingParams(
            temperature=p.temperature, seed=p.seed + i % d["batch_size"]))
    order = list(range(len(prompts)))
    random.Random(t["seed"]).shuffle(order)
    n_val = max(1, int(len(order) * t["val_fraction"]))
    return [prompts[i] for i in order], [params[i] for i in order], n_val


def data_prompts(data: dict, data_dir: Path | None) -> list[Prompt]:
    """The prompt set a card's data section was generated from."""
    if data["mix"] != "self":
        return build_prompts(data["num_prompts"], data["seed"], mix=data["mix"])
    path = Path(data_dir or ".") / "prompts.jsonl"
    if data_dir is None or not path.is_file():
        raise ValueError(f"the head's data came from prompts the target wrote (mix 'self'): "
                         f"pass the run's --data-dir, which holds prompts.jsonl (not {path})")
    return [Prompt(**json.loads(x)) for x in path.read_text().splitlines()]


def single_path_features(runner, seqs: list[FeatureSeq], fp16: bool = False
                         ) -> list[torch.Tensor]:
    """Variant: each sequence's features recomputed alone (prefill, then one token per
    forward, as this benchmark used to), in the runner's dtype, rounded to fp16 if asked."""
    from tandem.engine.model_runner import SeqChunk

    out = []
    for s in seqs:
        ids = s.ids.tolist()
        table = list(range(-(-len(ids) // runner.block_size)))
        _, h = runner.forward([SeqChunk(ids[:s.gen_start], 0, table, 1)], with_hidden=True)
        rows = [h]
        for t in range(s.gen_start, len(ids) - 1):
            _, h = runner.forward([SeqChunk(ids[t:t + 1], t, table, 1)], with_hidden=True)
            rows.append(h)
        f = torch.cat(rows).float()
        out.append(f.half().float() if fp16 else f)
    return out
