"""`tandem distill` end to end: check the target, generate (or resume) the data, train with
checkpoints, export a HF-format draft directory with a model card."""
from __future__ import annotations

import copy
import json
import random
import shlex
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from tandem.device import Placement, check_device_spec
from tandem.models import ModelError, ModelPaths, read_hf_config, resolve_model, tokenizer_hash
from tools.distill.data import (
    DataConfig,
    data_stats,
    generate_dataset,
    load_examples,
    placed,
    target_runner,
)
from tools.distill.train import (
    DraftArch,
    TrainConfig,
    apply_state,
    batch_loss,
    build_draft_vocab,
    evaluate,
    lr_at,
    make_batches,
    make_draft,
    read_state,
    save_state,
    state_vocab,
)

CARD_FILE = "tandem_draft.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "generation_config.json")


@dataclass(frozen=True)
class DistillJob:
    target: str
    out_dir: Path
    data_dir: Path
    data: DataConfig
    arch: DraftArch
    train: TrainConfig
    gen_minutes: float = 0.0  # 0 = generate every prompt; else stop generating after this
    resume: bool = False
    val_sequences: int = 48
    # Optional second prompt set of everyday chat requests (its own resumable cache).
    chat_data_dir: Path | None = None
    chat_data: DataConfig | None = None
    # Where the target generates and the draft trains (tandem.device): auto, cpu, cuda:N.
    device: str = "auto"

    def __post_init__(self):
        if self.gen_minutes < 0 or self.val_sequences < 0:
            raise ValueError("--gen-minutes and --val-sequences must be >= 0")
        if (self.chat_data_dir is None) != (self.chat_data is None):
            raise ValueError("chat_data_dir and chat_data go together")
        check_device_spec(self.device)

    def data_sets(self) -> list[tuple[Path, DataConfig]]:
        extra = [(self.chat_data_dir, self.chat_data)] if self.chat_data else []
        return [(self.data_dir, self.data), *extra]


def check_target(name: str) -> tuple[ModelPaths, dict]:
    """The target must be a causal LM we can run, with a tokenizer the draft will share."""
    paths = resolve_model(name)
    cfg = read_hf_config(paths)
    archs = cfg.get("architectures") or []
    if archs and not any(a.endswith("ForCausalLM") for a in archs):
        raise ModelError(f"{paths.root} is not a causal language model (architectures="
                         f"{archs}); a draft can only be distilled from a *ForCausalLM target")
    tokenizer_hash(paths)  # raises a ModelError when there is no tokenizer.json
    return paths, cfg


def _check_data_dir(data_dir: Path, paths: ModelPaths) -> None:
    """Cached generations belong to one target tokenizer; refuse to mix."""
    data_dir.mkdir(parents=True, exist_ok=True)
    meta = data_dir / "target.json"
    want = tokenizer_hash(paths)
    if meta.exists():
        got = json.loads(meta.read_text()).get("tokenizer_sha256")
        if got != want:
            raise ModelError(f"{data_dir} holds data generated with a different tokenizer "
                             f"({got[:12]}…, target has {want[:12]}…); use another --data-dir")
    elif any(data_dir.glob("shard-*.safetensors")):
        return  # data from before target.json existed: trust the caller
    else:
        meta.write_text(json.dumps({"target": str(paths.root), "tokenizer_sha256": want}))


def _placed(job: DistillJob) -> tuple[Placement, DistillJob]:
    """The job's device, and the job with its data dtypes resolved there."""
    at, data = placed(job.data, job.device)
    chat = placed(job.chat_data, job.device)[1] if job.chat_data else None
    return at, replace(job, data=data, chat_data=chat)


def _generate(job: DistillJob, paths: ModelPaths, tokenizer, log, at: Placement) -> None:
    runner = target_runner(paths, job.data, at)
    deadline = time.time() + 60 * job.gen_minutes if job.gen_minutes else None
    for data_dir, cfg in job.data_sets():
        generate_dataset(paths.root, tokenizer, runner, cfg, data_dir, log, deadline)


