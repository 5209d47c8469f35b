#!/usr/bin/env python3
"""Train a Tandem EAGLE head where only torch, transformers and safetensors are installed.

Run it inside the directory `tandem distill bundle` wrote (no network, no tandem needed):

    python airgap_train.py --device cuda --minutes 10 --out OUT

1. reassembles the target and the prompts from files/ (parts + manifest), checking every
   sha256 (a `--mix self` bundle has none: the target writes its own requests first);
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
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

try:  # imported as tools.distill.airgap_train (tandem's side, tests)
    from .airgap_fit import evaluate, train
    from .airgap_head import TOP_K, Head, load_seqs, make_head
    from .airgap_parts import BundleError, Progress, log, pack, unpack
    from .airgap_prompts import requests_for_run
except ImportError:  # run from the bundle: its sibling files
    from airgap_fit import evaluate, train
    from airgap_head import TOP_K, Head, load_seqs, make_head
    from airgap_parts import BundleError, Progress, log, pack, unpack
    from airgap_prompts import requests_for_run

TEMPERATURE, SAMPLED_EVERY = 0.7, 3


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
        if "self_prompts" in spec:  # the bundle carries no prompts: the target writes them
            prompts = requests_for_run(model, inp, spec, cfg.out, cfg.gen_fraction * 60 *
                                       cfg.minutes, clock, log)
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
        "target": spec["target"]["name"], "device": torch.cuda.get_device_name(
            cfg.device) if cfg.device.startswith("cuda") else "cpu",
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
