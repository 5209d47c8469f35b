"""`tandem distill` and `tandem acceptance` sub-commands (registered by tools/cli.py)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
from pathlib import Path

from tandem.device import add_device_flags
from tandem.models import DEFAULT_TARGET


def _gen_dtype(value: str) -> str:
    """--gen-dtype's value (argparse `type`): a dtype the target can generate in."""
    from tools.distill.config import GEN_DTYPES

    if value not in GEN_DTYPES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(GEN_DTYPES)}, got "
                                         f"{value!r}")
    return value


def _add_data_args(p, d) -> None:
    g = p.add_argument_group("data (text the target generates)")
    g.add_argument("--num-prompts", type=int, default=d.num_prompts)
    g.add_argument("--gen-batch", type=int, default=d.batch_size)
    g.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    g.add_argument("--teacher-top-k", type=int, default=d.top_k,
                   help="target log-probs kept per position [%(default)s]")
    g.add_argument("--sampled-every", type=int, default=d.sampled_every,
                   help="every n-th batch samples at --gen-temperature, the rest are greedy")
    g.add_argument("--gen-temperature", type=float, default=d.temperature)
    g.add_argument("--chat-prompts", type=int, default=0,
                   help="also generate for N everyday chat requests (0 = none)")
    g.add_argument("--chat-data-dir", type=Path, default=None,
                   help="cache for the chat prompt set [default: OUT.chat-data]")
    # --dtype (tandem.device.add_device_flags) under its older name; sets the same value.
    g.add_argument("--gen-dtype", dest="dtype", type=_gen_dtype, default=argparse.SUPPRESS,
                   metavar="DTYPE", help="the same as --dtype")
    g.add_argument("--gen-minutes", type=float, default=0.0,
                   help="stop generating after this long (0 = all prompts)")


def _add_distill(sub) -> None:
    from tools.distill.config import (
        DataConfig,
        DraftArch,
        EagleTrainConfig,
        MedusaTrainConfig,
        TrainConfig,
    )

    d, a, t = DataConfig(), DraftArch(), TrainConfig()
    p = sub.add_parser("distill", help="train a draft model for a target by distillation on "
                       "text the target generates", description=(
                           "Generate text with the target (cached, resumable), distil a small "
                           "Llama-family draft from its top-K log-probs (KL + CE), and export a "
                           "HF-format draft directory with a model card."))
    p.add_argument("--target", default=os.environ.get("TANDEM_MODEL", DEFAULT_TARGET),
                   help="target: default name or HF checkpoint dir [default %(default)s]")
    p.add_argument("--method", choices=("draft_model", "eagle", "eagle3", "medusa"),
                   default="draft_model",
                   help="what to train: an independent draft model, an EAGLE head, an EAGLE-3 "
                   "head (three target layers, speculators format) or Medusa heads on the "
                   "target's features [%(default)s]")
    p.add_argument("--out", type=Path, default=None,
                   help="output draft directory (required unless bundle/unbundle)")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="generation cache (resumable) [default: OUT.data]")
    add_device_flags(p, "TANDEM_DISTILL", d.dtype, (
        "target weight dtype while generating the data: bfloat16, float32, float16 or auto "
        "(float32 on cpu, bfloat16 on cuda); training has --no-bf16"))
    _add_data_args(p, d)
    g = p.add_argument_group("draft architecture")
    g.add_argument("--layers", type=int, default=a.layers)
    g.add_argument("--hidden", type=int, default=a.hidden)
    g.add_argument("--heads", type=int, default=a.heads)
    g.add_argument("--kv-heads", type=int, default=a.kv_heads)
    g.add_argument("--intermediate", type=int, default=a.intermediate)
    g.add_argument("--draft-vocab", type=int, default=a.vocab,
                   help="keep the N most frequent target tokens (0 = full vocabulary)")
    g.add_argument("--init-from-target", action="store_true",
                   help="copy the target's first --layers layers (needs the target's widths)")
    g.add_argument("--freeze-embeddings", action="store_true",
                   help="do not train the (tied) embedding / output head")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=t.steps)
    g.add_argument("--time-budget", type=float, default=t.time_budget_min,
                   help="training minutes (0 = until --steps)")
    g.add_argument("--batch-tokens", type=int, default=t.batch_tokens)
    g.add_argument("--lr", type=float, default=t.lr)
    g.add_argument("--ce-weight", type=float, default=t.ce_weight)
    g.add_argument("--seed", type=int, default=t.seed)
    g.add_argument("--checkpoint-minutes", type=float, default=t.checkpoint_min)
    g.add_argument("--no-bf16", action="store_true", help="train in fp32 (slower)")
    e = EagleTrainConfig()
    g = p.add_argument_group("eagle heads (--method eagle or eagle3; data: chat prompts, "
                             "features kept)")
    g.add_argument("--eagle-vocab", type=int, default=e.vocab,
                   help="truncated output vocabulary of the head [%(default)s]")
    g.add_argument("--epochs", type=float, default=e.epochs)
    g.add_argument("--cls-weight", type=float, default=e.cls_weight,
                   help="eagle: token loss weight against the feature regression "
                        "[%(default)s]")
    g.add_argument("--step2-weight", type=float, default=e.step2_weight,
                   help="weight of the second draft step's losses, 0 = off [%(default)s]")
    g.add_argument("--ttt-steps", type=int, default=e.ttt_steps,
                   help="eagle3: draft steps of the training-time test [%(default)s]")
    g.add_argument("--ttt-decay", type=float, default=e.ttt_decay,
                   help="eagle3: step j's loss weighted DECAY**j [%(default)s]")
    g.add_argument("--prompt-mix", choices=("chat", "self"), default="chat",
                   help="chat: task x subject grid; self: requests the target writes itself "
                        "(Magpie) [%(default)s]")
    g.add_argument("--init-head", type=Path, default=None,
                   help="start from this exported head (its vocabulary too), not the target")
    g.add_argument("--heldout-prompts", type=int, default=40,
                   help="after training, score the head on the target's greedy answers to "
                        "this many held-out chat prompts, as served (0 = not) [%(default)s]")
    m = MedusaTrainConfig()
    g = p.add_argument_group("medusa heads (--method medusa; the same data as eagle)")
    g.add_argument("--medusa-num-heads", type=int, default=m.num_heads)
    g.add_argument("--medusa-num-layers", type=int, default=m.num_layers)
    g.add_argument("--medusa-vocab", type=int, default=m.vocab,
                   help="LM-head rows the heads may name [%(default)s]")
    g.add_argument("--tree-size", type=int, default=m.tree_size,
                   help="nodes of the exported candidate tree [%(default)s]")
    g.add_argument("--batch-positions", type=int, default=m.batch_positions)
    g.add_argument("--resume", action="store_true", help="continue from OUT's train state")
    g.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    p.set_defaults(func=_cmd_distill)
    from tools.distill.airgap import register as register_airgap

    register_airgap(p)