def run_distill(job: DistillJob, log=print) -> Path:
    from safetensors.torch import load_file
    from tqdm import tqdm
    from transformers import AutoTokenizer

    at, job = _placed(job)
    paths, target_cfg = check_target(job.target)
    for data_dir, _ in job.data_sets():
        _check_data_dir(data_dir, paths)
    tokenizer = AutoTokenizer.from_pretrained(str(paths.root))
    _generate(job, paths, tokenizer, log, at)
    examples = [e for d, cfg in job.data_sets() for e in load_examples(d, cfg)]
    if len(examples) < 2:
        raise ValueError(f"only {len(examples)} sequences in {job.data_dir}: generate more")
    rng = random.Random(job.train.seed)
    rng.shuffle(examples)
    n_val = max(1, min(job.val_sequences, len(examples) // 8))  # small runs keep most data
    val, train = examples[:n_val], examples[n_val:]
    # Optimizer state lives with the data cache, not in the (shipped) output directory.
    state_path = job.data_dir / "train_state.pt"
    state = read_state(state_path) if job.resume and state_path.exists() else None
    vocab = state_vocab(state) if state else _vocab(job, examples, target_cfg, tokenizer)
    embed = _target_embedding(paths, load_file)
    if job.arch.init_from_target:
        target_cfg = {**target_cfg, "_weights": _target_weights(paths, load_file)}
    # Built (and seeded) on the CPU, so every device starts from the same weights; then moved
    # before the optimizer exists, so its state lives on the device too.
    model = make_draft(job.arch, target_cfg, vocab, embed, job.train.seed).to(at.device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=job.train.lr,
                            weight_decay=job.train.weight_decay, betas=(0.9, 0.98))
    step, elapsed, tokens = 0, 0.0, 0
    if state:
        step, elapsed, tokens = apply_state(state, model, opt)
        log(f"resumed from {state_path} at step {step}")
    val_batches = make_batches(val, vocab, job.train.batch_tokens, random.Random(0))
    card = _card(job, paths, examples, train, vocab)
    if state:  # a resumed run records every command that trained these weights
        old = _read_card(job.out_dir)
        card["earlier_commands"] = [*old.get("earlier_commands", []), old.get("command", "?")]
    bar = tqdm(total=job.train.steps, initial=step, unit="step", file=sys.stderr)
    losses: list[float] = []
    step, elapsed, tokens = _train_loop(job, model, opt, train, vocab, bar, rng, (
        step, elapsed, tokens), losses, lambda s, e, t: _checkpoint(
            job, model, opt, state_path, paths, vocab, val_batches, _with_losses(card, losses),
            (s, e, t), log))
    bar.close()
    _checkpoint(job, model, opt, state_path, paths, vocab, val_batches,
                _with_losses(card, losses), (step, elapsed, tokens), log)
    return job.out_dir


def _vocab(job, examples, target_cfg, tokenizer):
    specials = tuple(sorted(set(tokenizer.all_special_ids)))
    unk = tokenizer.unk_token_id if tokenizer.unk_token_id is not None else specials[0]
    return build_draft_vocab(examples, job.arch.vocab, target_cfg["vocab_size"], specials, unk)


def _target_embedding(paths: ModelPaths, load_file):
    for f in paths.safetensors():
        t = load_file(str(f))
        for name in ("model.embed_tokens.weight", "embed_tokens.weight"):
            if name in t:
                return t[name]
    return None


def _with_losses(card: dict, losses: list[float]) -> dict:
    """Mean training loss of the first and last 10 steps of this run: did it learn?"""
    if not losses:
        return card
    head, tail = losses[:10], losses[-10:]
    return {**card, "loss": {"first_steps": round(sum(head) / len(head), 4),
                             "last_steps": round(sum(tail) / len(tail), 4)}}


def _target_weights(paths: ModelPaths, load_file) -> dict:
    weights = {}
    for f in paths.safetensors():
        weights.update(load_file(str(f)))
    return weights


def _train_loop(job, model, opt, train, vocab, bar, rng, state, losses, checkpoint):
    """Steps until job.train.steps or the time budget; checkpoints every checkpoint_min."""
    step, elapsed, tokens = state
    cfg = job.train
    batches, start, last_ckpt = [], time.perf_counter() - elapsed, time.perf_counter()
    model.train()
    while step < cfg.steps and not (
            cfg.time_budget_min and elapsed > 60 * cfg.time_budget_min):
        if not batches:  # a new epoch, reshuffled
            batches = make_batches(train, vocab, cfg.batch_tokens, rng)
        batch = batches.pop()
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step, elapsed)
        loss, stats = batch_loss(model, batch, cfg.ce_weight, cfg.bf16)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step, tokens = step + 1, tokens + int(batch.mask.sum())
        losses.append(loss.item())
        elapsed = time.perf_counter() - start
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{stats['top1']:.3f}",
                        tok_s=f"{tokens / max(elapsed, 1e-9):.0f}")
        if time.perf_counter() - last_ckpt > 60 * cfg.checkpoint_min:
            checkpoint(step, elapsed, tokens)
            last_ckpt = time.perf_counter()
    return step, elapsed, tokens


