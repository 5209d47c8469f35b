"""`tandem distill --method eagle`: train an EAGLE head on the target's recorded features.

Data: the generation cache of tools.distill.data with features=True: per sequence the prompt,
the target's generated tokens, its top-K log-probs at each generated position and its final
normed hidden state at every position it ran (kept from the generating forwards, no second
pass). Loss, per generated position: smooth-L1 regression of the next feature plus the
cross-entropy against the target's top-K distribution through the frozen LM head rows (the
EAGLE recipe), for the first draft step and, with weight `step2_weight`, the second
(EagleTrainHead.forward2). Checkpoints every few minutes; `--resume` continues.
"""
from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tandem.engine.checkpoint import LlamaConfig, load_tensors
from tandem.engine.draft_vocab import DraftVocab
from tandem.models import ModelPaths, read_hf_config, tokenizer_hash
from tools.distill.config import EagleTrainConfig
from tools.distill.eagle_head import EagleTrainHead
from tools.distill.train import read_state, to_cpu


@dataclass(frozen=True)
class FeatureSeq:
    ids: torch.Tensor  # [T + 1] int64: prompt + generated tokens
    features: torch.Tensor  # [T, hidden] fp16: target feature at positions 0..T-1
    gen_start: int  # index of the first generated token
    topk_ids: torch.Tensor  # [G, K] int64: teacher for ids[gen_start + j]
    topk_logprobs: torch.Tensor  # [G, K] fp16


def aux_path(shard: Path) -> Path:
    """Where the EAGLE-3 pass keeps a shard's three-layer features (tools.distill.eagle3)."""
    return shard.with_name("aux-" + shard.name)


def load_feature_seqs(data_dir: Path, aux: bool = False) -> list[FeatureSeq]:
    """The cached conversations with their features: the final normed hidden state, or with
    aux=True the three-layer EAGLE-3 features (shards without them are left out)."""
    out = []
    for path in sorted(Path(data_dir).glob("shard-*.safetensors")):
        t = load_file(str(path))
        if aux:
            if not aux_path(path).exists():
                continue
            t["features"] = load_file(str(aux_path(path)))["features"]
        if "features" not in t:
            continue  # a cache generated without features
        po, go = t["prompt_offsets"].tolist(), t["gen_offsets"].tolist()
        at = 0
        for i in range(len(po) - 1):
            ids = torch.cat([t["prompt_ids"][po[i]:po[i + 1]], t["gen_ids"][go[i]:go[i + 1]]])
            n = len(ids) - 1
            if go[i + 1] - go[i] >= 2:
                out.append(FeatureSeq(ids.long(), t["features"][at:at + n], po[i + 1] - po[i],
                                      t["topk_ids"][go[i]:go[i + 1]].long(),
                                      t["topk_logprobs"][go[i]:go[i + 1]]))
            at += n
    return out


def build_vocab(seqs: list[FeatureSeq], size: int, target_vocab: int,
                always: tuple[int, ...]) -> DraftVocab:
    counts = torch.zeros(target_vocab, dtype=torch.int64)
    for s in seqs:
        counts += torch.bincount(s.ids, minlength=target_vocab)
        counts += torch.bincount(s.topk_ids[:, 0], minlength=target_vocab)
    order = list(dict.fromkeys(t for t in always if 0 <= t < target_vocab))
    # Unseen tokens by id: a BPE vocabulary numbers its commonest merges first.
    order += [t for t in torch.argsort(-counts, stable=True).tolist() if t not in set(order)]
    return DraftVocab(tuple(order[:min(size, target_vocab)]), target_vocab, 0)