def _cmd_distill(args) -> int:
    import torch

    from tandem.device import place
    from tools.distill.config import DataConfig, DraftArch, TrainConfig
    from tools.distill.pipeline import DistillJob, run_distill

    if args.out is None:
        raise ValueError("distill needs --out DIR (the output draft or head directory)")
    # Resolved first: a GPU this host lacks is a clear error, not a traceback minutes later.
    at = place(args.device, args.dtype)
    args.device, args.dtype = str(at.device), at.dtype
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.method in ("eagle", "eagle3", "medusa"):
        return _cmd_eagle(args)
    data = DataConfig(num_prompts=args.num_prompts, batch_size=args.gen_batch,
                      max_new_tokens=args.max_new_tokens, top_k=args.teacher_top_k,
                      sampled_every=args.sampled_every, temperature=args.gen_temperature,
                      seed=args.seed, dtype=args.dtype)
    chat = dataclasses.replace(data, num_prompts=args.chat_prompts, mix="chat") \
        if args.chat_prompts else None
    job = DistillJob(
        target=args.target, out_dir=args.out,
        data_dir=args.data_dir or args.out.with_name(args.out.name + ".data"),
        data=data, chat_data=chat, chat_data_dir=(
            args.chat_data_dir or args.out.with_name(args.out.name + ".chat-data"))
        if chat else None,
        arch=DraftArch(args.layers, args.hidden, args.heads, args.kv_heads, args.intermediate,
                       args.draft_vocab, args.init_from_target, args.freeze_embeddings),
        train=TrainConfig(steps=args.steps, time_budget_min=args.time_budget,
                          batch_tokens=args.batch_tokens, lr=args.lr,
                          ce_weight=args.ce_weight, seed=args.seed,
                          checkpoint_min=args.checkpoint_minutes, bf16=not args.no_bf16),
        gen_minutes=args.gen_minutes, resume=args.resume, device=args.device)
    out = run_distill(job, log=lambda m: print(m, file=sys.stderr))
    print(out)
    return 0