def _card(job, paths, examples, train, vocab) -> dict:
    shards = sorted(job.data_dir.glob("shard-*.safetensors"))
    prompts = job.data_dir / "prompts.jsonl"
    span = shards[-1].stat().st_mtime - prompts.stat().st_mtime if shards else 0.0
    return {
        "format": "tandem-draft/1",
        "target": {"name": paths.root.name, "tokenizer_sha256": tokenizer_hash(paths)},
        "command": shlex.join(["tandem", *sys.argv[1:]]) if sys.argv else "",
        "seed": job.train.seed,
        "architecture": asdict(job.arch),
        "draft_vocab": {"size": len(vocab.target_ids), "target_vocab": vocab.target_vocab_size},
        "data": {**asdict(job.data), **data_stats(examples),
                 "train_sequences": len(train), "generation_wall_s": round(span, 1),
                 "sources": "janeaustenr (r-cran) + Python stdlib source + topic questions"},
        "train": asdict(job.train),
        **({"chat_data": {**asdict(job.chat_data), **data_stats(
            load_examples(job.chat_data_dir, job.chat_data))}} if job.chat_data else {}),
    }


def _checkpoint(job, model, opt, state_path, paths, vocab, val_batches, card, state, log):
    step, elapsed, tokens = state
    save_state(state_path, model, opt, vocab, step, elapsed, tokens)
    ev = evaluate(model, val_batches)
    card = {**card, "progress": {"steps": step, "train_wall_s": round(elapsed, 1),
                                 "tokens_seen": tokens, "val_kl": round(ev["kl"], 4),
                                 "val_top1_teacher_forced": round(ev["top1"], 4)}}
    old = _read_card(job.out_dir)
    if "acceptance" in old and old.get("progress", {}).get("steps") == step:
        card["acceptance"] = old["acceptance"]  # same weights: the measurement still holds
    export_draft(model, vocab, paths, job.out_dir, card)
    log(f"\ncheckpoint: step {step}, {elapsed / 60:.1f} min, val top1 {ev['top1']:.3f}, "
        f"val kl {ev['kl']:.3f} -> {job.out_dir}")


def _read_card(out_dir: Path) -> dict:
    try:
        return json.loads((out_dir / CARD_FILE).read_text())
    except (OSError, ValueError):
        return {}


def export_draft(model, vocab, paths: ModelPaths, out_dir: Path, card: dict) -> None:
    """fp16 HF directory + tokenizer files + draft_vocab.json + card, swapped in whole."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staged = out_dir.with_name(out_dir.name + ".staged")
    shutil.rmtree(staged, ignore_errors=True)
    copy.deepcopy(model).to("cpu", torch.float16).save_pretrained(str(staged))
    for name in _TOKENIZER_FILES:
        if (paths.root / name).is_file():
            shutil.copy2(paths.root / name, staged / name)
    if len(vocab.target_ids) < vocab.target_vocab_size:
        vocab.write(staged)
    (staged / CARD_FILE).write_text(json.dumps(card, indent=2) + "\n")
    old = out_dir.with_name(out_dir.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out_dir.exists():
        out_dir.rename(old)
    staged.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)
