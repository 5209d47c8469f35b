"""Phase `cuda_graphs`: decode steps with CUDA graphs off and on (tandem/engine/cuda_graphs.py).

1. Same output: a tiny fp32 model decodes greedily through the eager runner and through the
   GraphDecoder (captured graphs on a GPU; the same padded layout run eagerly on the CPU): the
   same tokens, logits within fp32 noise.
2. Gain: the 1B-shaped bf16 model's decode step at batch 1, 16 and 64, eager vs replayed
   (tiny shapes on --tiny), and the capture time. `--cuda-graphs auto` should turn graphs on
   only where this measured a gain on a GPU.
"""
from __future__ import annotations

import time

from tandem.device import synchronize
from tandem.engine.cuda_graphs import GraphDecoder
from tandem.engine.model_runner import ModelRunner, SeqChunk
from tandem.sampling_params import SamplingParams
from tools.gpu_check.models import tiny_family
from tools.gpu_check.runner import PhaseContext
from tools.gpu_check.spec_loop import generate
from tools.gpu_check.timing import chunks_at, median_ms, model_names, timed_model

PROMPTS = [[3, 8, 13, 21, 34], [2, 7, 1, 8, 2, 8, 18], [9, 9, 4]]


def run(ctx: PhaseContext) -> None:
    ctx.result["captured"] = ctx.device.type == "cuda"
    _same_output(ctx)
    if not ctx.out_of_time():
        _gain(ctx)


def _greedy(forward, prefill: ModelRunner, steps: int) -> tuple[list[list[int]], list]:
    tables = [list(range(i * 4, i * 4 + 4)) for i in range(len(PROMPTS))]
    logits = prefill.forward([SeqChunk(p, 0, t) for p, t in zip(PROMPTS, tables)])
    seqs, all_logits = [list(p) for p in PROMPTS], []
    for _ in range(steps):
        for s, tok in zip(seqs, logits.argmax(-1).tolist()):
            s.append(tok)
        logits = forward([SeqChunk([s[-1]], len(s) - 1, t) for s, t in zip(seqs, tables)])
        all_logits.append(logits.float().cpu())
    return seqs, all_logits


def _same_output(ctx: PhaseContext) -> None:
    model = tiny_family("qwen3", ctx.device)
    eager, graphed = ModelRunner(model, 16, 16), ModelRunner(model, 16, 16)
    decoder = GraphDecoder(graphed, scratch_block=15)
    want, want_logits = _greedy(eager.forward, eager, 12)
    got, got_logits = _greedy(decoder.forward, graphed, 12)
    diff = max((a - b).abs().max().item() for a, b in zip(want_logits, got_logits))
    ctx.result["same_output"] = {"tokens_same": got == want, "max_abs_logit_diff": diff,
                                 "replays": decoder.replays, "fallbacks": decoder.fallbacks}
    ctx.check("graphs/tokens_same", got == want)
    ctx.check("graphs/logits_close", diff < 2e-3, diff)
    ctx.check("graphs/no_fallback", decoder.fallbacks == 0, decoder.fallbacks)
    if decoder.capture:
        ctx.check("graphs/replayed", decoder.replays == 12, decoder.replays)
    # as the verifier serves it: the Executor's decode steps through the graphs
    sampling = SamplingParams(temperature=0.8, seed=3)
    plain = generate(ModelRunner(model, 8, 16), PROMPTS[1], 24, sampling).tokens
    served = generate(ModelRunner(model, 8, 16), PROMPTS[1], 24, sampling, graphs=True).tokens
    ctx.result["executor_same"] = served == plain
    ctx.check("graphs/executor_text_same", served == plain)


def _gain(ctx: PhaseContext) -> None:
    name = model_names(ctx)[0]
    model = timed_model(ctx, name)
    context, reps = (32, 2) if ctx.tiny else (512, 10)
    batches = (1, 4) if ctx.tiny else (1, 16, 64)
    per = -(-(context + 1) // 16)
    runner = ModelRunner(model, max(batches) * per + 1, 16)
    decoder = GraphDecoder(runner, scratch_block=runner.num_blocks - 1)
    rows = ctx.result.setdefault("decode_step_ms", {})
    for b in batches:
        if ctx.out_of_time():
            return
        step = chunks_at(b, 1, context, 16, per)
        t0 = time.perf_counter()
        decoder.forward(step)  # builds (captures, on a GPU) this bucket's graph
        synchronize(ctx.device)
        capture_ms = (time.perf_counter() - t0) * 1e3
        eager_ms = median_ms(lambda s=step: runner.forward(s), ctx.device, reps)
        graph_ms = median_ms(lambda s=step: decoder.forward(s), ctx.device, reps)
        rows[str(b)] = {"eager_ms": round(eager_ms, 3), "graph_ms": round(graph_ms, 3),
                        "gain": round(eager_ms / graph_ms, 3),
                        "first_call_ms": round(capture_ms, 1)}
        ctx.log(f"  {name} batch {b}: eager {eager_ms:.2f} ms, graphs {graph_ms:.2f} ms")
    ctx.result["model"] = name
