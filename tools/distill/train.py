"""Train a small Llama-family draft by knowledge distillation on cached target generations.

The draft is a transformers LlamaForCausalLM (autograd, save_pretrained) over an optional
truncated vocabulary (the target tokens most frequent in the data); the loss is the KL
divergence from the target's cached top-K distribution at every generated position, optionally
plus cross-entropy on the generated token.
"""
from __future__ import annotations

import collections
import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tandem.engine.draft_vocab import DraftVocab
from tools.distill.config import DraftArch, TrainConfig
from tools.distill.data import Example


def build_draft_vocab(examples: list[Example], size: int, target_vocab: int,
                      always: tuple[int, ...], unk_id: int) -> DraftVocab:
    """The `size` most frequent target tokens in prompts, generations and teacher top-1s, plus
    the special tokens. Frequency-ordered so that row 0.. are the commonest."""
    if size == 0 or size >= target_vocab:
        return DraftVocab(tuple(range(target_vocab)), target_vocab, unk_id)
    counts = collections.Counter()
    for e in examples:
        counts.update(e.ids.tolist())
        counts.update(e.topk_ids[:, 0].tolist())
    kept = list(dict.fromkeys([*always, unk_id, *(t for t, _ in counts.most_common())]))
    kept += [t for t in range(target_vocab) if t not in set(kept)][:max(0, size - len(kept))]
    kept = kept[:size]
    return DraftVocab(tuple(kept), target_vocab, kept.index(unk_id))


def make_draft(arch: DraftArch, target_cfg: dict, vocab: DraftVocab, target_embed, seed: int):
    """A fresh draft; its embedding starts as the target's kept rows projected onto their top
    principal directions, so similar tokens start close (a cheap head start)."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=len(vocab.target_ids), hidden_size=arch.hidden,
        intermediate_size=arch.intermediate, num_hidden_layers=arch.layers,
        num_attention_heads=arch.heads, num_key_value_heads=arch.kv_heads,
        max_position_embeddings=target_cfg.get("max_position_embeddings", 2048),
        rms_norm_eps=target_cfg.get("rms_norm_eps", 1e-5),
        rope_theta=_rope_theta(target_cfg), tie_word_embeddings=True,
        bos_token_id=target_cfg.get("bos_token_id"), eos_token_id=target_cfg.get("eos_token_id"),
        pad_token_id=target_cfg.get("pad_token_id"))
    model = transformers.LlamaForCausalLM(cfg)
    if arch.init_from_target:
        _copy_target_layers(model, target_cfg, vocab, arch)
    elif target_embed is not None:
        rows = target_embed[torch.tensor(vocab.target_ids)].float()
        rows = rows - rows.mean(0)
        _, _, v = torch.linalg.svd(rows[:8192], full_matrices=False)
        proj = rows @ v[:min(arch.hidden, v.shape[0])].T
        init = torch.zeros(len(vocab.target_ids), arch.hidden)
        init[:, :proj.shape[1]] = proj / proj.std() * cfg.initializer_range
        with torch.no_grad():
            model.model.embed_tokens.weight.copy_(init)
    model.model.embed_tokens.weight.requires_grad_(not arch.freeze_embeddings)
    return model


def _copy_target_layers(model, target_cfg: dict, vocab: DraftVocab, arch: DraftArch) -> None:
    want = {"hidden": target_cfg["hidden_size"], "heads": target_cfg["num_attention_heads"],
            "kv_heads": target_cfg.get("num_key_value_heads"),
            "intermediate": target_cfg["intermediate_size"]}
    bad = {k: v for k, v in want.items() if v is not None and getattr(arch, k) != v}
    if bad or arch.layers > target_cfg["num_hidden_layers"]:
        raise ValueError(f"--init-from-target needs the target's shape {want} and at most "
                         f"{target_cfg['num_hidden_layers']} layers; differing: {bad}")
    weights = target_cfg["_weights"]
    state = {}
    for name, param in model.state_dict().items():
        src = weights.get(name)
        if name == "model.embed_tokens.weight" or (name == "lm_head.weight" and src is None):
            src = weights["model.embed_tokens.weight"][torch.tensor(vocab.target_ids)]
        elif name == "lm_head.weight":
            src = src[torch.tensor(vocab.target_ids)]
        if src is not None:
            state[name] = src.to(param.dtype)
    model.load_state_dict(state, strict=False)


def _rope_theta(cfg: dict) -> float:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))


@dataclass(frozen=True)
class Batch:
    ids: torch.Tensor  # [B, L] draft rows, padded
    mask: torch.Tensor  # [B, L] attention mask
    rows: torch.Tensor  # [N] flat (b * L + position) indices of hidden states that predict
    topk_rows: torch.Tensor  # [N, K] teacher top-K as draft rows
    topk_p: torch.Tensor  # [N, K] teacher probs, 0 where the token is not in the draft vocab
    label: torch.Tensor  # [N] generated token as a draft row, -100 if not in the draft vocab

    def to(self, device) -> Batch:
        """The batch on `device` (itself when it is there already)."""
        if self.ids.device == torch.device(device):
            return self
        return Batch(*(t.to(device, non_blocking=True) for t in (
            self.ids, self.mask, self.rows, self.topk_rows, self.topk_p, self.label)))


def make_batches(examples: list[Example], vocab: DraftVocab, batch_tokens: int,
                 rng: random.Random) -> list[Batch]:
    """Length-sorted, padded batches of about batch_tokens tokens, in random order."""
    inmap = vocab.input_map()
    kept = torch.zeros(vocab.target_vocab_size, dtype=torch.bool)
    kept[torch.tensor(vocab.target_ids)] = True
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i].ids), rng.random()))
    groups, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * len(examples[i].ids) > batch_tokens:
            groups.append(cur)
            cur = []
        cur.append(examples[i])
    if cur:
        groups.append(cur)
    rng.shuffle(groups)
    return [_collate(g, inmap, kept) for g in groups]


def _collate(group: list[Example], inmap: torch.Tensor, kept: torch.Tensor) -> Batch:
    length = max(len(e.ids) for e in group)
    ids = torch.zeros(len(group), length, dtype=torch.int64)
    mask = torch.zeros(len(group), length, dtype=torch.int64)
    rows, tk, tp, labels = [], [], [], []
    for b, e in enumerate(group):
        n = len(e.ids)
        ids[b, :n], mask[b, :n] = inmap[e.ids], 1
        gen = n - e.gen_start
        # hidden state at position gen_start - 1 + j predicts generated token j
        rows.append(b * length + e.gen_start - 1 + torch.arange(gen))
        tk.append(inmap[e.topk_ids])
        tp.append(e.topk_logprobs.exp() * kept[e.topk_ids])
        g = e.ids[e.gen_start:]
        labels.append(torch.where(kept[g], inmap[g], -100))
    return Batch(ids, mask, torch.cat(rows), torch.cat(tk), torch.cat(tp), torch.cat(labels))


def batch_loss(model, batch: Batch, ce_weight: float,
               bf16: bool = False) -> tuple[torch.Tensor, dict]:
    """KL(teacher top-K || draft) per generated position, plus ce_weight * cross-entropy; the
    batch goes to the model's device (batches are built on the CPU)."""
    batch = batch.to(model.device)
    with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=bf16):
        hidden = model.model(input_ids=batch.ids, attention_mask=batch.mask).last_hidden_state
        h = hidden.reshape(-1, hidden.shape[-1])[batch.rows]  # head only where it is needed
        logits = model.lm_head(h)
    logq = F.log_softmax(logits.float(), dim=-1)
    q_at = logq.gather(1, batch.topk_rows)
    p = batch.topk_p
    kl = (p * (p.clamp_min(1e-12).log() - q_at)).sum(-1).mean()
    ce = F.cross_entropy(logq, batch.label, ignore_index=-100)
    top1 = (logq.argmax(-1) == batch.topk_rows[:, 0]).float().mean()
    return kl + ce_weight * ce, {"kl": kl.item(), "ce": ce.item(), "top1": top1.item()}


