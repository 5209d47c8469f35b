"""Phase `colocate`: a draft model and a verifier sharing one device, and how much each slows
the other.

The verifier (the 8B-shaped target) runs verification forwards (batch 16, 5 new tokens each);
the draft (the 1B-shaped model) runs decode steps (batch 16). Each runs `n` times alone, then
both at once from two threads, each on its own CUDA stream on a GPU. Reported: each one's time
alone and together, its slowdown, and the overlap (sum alone / wall together: 2 = perfect
sharing, 1 = fully serialised).
"""
from __future__ import annotations

import threading
import time

import torch

from tandem.device import synchronize
from tandem.engine.model_runner import ModelRunner
from tools.gpu_check.runner import PhaseContext
from tools.gpu_check.timing import blocks_for, chunks_at, model_names, timed_model

BATCH, VERIFY_Q = 16, 5


def _worker(ctx: PhaseContext, name: str, q: int, context: int):
    """A closure running n forwards of one model (on its own stream on a GPU)."""
    model = timed_model(ctx, name)
    runner = ModelRunner(model, blocks_for(BATCH, context, q, 16), 16)
    step = chunks_at(BATCH, q, context, 16)
    stream = torch.cuda.Stream(ctx.device) if ctx.device.type == "cuda" else None

    def work(n: int) -> float:  # seconds
        t0 = time.perf_counter()
        if stream is None:
            for _ in range(n):
                runner.forward(step)
        else:
            with torch.cuda.stream(stream):
                for _ in range(n):
                    runner.forward(step)
            stream.synchronize()
        return time.perf_counter() - t0

    work(1)  # warm-up
    return work


def run(ctx: PhaseContext) -> None:
    draft_name, target_name = model_names(ctx)
    context, n = (32, 3) if ctx.tiny else (512, 20)
    verify = _worker(ctx, target_name, VERIFY_Q, context)
    draft = _worker(ctx, draft_name, 1, context)
    synchronize(ctx.device)
    alone = {"verifier": verify(n), "draft": draft(n)}
    if ctx.out_of_time():
        return
    together: dict[str, float] = {}
    threads = [threading.Thread(target=lambda k=k, f=f: together.__setitem__(k, f(n)))
               for k, f in (("verifier", verify), ("draft", draft))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ctx.result.update(
        verifier=target_name, draft=draft_name, batch=BATCH, verify_q=VERIFY_Q, runs=n,
        alone_s={k: round(v, 4) for k, v in alone.items()},
        together_s={k: round(v, 4) for k, v in together.items()},
        slowdown={k: round(together[k] / alone[k], 3) for k in alone},
        wall_together_s=round(wall, 4), overlap=round(sum(alone.values()) / wall, 3))
    ctx.log(f"  slowdown {ctx.result['slowdown']}, overlap {ctx.result['overlap']}")