def _cmd_eagle(args) -> int:
    from tools.distill.config import DataConfig, EagleTrainConfig
    from tools.distill.eagle_job import EagleJob, run_eagle

    # Features are kept from the generating forwards; fp32 (bf16 is slower without AVX512).
    data = DataConfig(num_prompts=args.num_prompts, batch_size=args.gen_batch,
                      max_new_tokens=args.max_new_tokens, top_k=args.teacher_top_k,
                      sampled_every=args.sampled_every, temperature=args.gen_temperature,
                      seed=args.seed, dtype=args.dtype, mix=getattr(args, "prompt_mix", "chat"),
                      features=True,
                      kv_cache_mb=max(1024, args.gen_batch * 48))
    job_args = dict(target=args.target, out_dir=args.out,
                    data_dir=args.data_dir or args.out.with_name(args.out.name + ".data"),
                    data=data, gen_minutes=args.gen_minutes, resume=args.resume,
                    device=args.device,
                    command=shlex.join(["tandem", *getattr(args, "argv", sys.argv[1:])]))
    if args.method == "medusa":
        from tools.distill.config import MedusaTrainConfig
        from tools.distill.medusa_job import MedusaJob, run_medusa

        cfg = MedusaTrainConfig(
            num_heads=args.medusa_num_heads, num_layers=args.medusa_num_layers,
            vocab=args.medusa_vocab, tree_size=args.tree_size,
            time_budget_min=args.time_budget, epochs=args.epochs,
            batch_positions=args.batch_positions, lr=args.lr,
            checkpoint_min=args.checkpoint_minutes, seed=args.seed)
        print(run_medusa(MedusaJob(**job_args, train=cfg),
                         log=lambda m: print(m, file=sys.stderr)))
        return 0
    cfg = EagleTrainConfig(vocab=args.eagle_vocab, time_budget_min=args.time_budget,
                           epochs=args.epochs, batch_tokens=args.batch_tokens, lr=args.lr,
                           cls_weight=args.cls_weight, step2_weight=args.step2_weight,
                           checkpoint_min=args.checkpoint_minutes, seed=args.seed,
                           ttt_steps=args.ttt_steps, ttt_decay=args.ttt_decay)
    print(run_eagle(EagleJob(**job_args, train=cfg, heldout_prompts=args.heldout_prompts,
                             init_head=getattr(args, "init_head", None),
                             eagle3=args.method == "eagle3"),
                    log=lambda m: print(m, file=sys.stderr)))
    return 0


def _add_acceptance(sub) -> None:
    p = sub.add_parser("acceptance", help="measure a draft's acceptance rate and cost ratio "
                       "against a target on held-out prompts")
    p.add_argument("--draft", default=None,
                   help="draft checkpoint directory [default: the shipped default draft]")
    p.add_argument("--target", default=os.environ.get("TANDEM_MODEL", DEFAULT_TARGET))
    p.add_argument("--prompts", type=Path, default=None,
                   help="JSONL of {\"prompt\": ...} [default: the committed held-out set]")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=8, help="draft tokens per round (max) [8]")
    p.add_argument("--temperatures", default="0,0.7", help="comma separated [%(default)s]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads for the cost timing (a worker uses one core) [1]")
    add_device_flags(p, "TANDEM_ACCEPTANCE", dtype_help=(
        "weight dtype of both models: auto (float32 on cpu, bfloat16 on cuda), float32, "
        "bfloat16, float16, int8 (cpu weight-only)"))
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--write-card", action="store_true",
                   help="record the results in the draft's tandem_draft.json")
    p.set_defaults(func=_cmd_acceptance)


def _cmd_acceptance(args) -> int:
    from tandem.device import place
    from tools.distill.acceptance import AcceptanceConfig, format_table, measure

    at = place(args.device, args.dtype)
    temps = tuple(float(x) for x in args.temperatures.split(",") if x.strip())
    cfg = AcceptanceConfig(k=args.k, max_new_tokens=args.max_new_tokens, temperatures=temps,
                           seed=args.seed, timing_threads=args.threads)
    if args.draft is None:
        from draft_service.weights import default_draft_dir

        args.draft = str(default_draft_dir())
    result = measure(args.draft, args.target, args.prompts, cfg,
                     log=lambda m: print(m, file=sys.stderr), at=at)
    print(format_table(result))
    text = json.dumps(result, indent=2) + "\n"
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    if args.write_card:
        from tools.distill.pipeline import CARD_FILE

        card_path = Path(args.draft) / CARD_FILE
        card = json.loads(card_path.read_text()) if card_path.exists() else {}
        card["acceptance"] = result
        card_path.write_text(json.dumps(card, indent=2) + "\n")
    return 0


def register(sub) -> None:
    """Add `distill` and `acceptance` to the `tandem` sub-command parser."""
    _add_distill(sub)
    _add_acceptance(sub)

