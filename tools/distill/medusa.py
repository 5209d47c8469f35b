"""`tandem distill --method medusa`: train Medusa heads on the target's recorded features.

Data: the same generation cache as EAGLE (tools.distill.data with features=True): the
target's final normed hidden state at every position and its top-K log-probs at every
generated one. Head i (1-based) at position t learns the target's distribution of token
t + 1 + i (soft cross-entropy on the teacher's top-K through the frozen LM-head rows of the
most frequent `vocab` tokens), the target itself frozen (Medusa-1). Checkpoints every few
minutes; `--resume` continues. The export holds each head's held-out top-r accuracy, from
which the candidate tree (`medusa_choices`) is built.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tandem.engine.checkpoint import LlamaConfig, load_tensors
from tandem.engine.medusa import MedusaConfig, MedusaHeads, tree_from_accuracy
from tandem.models import ModelPaths, read_hf_config, tokenizer_hash
from tools.distill.config import MedusaTrainConfig
from tools.distill.eagle import FeatureSeq, build_vocab, lr_at
from tools.distill.train import read_state, to_cpu

RANKS = 10  # ranks whose accuracy is measured (the widest tree level considered)


@dataclass(frozen=True)
class HeadData:
    """Flattened positions: a feature and, per head, the teacher's top-K for its token."""

    features: torch.Tensor  # [N, hidden] fp16
    rows: torch.Tensor  # [N, heads, K] int64: draft-vocabulary rows of the teacher's ids
    probs: torch.Tensor  # [N, heads, K] float32: teacher probs (0 = absent or out of vocab)
    best: torch.Tensor  # [N, heads] int64: the teacher's top token's row (-1 = none)


def flatten(seqs: list[FeatureSeq], heads: int, top_k: int, input_map: torch.Tensor,
            kept: torch.Tensor) -> HeadData:
    """Positions t >= gen_start - 1 of every sequence; head i's teacher is the top-K row for
    token t + 1 + i (absent past the end)."""
    feats, rows, probs, best = [], [], [], []
    for s in seqs:
        first, n_gen = s.gen_start - 1, len(s.topk_ids)
        t = torch.arange(first, len(s.features))
        r = torch.zeros(len(t), heads, top_k, dtype=torch.int64)
        p = torch.zeros(len(t), heads, top_k)
        b = torch.full((len(t), heads), -1, dtype=torch.int64)
        for i in range(1, heads + 1):
            j = t + 1 + i - s.gen_start  # the teacher row of token t + 1 + i
            ok = j < n_gen
            ids = s.topk_ids[j[ok], :top_k]
            r[ok, i - 1] = input_map[ids]
            p[ok, i - 1] = s.topk_logprobs[j[ok], :top_k].float().exp() * kept[ids]
            b[ok, i - 1] = torch.where(kept[ids[:, 0]], input_map[ids[:, 0]], -1)
        feats.append(s.features[first:])
        rows.append(r)
        probs.append(p)
        best.append(b)
    return HeadData(torch.cat(feats), torch.cat(rows), torch.cat(probs), torch.cat(best))


def batch_loss(heads: MedusaHeads, d: HeadData, idx: torch.Tensor):
    """(mean soft cross-entropy over heads, logits [heads, B, V_d]); the batch's rows of `d`
    (on the CPU) go to the heads' device."""
    device = heads.weight.device
    logp = heads(d.features[idx].to(device)).log_softmax(-1)  # [heads, B, V_d]
    rows = d.rows[idx].to(device).transpose(0, 1)  # [heads, B, K]
    probs = d.probs[idx].to(device).transpose(0, 1)
    ce = -(logp.gather(-1, rows) * probs).sum(-1)  # [heads, B]
    mass = probs.sum(-1)
    return (ce.sum(-1) / mass.gt(0).sum(-1).clamp(min=1)).mean(), logp


@torch.no_grad()
def evaluate(heads: MedusaHeads, d: HeadData, batch: int = 2048) -> dict:
    """Per head: how often its rank-r token is the target's top token, r < RANKS."""
    hits = torch.zeros(heads.cfg.num_heads, RANKS)
    count = torch.zeros(heads.cfg.num_heads)
    ce_sum, n = 0.0, 0
    for at in range(0, len(d.features), batch):
        idx = torch.arange(at, min(at + batch, len(d.features)))
        ce, logp = batch_loss(heads, d, idx)
        ce_sum, n = ce_sum + float(ce) * len(idx), n + len(idx)
        top = logp.topk(RANKS, dim=-1).indices.cpu()  # [heads, B, R]
        best = d.best[idx].T  # [heads, B]
        hits += ((top == best[..., None]) & (best[..., None] >= 0)).float().sum(1)
        count += (best >= 0).float().sum(1)
    acc = hits / count.clamp(min=1)[:, None]
    return {"accuracy": [[round(float(a), 4) for a in row] for row in acc],
            "ce": ce_sum / max(n, 1), "positions": n}