def _batches(seqs: list[FeatureSeq], batch_tokens: int, rng: random.Random):
    """Length-bucketed batches of about batch_tokens (padded) tokens, shuffled."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].ids))
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * len(seqs[i].ids) > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def _collate(seqs: list[FeatureSeq], vocab: DraftVocab, input_map: torch.Tensor):
    """Entries t = 1..T-1 of each sequence, right-padded to one length."""
    n = max(len(s.features) - 1 for s in seqs)
    b, h = len(seqs), seqs[0].features.shape[1]
    feats = torch.zeros(b, n, h)
    target = torch.zeros(b, n, h)
    reg_mask = torch.zeros(b, n)
    for i, s in enumerate(seqs):
        m = len(s.features) - 1  # entries 1..T-1 sit at rows 0..m-1
        feats[i, :m] = s.features[:m].float()
        target[i, :m] = s.features[1:m + 1].float()
        reg_mask[i, :m] = 1
    ids, cls_mask, t_rows, t_probs = teacher_rows(seqs, vocab, input_map, n)
    return ids, feats, target, reg_mask, cls_mask, t_rows, t_probs


def teacher_rows(seqs: list[FeatureSeq], vocab: DraftVocab, input_map: torch.Tensor, n: int):
    """Per row (entry t = 1..T-1 of each sequence, n rows): its token t [B, n], which rows
    have a teacher [B, n], and the teacher's top-K as draft rows and probabilities [B, n, K]
    (0 for tokens outside the draft vocabulary)."""
    b, k = len(seqs), seqs[0].topk_ids.shape[1]
    ids = torch.zeros(b, n, dtype=torch.int64)
    cls_mask = torch.zeros(b, n)
    t_rows = torch.zeros(b, n, k, dtype=torch.int64)
    t_probs = torch.zeros(b, n, k)
    kept = torch.zeros(vocab.target_vocab_size, dtype=torch.bool)
    kept[list(vocab.target_ids)] = True
    for i, s in enumerate(seqs):
        m = len(s.features) - 1
        ids[i, :m] = s.ids[1:m + 1]
        first = max(s.gen_start - 1, 1)  # entry t predicts token t+1: generated from P-1 on
        j0 = first + 1 - s.gen_start  # its teacher row
        rows = slice(first - 1, m)
        g = s.topk_ids[j0:j0 + m - first + 1]
        t_rows[i, rows] = input_map[g]
        t_probs[i, rows] = s.topk_logprobs[j0:j0 + m - first + 1].float().exp() * kept[g]
        cls_mask[i, rows] = 1
    return ids, cls_mask, t_rows, t_probs


def _losses(head: EagleTrainHead, pred, target, reg_mask, cls_mask, t_rows, t_probs):
    reg = (F.smooth_l1_loss(pred, target, reduction="none").mean(-1) * reg_mask).sum()
    logp = head.logits(pred).log_softmax(-1)  # [B, T, V_d]
    ce = -(logp.gather(-1, t_rows) * t_probs).sum(-1)
    cls = (ce * cls_mask).sum()
    top1 = ((logp.argmax(-1) == t_rows[..., 0]) & (t_probs[..., 0] > 0)).float()
    return reg / reg_mask.sum().clamp(min=1), cls / cls_mask.sum().clamp(min=1), \
        (top1 * cls_mask).sum(), cls_mask.sum()


def _to(batch: tuple, device) -> tuple:
    """A collated batch (built on the CPU) on the head's device."""
    return tuple(t.to(device, non_blocking=True) for t in batch)


def step_losses(head: EagleTrainHead, batch, step2_weight: float):
    ids, feats, target, reg_mask, cls_mask, t_rows, t_probs = batch
    pos = torch.arange(ids.shape[1], device=ids.device)  # entry t sits at t - 1 (its KV slot)
    pred, kv = head(ids, feats, pos)
    reg, cls, hit, n = _losses(head, pred, target, reg_mask, cls_mask, t_rows, t_probs)
    out = {"reg": reg, "cls": cls, "hit1": hit, "n1": n}
    if step2_weight > 0:
        # Entry t reads the prediction of feature t-1 made by entry t-1.
        feats2 = torch.cat([feats[:, :1], pred[:, :-1]], 1)
        m2 = reg_mask.clone()
        m2[:, 0] = 0
        c2 = cls_mask * m2
        pred2 = head.forward2(ids, feats2, pos, kv)
        reg2, cls2, hit2, n2 = _losses(head, pred2, target, m2, c2, t_rows, t_probs)
        out.update(reg2=reg2, cls2=cls2, hit2=hit2, n2=n2)
    return out


def _total(losses: dict, cfg: EagleTrainConfig) -> torch.Tensor:
    loss = losses["reg"] + cfg.cls_weight * losses["cls"]
    if "reg2" in losses:
        loss = loss + cfg.step2_weight * (losses["reg2"] + cfg.cls_weight * losses["cls2"])
    return loss


@torch.no_grad()
def evaluate(head: EagleTrainHead, seqs: list[FeatureSeq], cfg: EagleTrainConfig) -> dict:
    """Teacher-forced agreement with the target's greedy token at draft steps 1 and 2."""
    head.eval()
    tot = {"hit1": 0.0, "n1": 0.0, "hit2": 0.0, "n2": 0.0, "cls": 0.0}
    device, input_map = head.fc.weight.device, head.input_map.cpu()
    for idx in _batches(seqs, cfg.batch_tokens, random.Random(0)):
        batch = _collate([seqs[i] for i in idx], head.vocab, input_map)
        out = step_losses(head, _to(batch, device), 1.0)
        for key in ("hit1", "n1", "hit2", "n2"):
            tot[key] += float(out[key])
        tot["cls"] += float(out["cls"]) * float(out["n1"])
    head.train()
    n1 = max(tot["n1"], 1)
    return {"top1_step1": tot["hit1"] / n1, "top1_step2": tot["hit2"] / max(tot["n2"], 1),
            "ce_step1": tot["cls"] / n1, "positions": int(tot["n1"])}


