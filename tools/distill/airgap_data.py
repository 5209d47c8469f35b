"""The data an air-gapped run trains on (airgap_train.py): the target's answers to the
prompts, then one teacher-forced pass over prompt + answer that records the head's features
(the final normed hidden state, or with --method eagle3 three layers' outputs) and the
target's top-K log-probs, written shard by shard (resumable). Without tandem: torch,
transformers, safetensors and the standard library only.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

try:  # imported as tools.distill.airgap_data (tandem's side, tests)
    from .airgap_head import TOP_K
    from .airgap_parts import Progress, log
except ImportError:  # run from the bundle, beside airgap_train.py
    from airgap_head import TOP_K
    from airgap_parts import Progress, log

if TYPE_CHECKING:
    from airgap_train import Config

TEMPERATURE, SAMPLED_EVERY = 0.7, 3


def load_target(root: Path, device: str):
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(root)).to(device=device, dtype=dtype)
    return model.eval()


def _pad(seqs: list[list[int]], pad: int, left: bool):
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad, dtype=torch.int64)
    mask = torch.zeros((len(seqs), n), dtype=torch.int64)
    for i, s in enumerate(seqs):
        at = slice(n - len(s), n) if left else slice(0, len(s))
        ids[i, at], mask[i, at] = torch.tensor(s), 1
    return ids, mask


def answer(model, prompts: list[list[int]], spec: dict, cfg: Config, sampled: bool):
    """The target's answers (up to and including the first stop token)."""
    dev, stop = model.device, set(spec["stop_ids"])
    ids, mask = _pad(prompts, spec["pad_id"], left=True)
    kw = dict(do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0) if sampled else \
        dict(do_sample=False)
    out = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                         max_new_tokens=cfg.max_new_tokens, pad_token_id=spec["pad_id"],
                         eos_token_id=spec["stop_ids"], **kw)
    answers = []
    for row in out[:, ids.shape[1]:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in stop), len(row))
        answers.append(row[:cut])
    return answers


def teacher_forced(model, seqs: list[list[int]], starts: list[int], pad: int,
                   layer_ids: list[int] | None = None):
    """Per sequence: the features of positions 0..T-1 [T, h] fp16 (the final normed hidden
    states; with layer_ids, the outputs of those layers side by side, [T, 3h]) and the top-K
    log-probs predicting each answer token [G, K]; plus greedy hits of those rows."""
    ids, mask = _pad(seqs, pad, left=False)
    out = model.base_model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                           output_hidden_states=bool(layer_ids))
    hidden = out.last_hidden_state  # hidden_states[i + 1]: the output of layer i
    feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], -1) if layer_ids else hidden
    lm_head = model.get_output_embeddings()
    out = []
    for i, (s, p) in enumerate(zip(seqs, starts)):
        lp = lm_head(hidden[i, p - 1:len(s) - 1]).float().log_softmax(-1)
        vals, top = lp.topk(TOP_K, dim=-1)
        hits = (top[:, 0].cpu() == torch.tensor(s[p:])).sum().item()
        out.append((feats[i, :len(s) - 1].half().cpu(), top.int().cpu(), vals.half().cpu(),
                    hits))
    return out


def make_shard(model, batch: list[dict], spec: dict, cfg: Config, sampled: bool, path: Path):
    """Generate one batch, record it, write it atomically; (answer tokens, greedy hits)."""
    from safetensors.torch import save_file

    prompts = [p["ids"] for p in batch]
    answers = answer(model, prompts, spec, cfg, sampled)
    keep = [i for i, a in enumerate(answers) if len(a) >= 2]
    if not keep:  # nothing to learn from (every answer stopped at once): an empty shard
        save_file({"offsets": torch.zeros(1, dtype=torch.int64)}, str(path))
        return 0, 0
    seqs = [prompts[i] + answers[i] for i in keep]
    rec = teacher_forced(model, seqs, [len(prompts[i]) for i in keep], spec["pad_id"],
                         spec["eagle3_layer_ids"] if cfg.method == "eagle3" else None)
    offsets = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    t = {"ids": torch.tensor([x for s in seqs for x in s], dtype=torch.int32),
         "offsets": offsets, "gen_start": torch.tensor([len(prompts[i]) for i in keep]),
         "val": torch.tensor([batch[i]["split"] == "val" for i in keep]),
         "features": torch.cat([r[0] for r in rec]), "topk_ids": torch.cat([r[1] for r in rec]),
         "topk_lp": torch.cat([r[2] for r in rec])}
    tmp = path.with_suffix(".tmp")
    save_file(t, str(tmp), metadata={"sampled": str(sampled)})
    tmp.replace(path)
    return sum(len(answers[i]) for i in keep), sum(r[3] for r in rec) if not sampled else -1


def generate(model, prompts: list[dict], spec: dict, cfg: Config, clock: dict) -> None:
    """Fill OUT/data shard by shard (skipping those on disk) until every prompt is answered or
    the generation share of the budget is used."""
    data = cfg.out / "data"
    data.mkdir(parents=True, exist_ok=True)
    shards = [prompts[i:i + cfg.gen_batch] for i in range(0, len(prompts), cfg.gen_batch)]
    todo = [s for s in range(len(shards)) if not (data / f"shard-{s:05d}.safetensors").exists()]
    budget = cfg.gen_fraction * 60 * cfg.minutes
    log(f"generate: {len(shards) - len(todo)}/{len(shards)} shards on disk; "
        f"{max(0.0, budget - clock['gen_s']) / 60:.1f} of {budget / 60:.1f} min left for more")
    bar, tokens, start = Progress("generate"), 0, time.perf_counter()
    for n, s in enumerate(todo):
        if clock["gen_s"] >= budget:
            log("generate: time share used; training on the shards so far")
            break
        t0 = time.perf_counter()
        sampled = s % SAMPLED_EVERY == SAMPLED_EVERY - 1
        torch.manual_seed(cfg.seed * 100003 + s)  # a sampled shard is the same on a rerun
        got, hits = make_shard(model, shards[s], spec, cfg, sampled,
                               data / f"shard-{s:05d}.safetensors")
        tokens += got
        if hits >= 0:
            clock["greedy_hits"] = clock.get("greedy_hits", 0) + hits
            clock["greedy_tokens"] = clock.get("greedy_tokens", 0) + got
        clock["gen_s"] += time.perf_counter() - t0
        (cfg.out / "clock.json").write_text(json.dumps(clock))
        rate = tokens / (time.perf_counter() - start)
        left = min((len(todo) - n - 1) / (n + 1) * (time.perf_counter() - start),
                   budget - clock["gen_s"])
        bar(n + 1, len(todo), f"shards, {rate:.0f} answer tok/s", left)