def make_heads(target: ModelPaths, seqs: list[FeatureSeq], cfg: MedusaTrainConfig,
               special: tuple[int, ...]) -> MedusaHeads:
    lcfg = LlamaConfig.from_hf(read_hf_config(target))
    tensors = load_tensors(target)
    vocab = build_vocab(seqs, cfg.vocab, lcfg.vocab_size, special)
    head = tensors["embed_tokens.weight" if lcfg.tie_word_embeddings else "lm_head.weight"]
    mcfg = MedusaConfig(cfg.num_heads, cfg.num_layers, lcfg.hidden_size, vocab.target_ids,
                        tree_from_accuracy([[1.0]] * cfg.num_heads, 1))
    torch.manual_seed(cfg.seed)
    return MedusaHeads(mcfg, head.float()[torch.tensor(vocab.target_ids)])


def card(target: ModelPaths, cfg: MedusaTrainConfig, command: str, stats: dict) -> dict:
    return {"target": {"name": target.root.name, "tokenizer_sha256": tokenizer_hash(target)},
            "command": command, "train": asdict(cfg), **stats}


def train(heads: MedusaHeads, data: HeadData, val: HeadData, cfg: MedusaTrainConfig,
          ckpt: Path, resume: bool, log=print, progress=None) -> dict:
    """Train within the time budget; checkpoint (heads + optimiser + step) to `ckpt`. The
    heads train where they are (move them first); checkpoints are written from CPU copies."""
    opt = torch.optim.AdamW([heads.weight, heads.bias], lr=cfg.lr, weight_decay=0.0)
    per_epoch = math.ceil(len(data.features) / cfg.batch_positions)
    total = max(1, int(per_epoch * cfg.epochs))
    step, wall = 0, 0.0
    if resume and ckpt.exists():
        state = read_state(ckpt)  # weights only: a resume never runs code
        heads.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, wall = state["step"], state["wall"]
        log(f"medusa: resumed at step {step} ({wall / 60:.1f} min trained)")
    start, last_ckpt = time.perf_counter() - wall, time.perf_counter()
    budget = 60 * cfg.time_budget_min
    order: list[torch.Tensor] = []
    while step < total and (not budget or time.perf_counter() - start < budget):
        if not order:  # one epoch's shuffled batches, seeded by the step (resumable)
            gen = torch.Generator().manual_seed(cfg.seed + step)
            order = list(torch.randperm(len(data.features), generator=gen)
                         .split(cfg.batch_positions))
        idx = order.pop()
        elapsed = time.perf_counter() - start
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, cfg, elapsed / budget if budget else 0.0)
        loss, _ = batch_loss(heads, data, idx)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([heads.weight, heads.bias], 1.0)
        opt.step()
        step += 1
        if progress is not None:
            progress(step, total, {"ce": float(loss)})
        if time.perf_counter() - last_ckpt > 60 * cfg.checkpoint_min:
            _save(ckpt, heads, opt, step, time.perf_counter() - start)
            last_ckpt = time.perf_counter()
    wall = time.perf_counter() - start
    _save(ckpt, heads, opt, step, wall)
    metrics = evaluate(heads, val) if len(val.features) else {}
    log(f"medusa: {step} steps in {wall / 60:.1f} min; held-out ce {metrics.get('ce')}")
    return {"steps": step, "total_steps": total, "train_wall_s": round(wall, 1), **metrics}


def split(seqs: list[FeatureSeq], val_fraction: float, seed: int):
    order = list(range(len(seqs)))
    random.Random(seed).shuffle(order)
    n_val = int(len(seqs) * val_fraction)
    return [seqs[i] for i in order[n_val:]], [seqs[i] for i in order[:n_val]]


def _save(path: Path, heads: MedusaHeads, opt, step: int, wall: float) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": to_cpu(heads.state_dict()), "opt": to_cpu(opt.state_dict()),
                "step": step, "wall": wall}, tmp)
    tmp.rename(path)
