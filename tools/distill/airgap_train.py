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
   tandem.engine.eagle serves), or with --method eagle3 an EAGLE-3 head on three target
   layers (the speculators format, airgap_head3.py), checkpointing to OUT/train_state.pt;
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
    from .airgap_data import generate, load_target
    from .airgap_fit import evaluate, train
    from .airgap_head import Head, load_seqs, make_head
    from .airgap_parts import BundleError, log, pack, unpack
    from .airgap_prompts import requests_for_run
except ImportError:  # run from the bundle: its sibling files
    from airgap_data import generate, load_target
    from airgap_fit import evaluate, train
    from airgap_head import Head, load_seqs, make_head
    from airgap_parts import BundleError, log, pack, unpack
    from airgap_prompts import requests_for_run

__all__ = ["Config", "Head", "load_seqs", "main", "parse", "run"]


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
    method: str = "eagle"  # or eagle3: three target layers, the training-time test
    ttt_steps: int = 3  # eagle3: draft steps trained (the head fed its own outputs)
    ttt_decay: float = 0.8  # eagle3: weight of step j's loss is decay ** (j - 1)

    def __post_init__(self):
        if self.minutes <= 0 or not 0 < self.gen_fraction < 1 or self.checkpoint_min <= 0:
            raise ValueError("need --minutes > 0, 0 < --gen-fraction < 1, checkpoint_min > 0")
        for name in ("gen_batch", "max_new_tokens", "batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.vocab < 16 or self.lr <= 0 or self.epochs <= 0 or not 0 < self.part_mib <= 16:
            raise ValueError("need --vocab >= 16, --lr > 0, --epochs > 0, 0 < --part-mib <= 16")
        if self.method not in ("eagle", "eagle3") or not 1 <= self.ttt_steps <= 8 or \
                not 0 < self.ttt_decay <= 1:
            raise ValueError("need --method eagle or eagle3, 1 <= --ttt-steps <= 8, "
                             "0 < --ttt-decay <= 1")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"--device must be cpu or cuda[:N], got {self.device!r}")


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


def _check_method(cfg: Config, spec: dict, started: str) -> None:
    if started != cfg.method:  # the shards' features and the training state are another's
        raise BundleError(f"{cfg.out} was started with --method {started}: rerun with it, "
                          f"or give --method {cfg.method} a new --out")
    if cfg.method == "eagle3" and not spec.get("eagle3_layer_ids"):
        raise BundleError("--method eagle3 reads three target layers; this bundle names none "
                          "(a target of at least 5 layers, bundled by this tandem)")


def run(cfg: Config, command: str) -> Path:
    wall0, spec = time.perf_counter(), read_spec(cfg.bundle)
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise BundleError("--device cuda but torch sees no CUDA device (use --device cpu)")
    inp = cfg.out / "input"
    unpack(cfg.bundle / "files", inp, log)
    prompts = [json.loads(x) for x in (inp / spec["prompts"]).read_text().splitlines()]
    clock_path = cfg.out / "clock.json"
    clock = json.loads(clock_path.read_text()) if clock_path.exists() else {"gen_s": 0.0}
    _check_method(cfg, spec, clock.setdefault("method", cfg.method))
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
    card = {"format": f"tandem-{cfg.method}/1", "target": spec["target"], "command": command,
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
                 "epochs", "lr", "checkpoint_min", "part_mib", "seed", "ttt_steps",
                 "ttt_decay"):
        value = getattr(d, name)
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=None,
                       help=f"[{value}, or the bundle's]")
    p.add_argument("--method", choices=("eagle", "eagle3"), default=None,
                   help="EAGLE-1 on the final hidden state, or EAGLE-3 on three layers with "
                        "the training-time test [eagle, or the bundle's]")
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
