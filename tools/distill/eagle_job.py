"""`tandem distill --method eagle` end to end: generate chat responses with the target while
recording its features (resumable shards), train the head (checkpointed, `--resume`), export
it with a model card that holds the exact command and the held-out figures."""
from __future__ import annotations

import json
import random
import shlex
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from tandem.device import check_device_spec
from tandem.engine.eagle import EAGLE_CARD
from tandem.engine.eagle3 import capture_layers, default_layer_ids
from tandem.models import read_hf_config, resolve_model
from tools.distill.config import DataConfig
from tools.distill.data import generate_dataset, placed, target_runner
from tools.distill.eagle import (
    EAGLE1,
    EagleTrainConfig,
    card,
    load_feature_seqs,
    make_head,
    train,
)
from tools.distill.eagle3 import EAGLE3, aux_features, aux_runner, make_head3
from tools.distill.eagle3_head import EAGLE3_CARD
from tools.distill.eagle_head import EagleTrainHead
from tools.distill.learning_curve import curve_point, extend
from tools.distill.pipeline import _TOKENIZER_FILES


@dataclass(frozen=True)
class EagleJob:
    target: str
    out_dir: Path
    data_dir: Path
    data: DataConfig
    train: EagleTrainConfig
    gen_minutes: float = 0.0  # 0 = every prompt
    resume: bool = False
    command: str = ""  # the command line, for the model card
    device: str = "auto"  # where the target generates and the head trains (tandem.device)
    # After training, also score the head on the target's greedy answers to this many of the
    # held-out chat prompts (0 = not): the validation split shares the prompt generator's
    # templates and subjects with the training set, these prompts do not.
    heldout_prompts: int = 40
    heldout_new_tokens: int = 48
    # Fine-tune this exported head (weights and vocabulary) instead of starting from the
    # target's last layer: new data then adds to what earlier data taught.
    init_head: Path | None = None
    # An EAGLE-3 head (tools.distill.eagle3): three-layer features added to the same cache
    # by a teacher-forced pass, the training-time test, exported in the speculators format.
    eagle3: bool = False

    def __post_init__(self):
        if not self.data.features:
            raise ValueError("an EAGLE head trains on recorded features (DataConfig.features)")
        if self.gen_minutes < 0:
            raise ValueError("--gen-minutes must be >= 0")
        if self.heldout_prompts < 0 or self.heldout_new_tokens < 1:
            raise ValueError("need --heldout-prompts >= 0 and heldout_new_tokens >= 1")
        check_device_spec(self.device)
        if self.eagle3 and self.init_head is not None:
            raise ValueError("--init-head fine-tunes Tandem EAGLE-1 heads (--method eagle), "
                             "not --method eagle3")
        if self.init_head is not None and not (Path(self.init_head) / EAGLE_CARD).is_file():
            raise ValueError(f"--init-head {self.init_head}: no {EAGLE_CARD} there (not an "
                             "exported Tandem EAGLE head)")


def run_eagle(job: EagleJob, log=print) -> Path:
    from tqdm import tqdm
    from transformers import AutoTokenizer

    at, data = placed(job.data, job.device)
    job = replace(job, data=data)
    paths = resolve_model(job.target)
    if job.eagle3:  # before any generation: a target too shallow for three layers
        n = int(read_hf_config(paths).get("num_hidden_layers", 0))
        capture_layers(default_layer_ids(n), n)
    tokenizer = AutoTokenizer.from_pretrained(str(paths.root))
    seqs = _feature_data(job, paths, tokenizer, at, log)
    n_val = max(1, int(len(seqs) * job.train.val_fraction))
    val, train_seqs = seqs[:n_val], seqs[n_val:]
    special = tuple(t for t in (tokenizer.eos_token_id, tokenizer.bos_token_id,
                                tokenizer.pad_token_id) if t is not None)
    if job.init_head:
        _check_init_head(Path(job.init_head), paths)
    head = (EagleTrainHead.from_export(job.init_head).train() if job.init_head else
            (make_head3 if job.eagle3 else make_head)(paths, train_seqs, job.train, special)
            ).to(at.device)  # seeded on the CPU
    tokens = sum(len(s.features) for s in train_seqs)
    log(f"eagle: {len(train_seqs)} train / {len(val)} held-out sequences, {tokens} positions; "
        f"vocabulary {len(head.vocab.target_ids)}")
    bar = tqdm(total=None, unit="step", file=sys.stderr, desc="eagle train")

    def progress(step, total, losses):
        bar.total = total
        bar.update(step - bar.n)
        bar.set_postfix({k: f"{v:.3f}" for k, v in losses.items()})

    recipe = EAGLE3 if job.eagle3 else EAGLE1
    state = "eagle3_train_state.pt" if job.eagle3 else "eagle_train_state.pt"
    stats = train(head, train_seqs, val, job.train, job.data_dir / state, job.resume, log,
                  progress, recipe)
    bar.close()
    if job.heldout_prompts:
        from tools.distill.eagle_agreement import heldout_agreement

        runner = target_runner(paths, job.data, at)
        if job.eagle3:  # the answers' features as the verifier sends them: three layers
            runner = aux_runner(runner.model, job.data.kv_cache_mb)
        stats["heldout_chat"] = heldout_agreement(
            runner, tokenizer, head, job.train, job.heldout_prompts, job.heldout_new_tokens,
            recipe.evaluate)
        log(f"eagle: held-out chat prompts {stats['heldout_chat']}")
    _export(job, paths, head, stats, seqs, tokens)
    log(f"eagle: head written to {job.out_dir}")
    return job.out_dir


