#!/usr/bin/env python3
"""Train a Tandem EAGLE head where only torch, transformers and safetensors are installed.

Run it inside the directory `tandem distill bundle` wrote (no network, no tandem needed):

    python airgap_train.py --device cuda --minutes 10 --out OUT

1. reassembles the target and the prompts from files/ (parts + manifest), checking every
   sha256;
2. generates the target's answers to the prompts (batched; every third batch sampled at
   temperature 0.7, the rest greedy), then runs the target teacher-forced over prompt + answer
   to record its final normed hidden state at every position and its top-K log-probs at
   every answer position (shards in OUT/data);
3. trains a one-layer EAGLE head on them (the layout tools/distill/eagle_head.py exports and
   tandem.engine.eagle serves), checkpointing to OUT/train_state.pt;
4. writes the head to OUT/head and splits it into OUT/return (parts of at most --part-mib MiB,
   manifest.json, figures.json). Bring OUT/return back and run
   `tandem distill unbundle --head-dir RETURN --out HEAD`.

Generation and training share --minutes (at most --gen-fraction of it generates). Rerun the
same command after an interruption: it continues where it stopped.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

MANIFEST = "manifest.json"
HEAD_CARD = "tandem_eagle.json"  # tandem.engine.eagle.EAGLE_CARD
TEMPERATURE, SAMPLED_EVERY, TOP_K = 0.7, 3, 32


class BundleError(Exception):
    """A bundle or a returned head that is incomplete or corrupt."""


# ---- parts and manifests (also used by tandem's bundle/unbundle) ----------------------------
def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def pack(paths: list[Path], dst: Path, part_bytes: int) -> dict:
    """Copy the files into dst; one over part_bytes goes as NAME.partNNN pieces. Writes
    dst/manifest.json: per file its size and sha256, and those of each part."""
    dst.mkdir(parents=True, exist_ok=True)
    files = []
    for path in map(Path, paths):
        entry = {"name": path.name, "size": path.stat().st_size, "sha256": sha256_file(path)}
        if entry["size"] <= part_bytes:
            shutil.copyfile(path, dst / path.name)
        else:
            entry["parts"] = []
            with open(path, "rb") as f:
                while data := f.read(part_bytes):
                    part = f"{path.name}.part{len(entry['parts']):03d}"
                    (dst / part).write_bytes(data)
                    entry["parts"].append({"name": part, "size": len(data),
                                           "sha256": hashlib.sha256(data).hexdigest()})
        files.append(entry)
    manifest = {"format": "tandem-parts/1", "part_bytes": part_bytes, "files": files}
    (dst / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def unpack(src: Path, dst: Path, log=print) -> list[str]:
    """Reassemble every file of src/manifest.json into dst, checking each part's and each
    whole file's size and sha256. A file already in dst with the right hash is kept."""
    try:
        manifest = json.loads((Path(src) / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise BundleError(f"cannot read {Path(src) / MANIFEST}: {exc}") from exc
    dst.mkdir(parents=True, exist_ok=True)
    for e in manifest["files"]:
        out = dst / e["name"]
        if out.is_file() and out.stat().st_size == e["size"] and sha256_file(out) == e["sha256"]:
            continue
        whole, tmp = hashlib.sha256(), out.with_name(out.name + ".tmp")
        with open(tmp, "wb") as f:
            for p in e.get("parts") or [e]:
                path = Path(src) / p["name"]
                data = path.read_bytes() if path.is_file() else b""
                got = hashlib.sha256(data).hexdigest()
                if not path.is_file() or len(data) != p["size"] or got != p["sha256"]:
                    tmp.unlink()
                    raise BundleError(
                        f"{path}: {'missing' if not path.is_file() else 'corrupt'} "
                        f"(size {len(data)}, sha256 {got}; the manifest says size {p['size']}, "
                        f"sha256 {p['sha256']}): copy this file again")
                whole.update(data)
                f.write(data)
        if whole.hexdigest() != e["sha256"]:
            tmp.unlink()
            raise BundleError(f"{e['name']}: reassembled sha256 {whole.hexdigest()} is not the "
                              f"manifest's {e['sha256']}")
        tmp.replace(out)
        log(f"checked and reassembled {e['name']} ({len(e.get('parts') or [e])} part(s))")
    return [e["name"] for e in manifest["files"]]


class Progress:
    """A progress line with an ETA, at most one per `every` seconds (logs stay short)."""

    def __init__(self, what: str, every: float = 10.0):
        self.what, self.every, self.last = what, every, 0.0

    def __call__(self, done: int, total: int, note: str, eta_s: float) -> None:
        if time.perf_counter() - self.last >= self.every or done == total:
            self.last = time.perf_counter()
            log(f"[{self.what}] {done}/{total} {note}; ETA {max(eta_s, 0) / 60:.1f} min")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Config:
    device: str
    minutes: float
    out: Path
    bundle: Path
    gen_fraction: float = 0.5  # at most this share of --minutes generates
    gen_batch: int = 64
    max_new_tokens: int = 160
    vocab: int = 8192  # the head's truncated vocabulary
    batch_tokens: int = 8192  # padded positions per training batch
    epochs: float = 10.0  # at most (the time budget usually ends training first)
    lr: float = 1e-3
    warmup: int = 50
    cls_weight: float = 0.5  # token loss against the feature regression (as tandem's)
    step2_weight: float = 0.5  # second draft step's losses
    checkpoint_min: float = 2.0
    part_mib: float = 16.0  # returned files are at most this large
    seed: int = 0

    def __post_init__(self):
        if self.minutes <= 0 or not 0 < self.gen_fraction < 1 or self.checkpoint_min <= 0:
            raise ValueError("need --minutes > 0, 0 < --gen-fraction < 1, checkpoint_min > 0")
        for name in ("gen_batch", "max_new_tokens", "batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.vocab < 16 or self.lr <= 0 or self.epochs <= 0 or not 0 < self.part_mib <= 16:
            raise ValueError("need --vocab >= 16, --lr > 0, --epochs > 0, 0 < --part-mib <= 16")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"--device must be cpu or cuda[:N], got {self.device!r}")


# ---- data: the target's answers, teacher-forced features and top-K -------------------------
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


def teacher_forced(model, seqs: list[list[int]], starts: list[int], pad: int):
    """Per sequence: final normed hidden states of positions 0..T-1 [T, h] fp16 and the top-K
    log-probs predicting each answer token [G, K]; plus greedy hits of those rows."""
    ids, mask = _pad(seqs, pad, left=False)
    hidden = model.base_model(input_ids=ids.to(model.device),
                              attention_mask=mask.to(model.device)).last_hidden_state
    lm_head = model.get_output_embeddings()
    out = []
    for i, (s, p) in enumerate(zip(seqs, starts)):
        lp = lm_head(hidden[i, p - 1:len(s) - 1]).float().log_softmax(-1)
        vals, top = lp.topk(TOP_K, dim=-1)
        hits = (top[:, 0].cpu() == torch.tensor(s[p:])).sum().item()
        out.append((hidden[i, :len(s) - 1].half().cpu(), top.int().cpu(), vals.half().cpu(),
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
    rec = teacher_forced(model, seqs, [len(prompts[i]) for i in keep], spec["pad_id"])
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


@dataclass(frozen=True)
class Seq:
    ids: torch.Tensor  # [T + 1] prompt + answer
    features: torch.Tensor  # [T, h] fp16, positions 0..T-1
    gen_start: int
    topk_ids: torch.Tensor  # [G, K] teacher of ids[gen_start + j]
    topk_lp: torch.Tensor  # [G, K]
    val: bool


def load_seqs(data: Path) -> list[Seq]:
    from safetensors.torch import load_file

    out = []
    for path in sorted(data.glob("shard-*.safetensors")):
        t = load_file(str(path))
        off, at, g = t["offsets"].tolist(), 0, 0
        for i in range(len(off) - 1):
            ids, p = t["ids"][off[i]:off[i + 1]].long(), int(t["gen_start"][i])
            n, na = len(ids) - 1, len(ids) - p
            out.append(Seq(ids, t["features"][at:at + n], p, t["topk_ids"][g:g + na].long(),
                           t["topk_lp"][g:g + na], bool(t["val"][i])))
            at, g = at + n, g + na
    return out


# ---- the head (tools/distill/eagle_head.py's EagleTrainHead, without tandem) ---------------
class Head(nn.Module):
    """Entry t reads [feature t-1 ; embedding of token t] and predicts feature t; `forward2`
    is the second draft step (its input feature is the head's own prediction)."""

    def __init__(self, geo: dict, embed_rows: torch.Tensor, vocab: list[int],
                 inv_freq: torch.Tensor):
        super().__init__()
        h, hd, nh, nkv = geo["hidden"], geo["head_dim"], geo["heads"], geo["kv_heads"]
        self.geo, self.vocab = geo, list(vocab)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.input_norm, self.post_norm, self.norm = (nn.Parameter(torch.ones(h))
                                                      for _ in range(3))
        self.q, self.o = nn.Linear(h, nh * hd, bias=False), nn.Linear(nh * hd, h, bias=False)
        self.k, self.v = (nn.Linear(h, nkv * hd, bias=False) for _ in range(2))
        self.gate, self.up = (nn.Linear(h, geo["intermediate"], bias=False) for _ in range(2))
        self.down = nn.Linear(geo["intermediate"], h, bias=False)
        self.register_buffer("embed", embed_rows.float().clone())  # frozen target rows
        imap = torch.zeros(geo["vocab_size"], dtype=torch.int64)  # target id -> row (unk 0)
        imap[torch.tensor(self.vocab)] = torch.arange(len(self.vocab))
        self.register_buffer("input_map", imap)
        self.register_buffer("inv_freq", inv_freq.float())

    def layer_params(self):  # (module or parameter, name in the target's / head's layer)
        return ((self.q, "self_attn.q_proj"), (self.k, "self_attn.k_proj"),
                (self.v, "self_attn.v_proj"), (self.o, "self_attn.o_proj"),
                (self.gate, "mlp.gate_proj"), (self.up, "mlp.up_proj"),
                (self.down, "mlp.down_proj"))

    def init_from_target(self, t: dict, layer: int) -> None:
        p = f"layers.{layer}."
        with torch.no_grad():
            for mod, name in self.layer_params():
                mod.weight.copy_(t[p + name + ".weight"])
            self.input_norm.copy_(t[p + "input_layernorm.weight"])
            self.post_norm.copy_(t[p + "post_attention_layernorm.weight"])
            self.norm.copy_(t["norm.weight"])
            eye = torch.eye(self.geo["hidden"])
            self.fc.weight.copy_(torch.cat([eye, eye], 1))

    def _rms(self, x, w):
        return F.rms_norm(x, (x.shape[-1],), w, self.geo["eps"])

    def _rope(self, x, pos):
        f = pos.float()[:, None] * self.inv_freq[None]
        cos, sin = torch.cat([f.cos(), f.cos()], -1), torch.cat([f.sin(), f.sin()], -1)
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def _qkv(self, x, pos):
        b, t, _ = x.shape
        hd, nh, nkv = self.geo["head_dim"], self.geo["heads"], self.geo["kv_heads"]
        y = self._rms(x, self.input_norm)
        q = self.q(y).view(b, t, nh, hd).transpose(1, 2)
        k = self.k(y).view(b, t, nkv, hd).transpose(1, 2)
        v = self.v(y).view(b, t, nkv, hd).transpose(1, 2)
        rep = nh // nkv
        k, v = self._rope(k, pos).repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        return self._rope(q, pos), k, v

    def _finish(self, x, attn):
        b, t, _ = x.shape
        x = x + self.o(attn.transpose(1, 2).reshape(b, t, -1))
        y = self._rms(x, self.post_norm)
        x = x + self.down(F.silu(self.gate(y)) * self.up(y))
        return self._rms(x, self.norm)

    def _input(self, ids, feats):
        return self.fc(torch.cat([feats, self.embed[self.input_map[ids]]], -1))

    def forward(self, ids, feats, pos):
        x = self._input(ids, feats)
        q, k, v = self._qkv(x, pos)
        return self._finish(x, F.scaled_dot_product_attention(q, k, v, is_causal=True)), (k, v)

    def forward2(self, ids, feats, pos, kv1):
        k1, v1 = kv1
        x = self._input(ids, feats)
        q, k, v = self._qkv(x, pos)
        scale, t = self.geo["head_dim"] ** -0.5, ids.shape[1]
        s1 = (q @ k1.transpose(-1, -2)) * scale  # keys strictly before t
        before = torch.ones(t, t, dtype=torch.bool, device=q.device).tril(-1)
        s1 = s1.masked_fill(~before, float("-inf"))
        p = torch.cat([s1, (q * k).sum(-1, keepdim=True) * scale], -1).softmax(-1)
        return self._finish(x, p[..., :t] @ v1 + p[..., t:] * v)

    def export(self, out: Path, target_cfg: dict, card: dict) -> None:
        """The checkpoint tandem.engine.eagle.EagleHead loads (fp16), as EagleTrainHead's."""
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        p = "model.layers.0."
        names = {"model.fc.weight": self.fc.weight, "model.norm.weight": self.norm,
                 "model.embed_tokens.weight": self.embed,
                 p + "input_layernorm.weight": self.input_norm,
                 p + "post_attention_layernorm.weight": self.post_norm,
                 **{p + n + ".weight": m.weight for m, n in self.layer_params()}}
        save_file({k: v.detach().to("cpu", torch.float16).contiguous() for k, v in names.items()},
                  str(out / "model.safetensors"))
        cfg = {k: v for k, v in target_cfg.items() if k != "quantization_config"}
        cfg.update(num_hidden_layers=1, vocab_size=len(self.vocab), tie_word_embeddings=True,
                   architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype="float16")
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
        (out / "draft_vocab.json").write_text(json.dumps(
            {"target_vocab_size": self.geo["vocab_size"], "unk_index": 0,
             "target_ids": self.vocab}))
        (out / HEAD_CARD).write_text(json.dumps(card, indent=2))


# ---- training (tools/distill/eagle.py's losses: feature regression + token CE, 2 steps) ----
def build_vocab(seqs: list[Seq], size: int, target_vocab: int, always: list[int]) -> list[int]:
    counts = torch.zeros(target_vocab, dtype=torch.int64)
    for s in seqs:
        counts += torch.bincount(s.ids, minlength=target_vocab)
        counts += torch.bincount(s.topk_ids[:, 0], minlength=target_vocab)
    order = list(dict.fromkeys(t for t in always if 0 <= t < target_vocab))
    seen = set(order)
    order += [t for t in torch.argsort(-counts, stable=True).tolist() if t not in seen]
    return order[:min(size, target_vocab)]


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
    """Entries t = 1..T-1 of each sequence, right-padded; the teacher rows of answer tokens."""
    n, b, h = max(len(s.features) - 1 for s in seqs), len(seqs), seqs[0].features.shape[1]
    ids, feats, target = (torch.zeros(b, n, dtype=torch.int64), torch.zeros(b, n, h),
                          torch.zeros(b, n, h))
    reg_mask, cls_mask = torch.zeros(b, n), torch.zeros(b, n)
    t_rows, t_probs = torch.zeros(b, n, TOP_K, dtype=torch.int64), torch.zeros(b, n, TOP_K)
    imap = head.input_map.cpu()
    kept = torch.zeros(len(imap), dtype=torch.bool)
    kept[head.vocab] = True
    for i, s in enumerate(seqs):
        m = len(s.features) - 1
        ids[i, :m], feats[i, :m] = s.ids[1:m + 1], s.features[:m].float()
        target[i, :m], reg_mask[i, :m] = s.features[1:m + 1].float(), 1
        first = max(s.gen_start - 1, 1)  # entry t predicts token t+1
        j0, rows = first + 1 - s.gen_start, slice(first - 1, m)
        g = s.topk_ids[j0:j0 + m - first + 1]
        t_rows[i, rows] = imap[g]
        t_probs[i, rows] = s.topk_lp[j0:j0 + m - first + 1].float().exp() * kept[g]
        cls_mask[i, rows] = 1
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


@torch.no_grad()
def evaluate(head: Head, seqs: list[Seq], cfg: Config) -> dict:
    """Teacher-forced agreement with the target's top-1 token at draft steps 1 and 2."""
    head.eval()
    tot = {"hit1": 0.0, "n1": 0.0, "hit2": 0.0, "n2": 0.0}
    dev = head.fc.weight.device
    for idx in batches(seqs, cfg.batch_tokens, random.Random(0)):
        _, got = step_losses(head, collate([seqs[i] for i in idx], head, dev), cfg)
        tot = {k: v + got[k] for k, v in tot.items()}
    head.train()
    return {"top1_step1": round(tot["hit1"] / max(tot["n1"], 1), 4),
            "top1_step2": round(tot["hit2"] / max(tot["n2"], 1), 4),
            "positions": int(tot["n1"])}


def lr_at(step: int, total: int, cfg: Config, time_frac: float) -> float:
    """Warmup, then cosine to 10% over the steps or the time, whichever ends first."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = min(1.0, max((step - cfg.warmup) / max(1, total - cfg.warmup), time_frac))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def make_head(target: Path, spec: dict, train_seqs: list[Seq], cfg: Config,
              vocab: list[int] | None) -> Head:
    from safetensors.torch import load_file

    t = {}
    for f in sorted(target.glob("*.safetensors")):
        t.update({k.removeprefix("model."): v for k, v in load_file(str(f)).items()})
    geo = spec["geometry"]
    vocab = vocab or build_vocab(train_seqs, cfg.vocab, geo["vocab_size"], spec["special_ids"])
    rows = t["embed_tokens.weight" if geo["tie"] else "lm_head.weight"].float()
    torch.manual_seed(cfg.seed)
    head = Head(geo, rows[torch.tensor(vocab)], vocab, torch.tensor(spec["inv_freq"]))
    head.init_from_target(t, geo["layers"] - 1)
    return head


def train(head: Head, seqs: list[Seq], cfg: Config, budget_s: float) -> dict:
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
    while st["step"] < total and time.perf_counter() - start < budget_s:
        todo = todo or batches(seqs, cfg.batch_tokens, random.Random(cfg.seed + st["step"]))
        batch = collate([seqs[i] for i in todo.pop()], head, dev)
        for g in opt.param_groups:
            g["lr"] = lr_at(st["step"], total, cfg, (time.perf_counter() - start) / budget_s)
        with amp:
            loss, got = step_losses(head, batch, cfg)
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


# ---- the whole run ---------------------------------------------------------------------------
def read_spec(bundle: Path) -> dict:
    try:
        spec = json.loads((bundle / "bundle.json").read_text())
    except (OSError, ValueError) as exc:
        raise BundleError(f"{bundle} is not a bundle (`tandem distill bundle` writes one; "
                          f"pass --bundle DIR): {exc}") from exc
    if spec.get("format") != "tandem-airgap/1":
        raise BundleError(f"unknown bundle format {spec.get('format')!r}")
    return spec


def run(cfg: Config, command: str) -> Path:
    wall0, spec = time.perf_counter(), read_spec(cfg.bundle)
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise BundleError("--device cuda but torch sees no CUDA device (use --device cpu)")
    inp = cfg.out / "input"
    unpack(cfg.bundle / "files", inp, log)
    prompts = [json.loads(x) for x in (inp / spec["prompts"]).read_text().splitlines()]
    clock_path = cfg.out / "clock.json"
    clock = json.loads(clock_path.read_text()) if clock_path.exists() else {"gen_s": 0.0}
    model = load_target(inp, cfg.device)
    with torch.inference_mode():
        generate(model, prompts, spec, cfg, clock)
    del model
    seqs = load_seqs(cfg.out / "data")
    train_seqs, val = [s for s in seqs if not s.val], [s for s in seqs if s.val]
    if not train_seqs:
        raise BundleError("no training answers yet: give generation more time (--minutes)")
    ckpt = cfg.out / "train_state.pt"
    vocab = torch.load(ckpt, weights_only=True)["vocab"] if ckpt.exists() else None  # resumed
    head = make_head(inp, spec, train_seqs, cfg, vocab).to(cfg.device)
    log(f"train: {len(train_seqs)} answers ({sum(len(s.features) for s in train_seqs)} "
        f"positions), {len(val)} held-out conversations; vocabulary {len(head.vocab)}")
    stats = train(head, train_seqs, cfg, 60 * cfg.minutes - clock["gen_s"])
    figures = {
        "target": spec["target"]["name"], "device": _device_name(cfg.device),
        "torch": torch.__version__, "minutes": {
            "budget": cfg.minutes, "generate": round(clock["gen_s"] / 60, 2),
            "train": round(stats["train_s"] / 60, 2),
            "this_run_wall": round((time.perf_counter() - wall0) / 60, 2)},
        "data": {"prompts": len(prompts), "train_answers": len(train_seqs),
                 "heldout_answers": len(val),
                 "answer_tokens": sum(len(s.ids) - s.gen_start for s in seqs),
                 "train_positions": sum(len(s.features) for s in train_seqs),
                 "teacher_agrees_with_greedy_answers": round(
                     clock.get("greedy_hits", 0) / max(clock.get("greedy_tokens", 0), 1), 4)},
        "train": {"steps": stats["step"], "total_steps": stats["total_steps"],
                  "positions_trained": stats["positions"]},
        "heldout_by_conversation": evaluate(head, val, cfg) if val else "no held-out answers"}
    log(f"figures: {json.dumps(figures)}")
    return export(head, inp, spec, cfg, command, figures)


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"


def export(head: Head, inp: Path, spec: dict, cfg: Config, command: str, figures: dict) -> Path:
    head_dir, ret = cfg.out / "head", cfg.out / "return"
    shutil.rmtree(head_dir, ignore_errors=True)
    card = {"format": "tandem-eagle/1", "target": spec["target"], "command": command,
            "train": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
            "airgap": True, "progress": figures}
    head.export(head_dir, json.loads((inp / "config.json").read_text()), card)
    for name in spec["tokenizer_files"]:
        shutil.copyfile(inp / name, head_dir / name)
    shutil.rmtree(ret, ignore_errors=True)
    pack(sorted(head_dir.iterdir()), ret, int(cfg.part_mib * (1 << 20)))
    (ret / "figures.json").write_text(json.dumps(figures, indent=2))
    size = sum(p.stat().st_size for p in ret.iterdir())
    log(f"done: bring back {ret} ({len(list(ret.iterdir()))} files, {size / 2**20:.1f} MiB), "
        f"then `tandem distill unbundle --head-dir RETURNED --out HEAD_DIR`")
    return ret


def parse(argv: list[str] | None) -> tuple[Config, str]:
    d = Config("cpu", 10.0, Path("airgap_out"), Path("."))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=(
        "Reruns continue: shards, training state and the time spent are kept in --out."))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda, cuda:N or cpu [%(default)s]")
    p.add_argument("--minutes", type=float, default=None,
                   help="budget of generation + training, over reruns [the bundle's]")
    p.add_argument("--out", type=Path, default=d.out, help="work and output dir [%(default)s]")
    p.add_argument("--bundle", type=Path, default=Path(__file__).resolve().parent,
                   help="the bundle directory [this script's]")
    for name in ("gen_fraction", "gen_batch", "max_new_tokens", "vocab", "batch_tokens",
                 "epochs", "lr", "checkpoint_min", "part_mib", "seed"):
        value = getattr(d, name)
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=None,
                       help=f"[{value}, or the bundle's]")
    args = p.parse_args(argv)
    bundle_defaults = read_spec(args.bundle).get("defaults", {})
    kw = {k: v for k, v in vars(args).items() if v is not None}
    kw = {**asdict(d), **bundle_defaults, **kw}
    argv = sys.argv[1:] if argv is None else argv
    return Config(**kw), " ".join(["python", "airgap_train.py", *argv])


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, command = parse(argv)
        print(run(cfg, command))
    except (BundleError, ValueError) as exc:
        print(f"airgap_train: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
