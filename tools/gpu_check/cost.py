"""Phases `verify_cost` and `decode`: what a target forward costs on this device.

verify_cost: the forward over q = 1..16 new tokens per sequence at batch 1..64 on a cached
context, for a 1B- and an 8B-shaped Llama in bf16 (tiny shapes with --tiny); the ratio to q = 1
at the same batch is the curve the cost model and the tree sizing read.
decode: plain decode steps at batch 1, 16 and 64: tokens/s.
"""
from __future__ import annotations

import functools

from tandem.engine.model_runner import ModelRunner
from tools.gpu_check.runner import PhaseContext
from tools.gpu_check.timing import (
    blocks_for,
    chunks_at,
    median_ms,
    model_names,
    timed_model,
)

QS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
BATCHES = (1, 4, 16, 64)
DECODE_BATCHES = (1, 16, 64)


def _sizes(ctx: PhaseContext) -> tuple[int, int]:
    """(context tokens, timed repetitions)."""
    return (32, 1) if ctx.tiny else (512, 3)


def run_verify_cost(ctx: PhaseContext) -> None:
    context, reps = _sizes(ctx)
    batches = BATCHES if not ctx.tiny else (1, 4)
    qs = QS if not ctx.tiny else (1, 4, 16)
    curves = ctx.result.setdefault("curves", {})
    ctx.result.update(context=context, qs=list(qs), batches=list(batches))
    for name in model_names(ctx):
        model = timed_model(ctx, name)
        runner = ModelRunner(model, blocks_for(max(batches), context, max(qs), 16), 16)
        curve = curves.setdefault(name, {})
        for b in batches:
            row = curve.setdefault(str(b), {})
            for q in qs:
                if ctx.out_of_time():
                    return
                chunks = chunks_at(b, q, context, 16)
                call = functools.partial(runner.forward, chunks)
                row[str(q)] = round(median_ms(call, ctx.device, reps), 3)
            ratios = {q: round(ms / row["1"], 3) for q, ms in row.items()}
            ctx.result.setdefault("ratio_to_q1", {}).setdefault(name, {})[str(b)] = ratios
            ctx.log(f"  {name} batch {b}: q=1 {row['1']:.2f} ms, ratios {ratios}")


def run_decode(ctx: PhaseContext) -> None:
    context, reps = _sizes(ctx)
    steps = 4 if ctx.tiny else 16
    batches = DECODE_BATCHES if not ctx.tiny else (1, 4)
    rates = ctx.result.setdefault("tokens_per_s", {})
    ctx.result.update(context=context, steps=steps)
    for name in model_names(ctx):
        model = timed_model(ctx, name)
        runner = ModelRunner(model, blocks_for(max(batches), context, steps, 16), 16)
        for b in batches:
            if ctx.out_of_time():
                return
            blocks = -(-(context + steps) // 16)  # each sequence's table, every step
            per = [chunks_at(b, 1, context + s, 16, blocks) for s in range(steps)]
            ms = median_ms(functools.partial(_decode_steps, runner, per), ctx.device, reps)
            rates.setdefault(name, {})[str(b)] = round(b * steps / (ms / 1e3), 1)
            ctx.log(f"  {name} batch {b}: {rates[name][str(b)]} tokens/s")


def _decode_steps(runner: ModelRunner, steps: list) -> None:
    for chunks in steps:
        runner.forward(chunks)
