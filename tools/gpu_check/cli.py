"""`tandem gpu-check`: use a short GPU window fully with one command.

Needs only what a stock PyTorch image has (torch, numpy, safetensors; matplotlib if
present): random-weight models, no checkpoint, tokenizer, network, Redis, FastAPI or gRPC
services. Every phase is time-boxed (tools/gpu_check/runner.py); the boxes sum to under 8 min
on a GPU. `--device cpu --tiny` is the dry run the test suite runs.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tools.gpu_check.runner import Phase

# Each phase's time box on a GPU, in seconds, in the order they run (475 s in all).
BOXES = {"correctness": 130, "attention": 75, "cuda_graphs": 60, "verify_cost": 120,
         "decode": 45, "colocate": 45}
PHASE_NAMES = tuple(BOXES)


ABOUT = {
    "correctness": "device vs CPU fp32 on tiny random models of every family: logits, greedy "
                   "text, speculation (ngram, draft model, EAGLE, Medusa tree) identical to "
                   "plain, tree verification, logprobs, rejection sampler distribution",
    "attention": "paged attention kernels (reference, flex, flash if installed) on decode, "
                 "chain and tree layouts: speed and agreement",
    "cuda_graphs": "decode steps with CUDA graphs off and on: same output, and the step time "
                   "per batch",
    "verify_cost": "forward time over q = 1..16 new tokens at batch 1..64 (1B- and 8B-shaped "
                   "Llama, bf16 on a GPU)",
    "decode": "plain decode tokens/s at batch 1, 16, 64",
    "colocate": "a draft model and a verifier sharing the device: each alone vs both at once",
}


def phases() -> list[Phase]:
    from tools.gpu_check import attention, colocate, correctness, cost, graphs

    runs = {"correctness": correctness.run, "attention": attention.run,
            "cuda_graphs": graphs.run, "verify_cost": cost.run_verify_cost,
            "decode": cost.run_decode, "colocate": colocate.run}
    return [Phase(name, box, runs[name], ABOUT[name]) for name, box in BOXES.items()]


def register(sub) -> None:
    p = sub.add_parser("gpu-check", help="check and measure Tandem on this device in one "
                       "command (random-weight models; no checkpoint or network needed)",
                       description=description(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=cmd_gpu_check)


def description() -> str:
    boxes = ", ".join(f"{n} {s} s" for n, s in BOXES.items())
    return f"{__doc__}\nPhases and their time boxes, in order: {boxes} (docs/results/gpu.md)."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, type=Path,
                   help="directory for gpu-check.json, gpu-check.md and up to 3 plots")
    p.add_argument("--device", default="auto",
                   help="auto (the first CUDA GPU, else the CPU), cpu, cuda, cuda:N")
    p.add_argument("--tiny", action="store_true",
                   help="tiny model shapes for the timing phases (the CPU dry run)")
    p.add_argument("--phases", default=",".join(PHASE_NAMES),
                   help="comma-separated subset (run in the order above; default all)")
    p.add_argument("--box-scale", type=float, default=1.0,
                   help="multiply every phase's time box (default 1)")


def _log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} gpu-check: {msg}", file=sys.stderr, flush=True)


def _environment(device) -> dict:
    import torch

    from kernels import flash, flex_attention

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": str(device), "device_name": name, "torch": torch.__version__,
            "cuda": torch.version.cuda, "flex_available": flex_attention.is_available(),
            "flash_installed": flash.is_available()}


def cmd_gpu_check(args) -> int:
    import torch

    from tandem.device import resolve_device
    from tools.gpu_check import plots, report
    from tools.gpu_check.runner import PhaseContext, run_all

    chosen = [n.strip() for n in args.phases.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in PHASE_NAMES]
    if unknown or not chosen:
        raise ValueError(f"unknown phases {unknown}: choose from {', '.join(PHASE_NAMES)}")
    if args.box_scale <= 0:
        raise ValueError(f"--box-scale must be > 0, got {args.box_scale}")
    device = resolve_device(args.device)
    if device.type == "cpu" and not args.tiny:
        raise ValueError("the timing phases use 1B and 8B shapes: on the CPU add --tiny")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 checks compare with the CPU
    args.out.mkdir(parents=True, exist_ok=True)
    env = _environment(device)
    _log(f"{env['device_name']} (torch {env['torch']}), phases {', '.join(chosen)}")
    cache: dict = {}
    t0 = time.monotonic()
    selected = [p for p in phases() if p.name in chosen]
    reports = run_all(selected, lambda deadline: PhaseContext(device, args.tiny, deadline, cache,
                                                              _log), args.box_scale, _log)
    cache.clear()
    from kernels import flex_attention

    env["flex_failures"] = list(flex_attention._broken)  # compiled flex errors, if any
    summary = {"tandem_gpu_check": 1, **env, "tiny": args.tiny,
               "total_s": round(time.monotonic() - t0, 2),
               "all_ok": all(r["status"] == "ok" for r in reports.values()),
               "phases": reports, "recommendations": report.recommendations(reports)}
    made = plots.write_plots(args.out, reports)
    paths = [report.write_json(args.out, summary), report.write_markdown(args.out, summary, made)]
    _log(f"done in {summary['total_s']:.1f} s, all ok: {summary['all_ok']}; wrote "
         + ", ".join(str(p) for p in paths + [args.out / m for m in made]))
    return 0 if summary["all_ok"] else 1