def lr_at(cfg: TrainConfig, step: int, elapsed_s: float) -> float:
    """Linear warmup, then cosine decay to 10% over steps or the time budget, whichever ends
    first (so a time-budgeted run still anneals)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    if cfg.time_budget_min:
        frac = max(frac, elapsed_s / (60 * cfg.time_budget_min))
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, frac))))


@torch.no_grad()
def evaluate(model, batches: list[Batch]) -> dict:
    """Teacher-forced top-1 agreement with the target (the greedy acceptance per position)."""
    model.eval()
    stats = [batch_loss(model, b, 0.0)[1] for b in batches]
    model.train()
    return {k: sum(s[k] for s in stats) / max(1, len(stats)) for k in ("kl", "top1")}


def to_cpu(obj):
    """A state dict (nested dicts, lists, tensors) with every tensor on the CPU, so a
    checkpoint written on a GPU loads anywhere (on the CPU, the very same objects)."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        out = type(obj)((k, to_cpu(v)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):  # a module state dict's versions, kept as torch does
            out._metadata = obj._metadata
        return out
    if type(obj) in (list, tuple):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def save_state(path: Path, model, opt, vocab: DraftVocab, step: int, elapsed: float,
               tokens: int) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": to_cpu(model.state_dict()), "opt": to_cpu(opt.state_dict()),
                "step": step,
                "elapsed": elapsed, "tokens": tokens, "vocab": list(vocab.target_ids),
                "target_vocab": vocab.target_vocab_size, "unk_index": vocab.unk_index}, tmp)
    tmp.rename(path)


class UnsafeCheckpoint(ValueError):
    """A training checkpoint that holds more than tensors, numbers, strings and containers."""


def read_state(path: Path) -> dict:
    """A resumable training state, unpickled with torch's weights-only allowlist: a file that
    names any other global (code to run on load) is refused, never executed."""
    import pickle

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else "unpickling"
        raise UnsafeCheckpoint(f"{path}: refused to resume from it: it holds objects a "
                               f"training state never has ({reason}); delete it or start "
                               "without --resume") from None
    if not isinstance(state, dict):
        raise UnsafeCheckpoint(f"{path}: not a training state (a {type(state).__name__})")
    return state


def state_vocab(state: dict) -> DraftVocab:
    """A resumed run keeps its vocabulary even if the data has grown since."""
    return DraftVocab(tuple(state["vocab"]), state["target_vocab"], state["unk_index"])


def apply_state(state: dict, model, opt) -> tuple[int, float, int]:
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    return state["step"], state["elapsed"], state["tokens"]
