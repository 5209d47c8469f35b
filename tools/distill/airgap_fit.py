"""Training an air-gapped run's EAGLE head (airgap_head.py): tools/distill/eagle.py's losses
(feature regression + token cross-entropy against the teacher's top-K, two draft steps), or
an EAGLE-3 head's training-time test (airgap_head3.py); batches by padded tokens, a warm-up
then cosine schedule over the time budget, and a resumable checkpoint. Without tandem: torch
and the standard library only.
"""
from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

try:  # imported as tools.distill.airgap_fit (tandem's side, tests)
    from .airgap_head import Head, Seq
    from .airgap_head3 import Head3, collate3, step_losses3, teacher_rows
    from .airgap_parts import Progress, log
except ImportError:  # run from a bundle, beside airgap_train.py
    from airgap_head import Head, Seq
    from airgap_head3 import Head3, collate3, step_losses3, teacher_rows
    from airgap_parts import Progress, log

if TYPE_CHECKING:
    from airgap_train import Config


# ---- training (tools/distill/eagle.py's losses: feature regression + token CE, 2 steps) ----
def batches(seqs: list[Seq], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    order, out, cur = sorted(range(len(seqs)), key=lambda i: len(seqs[i].ids)), [], []
    for i in order:
        if cur and (len(cur) + 1) * len(seqs[i].ids) > batch_tokens:
            out.append(cur)
            cur = []
        cur.append(i)
    out += [cur] if cur else []
    rng.shuffle(out)
    return out


def collate(seqs: list[Seq], head: Head, device) -> tuple:
    """Entries t = 1..T-1 of each sequence, right-padded: token t, feature t-1 and feature t
    (the regression target), and teacher_rows' rows of answer tokens."""
    n, b, h = max(len(s.features) - 1 for s in seqs), len(seqs), seqs[0].features.shape[1]
    feats, target, reg_mask = torch.zeros(b, n, h), torch.zeros(b, n, h), torch.zeros(b, n)
    for i, s in enumerate(seqs):
        m = len(s.features) - 1
        feats[i, :m], target[i, :m] = s.features[:m].float(), s.features[1:m + 1].float()
        reg_mask[i, :m] = 1
    ids, cls_mask, t_rows, t_probs = teacher_rows(seqs, head.vocab, head.geo["vocab_size"], n)
    return tuple(x.to(device) for x in (ids, feats, target, reg_mask, cls_mask, t_rows, t_probs))


def _losses(head, pred, target, reg_mask, cls_mask, t_rows, t_probs):
    reg = (F.smooth_l1_loss(pred, target, reduction="none").mean(-1) * reg_mask).sum()
    logp = (pred @ head.embed.T).float().log_softmax(-1)
    cls = (-(logp.gather(-1, t_rows) * t_probs).sum(-1) * cls_mask).sum()
    top1 = ((logp.argmax(-1) == t_rows[..., 0]) & (t_probs[..., 0] > 0)).float()
    n = cls_mask.sum()
    return reg / reg_mask.sum().clamp(min=1), cls / n.clamp(min=1), (top1 * cls_mask).sum(), n


def step_losses(head: Head, batch: tuple, cfg: Config) -> tuple[torch.Tensor, dict]:
    ids, feats, target, reg_mask, cls_mask, t_rows, t_probs = batch
    pos = torch.arange(ids.shape[1], device=ids.device)
    pred, kv = head(ids, feats, pos)
    reg, cls, hit1, n1 = _losses(head, pred, target, reg_mask, cls_mask, t_rows, t_probs)
    feats2 = torch.cat([feats[:, :1], pred[:, :-1]], 1)  # entry t reads predicted t-1
    m2 = reg_mask.clone()
    m2[:, 0] = 0
    pred2 = head.forward2(ids, feats2, pos, kv)
    reg2, cls2, hit2, n2 = _losses(head, pred2, target, m2, cls_mask * m2, t_rows, t_probs)
    loss = reg + cfg.cls_weight * cls + cfg.step2_weight * (reg2 + cfg.cls_weight * cls2)
    return loss, {"cls": cls.item(), "hit1": hit1.item(), "n1": n1.item(), "hit2": hit2.item(),
                  "n2": n2.item()}


def recipe(head: Head | Head3):
    """The head's batches and losses: (collate(seqs, head, device), losses(head, batch, cfg)
    -> (loss, {"hitj", "nj", ...}))."""
    if isinstance(head, Head3):  # EAGLE-3: the training-time test over --ttt-steps
        return collate3, lambda h, b, cfg: step_losses3(h, b, cfg.ttt_steps, cfg.ttt_decay)
    return collate, step_losses


@torch.no_grad()
def evaluate(head: Head | Head3, seqs: list[Seq], cfg: Config) -> dict:
    """Teacher-forced agreement with the target's top-1 token at each draft step."""
    head.eval()
    tot, (collate_fn, losses) = {}, recipe(head)
    dev = head.fc.weight.device
    for idx in batches(seqs, cfg.batch_tokens, random.Random(0)):
        _, got = losses(head, collate_fn([seqs[i] for i in idx], head, dev), cfg)
        for k, v in got.items():
            if k.startswith(("hit", "n")):
                tot[k] = tot.get(k, 0.0) + v
    head.train()
    steps = sorted(int(k[1:]) for k in tot if k.startswith("n"))
    return {**{f"top1_step{j}": round(tot[f"hit{j}"] / max(tot[f"n{j}"], 1), 4) for j in steps},
            "positions": int(tot["n1"])}


def lr_at(step: int, total: int, cfg: Config, time_frac: float) -> float:
    """Warmup, then cosine to 10% over the steps or the time, whichever ends first."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = min(1.0, max((step - cfg.warmup) / max(1, total - cfg.warmup), time_frac))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def train(head: Head | Head3, seqs: list[Seq], cfg: Config, budget_s: float) -> dict:
    """Train until the epochs or budget_s (cumulative over reruns) are spent; checkpoint
    (weights, optimiser, step, seconds) to OUT/train_state.pt every --checkpoint-min."""
    ckpt, dev = cfg.out / "train_state.pt", head.fc.weight.device
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=cfg.lr,
                            weight_decay=0.0)
    st = {"step": 0, "train_s": 0.0, "positions": 0}
    if ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        head.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        st = state["progress"]
        log(f"train: resumed at step {st['step']} ({st['train_s'] / 60:.1f} min trained)")
    total = max(1, int(len(batches(seqs, cfg.batch_tokens, random.Random(0))) * cfg.epochs))
    amp = torch.autocast("cuda", torch.bfloat16, enabled=dev.type == "cuda")
    bar, start, last, todo = Progress("train"), time.perf_counter() - st["train_s"], 0.0, []
    collate_fn, losses = recipe(head)
    while st["step"] < total and time.perf_counter() - start < budget_s:
        todo = todo or batches(seqs, cfg.batch_tokens, random.Random(cfg.seed + st["step"]))
        batch = collate_fn([seqs[i] for i in todo.pop()], head, dev)
        for g in opt.param_groups:
            g["lr"] = lr_at(st["step"], total, cfg, (time.perf_counter() - start) / budget_s)
        with amp:
            loss, got = losses(head, batch, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        st["step"], st["positions"] = st["step"] + 1, st["positions"] + int(got["n1"])
        el = time.perf_counter() - start
        eta = min(budget_s - el, el / st["step"] * (total - st["step"]))
        bar(st["step"], total, f"steps, loss {loss.item():.3f}, step-1 top-1 "
            f"{got['hit1'] / max(got['n1'], 1):.3f}", eta)
        if el - last > 60 * cfg.checkpoint_min:
            _save(ckpt, head, opt, {**st, "train_s": el})
            last = el
    st["train_s"] = time.perf_counter() - start
    _save(ckpt, head, opt, st)
    return {**st, "total_steps": total}


def _save(path: Path, head: Head, opt, progress: dict) -> None:
    def cpu(x):
        if isinstance(x, torch.Tensor):
            return x.cpu()
        return {k: cpu(v) for k, v in x.items()} if isinstance(x, dict) else x

    tmp = path.with_suffix(".tmp")
    torch.save({"model": cpu(head.state_dict()), "opt": cpu(opt.state_dict()),
                "progress": progress, "vocab": head.vocab}, tmp)
    tmp.replace(path)
