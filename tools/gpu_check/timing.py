"""Timing helpers shared by gpu-check's measuring phases: the timed models (random weights,
bf16 on a GPU, fp32 on the CPU) kept between phases, and a synchronised median timer."""
from __future__ import annotations

import statistics
import time

import torch

from tandem.device import synchronize
from tandem.engine.llama import LlamaModel
from tandem.engine.model_runner import SeqChunk
from tools.gpu_check.models import shaped
from tools.gpu_check.runner import PhaseContext

GPU_MODELS = ("llama-1b", "llama-8b")  # (draft-sized, target-sized)
TINY_MODELS = ("tiny-a", "tiny-b")


def model_names(ctx: PhaseContext) -> tuple[str, str]:
    return TINY_MODELS if ctx.tiny else GPU_MODELS


def timed_dtype(ctx: PhaseContext) -> torch.dtype:
    return torch.bfloat16 if ctx.device.type == "cuda" else torch.float32


def timed_model(ctx: PhaseContext, name: str) -> LlamaModel:
    """The random model `name` on the device, built once per run (ctx.cache)."""
    key = ("model", name)
    if key not in ctx.cache:
        t0 = time.perf_counter()
        ctx.cache[key] = shaped(name, ctx.device, timed_dtype(ctx))
        synchronize(ctx.device)
        ctx.log(f"  built {name} ({timed_dtype(ctx)}) in {time.perf_counter() - t0:.1f} s")
    return ctx.cache[key]


def median_ms(fn, device, reps: int, warmup: int = 1) -> float:
    """Median wall time of fn() in ms over `reps` runs after `warmup`, the device synced."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def chunks_at(batch: int, q: int, context: int, block_size: int,
              per: int = 0) -> list[SeqChunk]:
    """`batch` sequences, each adding q tokens after `context` cached ones, each on its own
    `per` consecutive blocks (0: as few as hold it; the KV there is whatever the cache holds:
    timing only)."""
    per = per or -(-(context + q) // block_size)
    return [SeqChunk([1] * q, context, list(range(i * per, (i + 1) * per)),
                     num_logits=q) for i in range(batch)]


def blocks_for(batch: int, context: int, q: int, block_size: int) -> int:
    return batch * -(-(context + q) // block_size) + 1  # +1: a spare (graphs' scratch)