def make_head(target: ModelPaths, seqs: list[FeatureSeq], cfg: EagleTrainConfig,
              special: tuple[int, ...]) -> EagleTrainHead:
    hf = read_hf_config(target)
    lcfg = LlamaConfig.from_hf(hf)
    tensors = load_tensors(target)
    vocab = build_vocab(seqs, cfg.vocab, lcfg.vocab_size, special)
    embed = tensors["embed_tokens.weight"].float()
    rows = embed[torch.tensor(vocab.target_ids)]
    if not lcfg.tie_word_embeddings:  # the head's tied rows must be the target's LM head
        rows = tensors["lm_head.weight"].float()[torch.tensor(vocab.target_ids)]
    torch.manual_seed(cfg.seed)
    head = EagleTrainHead(lcfg, vocab, rows, lcfg.max_position_embeddings)
    layer = cfg.init_layer % lcfg.num_layers
    head.init_from_target(tensors, layer)
    return head


def card(target: ModelPaths, cfg: EagleTrainConfig, command: str, stats: dict,
         fmt: str = "tandem-eagle/1") -> dict:
    return {"format": fmt, "target": {"name": target.root.name,
            "tokenizer_sha256": tokenizer_hash(target)}, "command": command,
            "train": asdict(cfg), **stats}


def lr_at(step: int, total: int, cfg: EagleTrainConfig, time_frac: float = 0.0) -> float:
    """Warmup, then cosine to 10% over the steps or the time budget, whichever ends first
    (so a run cut by its budget still ends on a low learning rate)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = min(1.0, max((step - cfg.warmup) / max(1, total - cfg.warmup), time_frac))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


@dataclass(frozen=True)
class Recipe:
    """What `train` needs of a head family: its batches, losses, total loss and held-out
    figures (EAGLE-1's here, EAGLE-3's in tools.distill.eagle3)."""
    collate: Callable  # (seqs, vocab, input_map) -> a batch (a tuple of CPU tensors)
    losses: Callable  # (head, batch, cfg) -> {name: scalar tensor}
    total: Callable  # (losses, cfg) -> the loss to minimise
    evaluate: Callable  # (head, seqs, cfg) -> {figure: float}
    shown: tuple[str, ...]  # losses on the progress bar


EAGLE1 = Recipe(_collate, lambda head, batch, cfg: step_losses(head, batch, cfg.step2_weight),
                _total, evaluate, ("reg", "cls", "cls2"))


def train(head, train_seqs, val_seqs, cfg: EagleTrainConfig, ckpt: Path, resume: bool,
          log=print, progress=None, recipe: Recipe = EAGLE1) -> dict:
    """Train within the time budget; checkpoint (model + optimiser + step) to `ckpt`. The head
    trains where it is (move it first: the optimizer's state follows its parameters); batches
    are built on the CPU and moved there, checkpoints are written from CPU copies."""
    device = head.fc.weight.device
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=cfg.lr,
                            weight_decay=0.0)
    rng = random.Random(cfg.seed)
    per_epoch = len(_batches(train_seqs, cfg.batch_tokens, rng))
    total = max(1, int(per_epoch * cfg.epochs))
    step, wall = 0, 0.0
    if resume and ckpt.exists():
        state = read_state(ckpt)  # weights only: a resume never runs code
        # The vocabulary the weights were trained with, even if the data grew since.
        head.vocab = DraftVocab(tuple(state["vocab"]), head.vocab.target_vocab_size, 0)
        head.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, wall = state["step"], state["wall"]
        log(f"eagle: resumed at step {step} ({wall / 60:.1f} min trained)")
    input_map = head.vocab.input_map()  # batches map on the CPU (the resumed head's vocab)
    start, last_ckpt = time.perf_counter() - wall, time.perf_counter()
    epoch_batches: list = []
    while step < total and (not cfg.time_budget_min
                            or time.perf_counter() - start < 60 * cfg.time_budget_min):
        if not epoch_batches:
            epoch_batches = _batches(train_seqs, cfg.batch_tokens, random.Random(cfg.seed + step))
        idx = epoch_batches.pop()
        batch = _to(recipe.collate([train_seqs[i] for i in idx], head.vocab, input_map), device)
        elapsed = time.perf_counter() - start
        budget = 60 * cfg.time_budget_min
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, cfg, elapsed / budget if budget else 0.0)
        losses = recipe.losses(head, batch, cfg)
        opt.zero_grad(set_to_none=True)
        recipe.total(losses, cfg).backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        step += 1
        if progress is not None:
            progress(step, total, {k: v.item() for k, v in losses.items() if k in recipe.shown})
        if time.perf_counter() - last_ckpt > 60 * cfg.checkpoint_min:
            _save(ckpt, head, opt, step, time.perf_counter() - start)
            last_ckpt = time.perf_counter()
    wall = time.perf_counter() - start
    _save(ckpt, head, opt, step, wall)
    metrics = recipe.evaluate(head, val_seqs, cfg) if val_seqs else {}
    log(f"eagle: {step} steps in {wall / 60:.1f} min; held-out {metrics}")
    return {"steps": step, "total_steps": total, "train_wall_s": round(wall, 1), **metrics}


def _save(path: Path, head, opt, step: int, wall: float) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": to_cpu(head.state_dict()), "opt": to_cpu(opt.state_dict()),
                "step": step, "wall": wall, "vocab": list(head.vocab.target_ids)}, tmp)
    tmp.rename(path)
