"""`tandem distill --method medusa` end to end: generate chat responses with the target while
recording its features (the EAGLE cache: resumable shards, shareable between the two), train the
heads (checkpointed, `--resume`), export them with the held-out accuracy per head and rank and
the candidate tree built from it."""
from __future__ import annotations

import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from tandem.device import check_device_spec
from tandem.engine.checkpoint import LlamaConfig
from tandem.engine.draft_vocab import DraftVocab
from tandem.engine.medusa import expected_accepted, tree_from_accuracy
from tandem.models import read_hf_config, resolve_model
from tools.distill.config import DataConfig, MedusaTrainConfig
from tools.distill.data import generate_dataset, placed, target_runner
from tools.distill.eagle import load_feature_seqs
from tools.distill.medusa import card, flatten, make_heads, split, train


@dataclass(frozen=True)
class MedusaJob:
    target: str
    out_dir: Path
    data_dir: Path
    data: DataConfig
    train: MedusaTrainConfig
    gen_minutes: float = 0.0  # 0 = every prompt
    resume: bool = False
    command: str = ""
    device: str = "auto"  # where the target generates and the heads train (tandem.device)

    def __post_init__(self):
        if not self.data.features:
            raise ValueError("Medusa heads train on recorded features (DataConfig.features)")
        if self.gen_minutes < 0:
            raise ValueError("--gen-minutes must be >= 0")
        check_device_spec(self.device)


def run_medusa(job: MedusaJob, log=print) -> Path:
    from tqdm import tqdm
    from transformers import AutoTokenizer

    at, data = placed(job.data, job.device)
    job = replace(job, data=data)
    paths = resolve_model(job.target)
    tokenizer = AutoTokenizer.from_pretrained(str(paths.root))
    deadline = time.time() + 60 * job.gen_minutes if job.gen_minutes else None
    runner = target_runner(paths, job.data, at)
    generate_dataset(paths.root, tokenizer, runner, job.data, job.data_dir, log, deadline)
    del runner
    seqs = load_feature_seqs(job.data_dir)
    if len(seqs) < 2:
        raise ValueError(f"only {len(seqs)} sequences with features in {job.data_dir}")
    cfg = job.train
    train_seqs, val_seqs = split(seqs, max(cfg.val_fraction, 1 / len(seqs)), cfg.seed)
    special = tuple(t for t in (tokenizer.eos_token_id, tokenizer.bos_token_id,
                                tokenizer.pad_token_id) if t is not None)
    heads = make_heads(paths, train_seqs, cfg, special).to(at.device)  # seeded on the CPU
    vocab = DraftVocab(heads.cfg.vocab_ids, LlamaConfig.from_hf(read_hf_config(paths)).vocab_size)
    kept = torch.zeros(vocab.target_vocab_size, dtype=torch.bool)
    kept[torch.tensor(vocab.target_ids)] = True
    data = flatten(train_seqs, cfg.num_heads, cfg.teacher_top_k, vocab.input_map(), kept)
    val = flatten(val_seqs, cfg.num_heads, cfg.teacher_top_k, vocab.input_map(), kept)
    log(f"medusa: {len(data.features)} train / {len(val.features)} held-out positions; "
        f"vocabulary {len(heads.cfg.vocab_ids)}")
    bar = tqdm(total=None, unit="step", file=sys.stderr, desc="medusa train")

    def progress(step, total, losses):
        bar.total = total
        bar.update(step - bar.n)
        bar.set_postfix({k: f"{v:.3f}" for k, v in losses.items()})

    stats = train(heads, data, val, cfg, job.data_dir / "medusa_train_state.pt", job.resume,
                  log, progress)
    bar.close()
    acc = stats.get("accuracy") or [[1.0]] * cfg.num_heads
    choices = tree_from_accuracy(acc, cfg.tree_size)
    heads.cfg = type(heads.cfg)(**{**asdict(heads.cfg), "choices": choices,
                                   "accuracy": tuple(tuple(a) for a in acc)})
    stats["expected_accepted_greedy"] = round(expected_accepted(acc, choices), 3)
    command = job.command or shlex.join(["tandem", *sys.argv[1:]])
    extra = {"progress": stats}
    old_card = job.out_dir / "medusa.json"
    if job.resume and old_card.exists():  # every command that trained these weights
        old = json.loads(old_card.read_text())
        extra["earlier_commands"] = [*old.get("earlier_commands", []), old.get("command", "?")]
    heads.cpu().save(job.out_dir, **card(paths, cfg, command, extra))  # loads anywhere
    log(f"medusa: heads written to {job.out_dir}; tree of {len(choices)} nodes, "
        f"expected {stats['expected_accepted_greedy']} drafts accepted per greedy round")
    return job.out_dir