def _feature_data(job: EagleJob, paths, tokenizer, at, log) -> list:
    """The target's answers with their features (generated, or resumed from job.data_dir),
    shuffled by the job's seed."""
    deadline = time.time() + 60 * job.gen_minutes if job.gen_minutes else None
    runner = target_runner(paths, job.data, at)
    generate_dataset(paths.root, tokenizer, runner, job.data, job.data_dir, log, deadline)
    if job.eagle3:
        aux_features(aux_runner(runner.model, job.data.kv_cache_mb), job.data_dir, log=log)
    del runner
    seqs = load_feature_seqs(job.data_dir, aux=job.eagle3)
    if len(seqs) < 2:
        raise ValueError(f"only {len(seqs)} sequences with features in {job.data_dir}")
    random.Random(job.train.seed).shuffle(seqs)
    return seqs


def _export(job: EagleJob, paths, head, stats: dict, seqs: list, tokens: int) -> None:
    """The head in its format (EAGLE-3: the speculators format) with its card (data,
    progress, learning curve and every command that trained these weights) and the target's
    tokenizer files."""
    command = job.command or shlex.join(["tandem", *sys.argv[1:]])
    data_stats = {"sequences": len(seqs), "positions": tokens,
                  "generated_tokens": sum(len(s.ids) - s.gen_start for s in seqs)}
    extra = {"data": {**asdict(job.data), **data_stats}, "progress": stats}
    old = _earlier_card(job)
    if old is not None:  # every command that trained these weights
        extra["earlier_commands"] = [*old.get("earlier_commands", []), old.get("command", "?")]
    point = curve_point(stats, job.train.batch_tokens, tokens, job.data.mix)
    if job.init_head:  # this run's steps count from the fine-tune's start
        init = json.loads((Path(job.init_head) / EAGLE_CARD).read_text())
        point["train_positions"] += (init.get("learning_curve") or [{}])[-1].get(
            "train_positions", 0)
    extra["learning_curve"] = extend(old, point)
    fmt = "tandem-eagle3/1" if job.eagle3 else "tandem-eagle/1"
    head.export(job.out_dir, read_hf_config(paths), card(paths, job.train, command, extra, fmt))
    for name in _TOKENIZER_FILES:
        if (paths.root / name).exists():
            shutil.copy(paths.root / name, job.out_dir / name)


def _check_init_head(root: Path, paths) -> None:
    """A head to fine-tune must read this target's features and speak its tokenizer."""
    from tandem.models import ModelPaths, tokenizer_hash

    want = json.loads((root / EAGLE_CARD).read_text()).get("target", {}).get("tokenizer_sha256")
    head_hidden = read_hf_config(ModelPaths(root)).get("hidden_size")
    target_hidden = read_hf_config(paths).get("hidden_size")
    if want != tokenizer_hash(paths) or head_hidden != target_hidden:
        raise ValueError(f"--init-head {root} was trained for another target (tokenizer "
                         f"{str(want)[:12]}, width {head_hidden}; this target's: "
                         f"{tokenizer_hash(paths)[:12]}, {target_hidden})")


def _earlier_card(job: EagleJob) -> dict | None:
    """The card of the weights this run started from: OUT's when resumed, else --init-head's."""
    for ok, root in ((job.resume, job.out_dir), (job.init_head is not None, job.init_head)):
        name = EAGLE3_CARD if job.eagle3 and root == job.out_dir else EAGLE_CARD
        if ok and (Path(root) / name).exists():
            return json.loads((Path(root) / name).read_text())
    return None


def threads(n: int) -> None:
    if n:
        torch.set_num_threads(n)
