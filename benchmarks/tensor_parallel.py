"""Reaches inside: it times the TP group's forward and gloo alone, which no served path isolates.

Tensor parallel on this CPU (issue 31): TP=2 over gloo, one thread per rank, against TP=1
with two threads, in one run, interleaved.

  python benchmarks/tensor_parallel.py [--steps 32] [--reps 3] [--out results/tensor_parallel.json]

SmolLM2-135M has 3 KV heads, so it splits 3 ways only; this runs a random-weight checkpoint of
SmolLM2's shape (30 layers, hidden 576, MLP 1536, vocab 49152) with 8 heads over 4 KV heads
(head_dim 72), which splits 2 ways. Weights do not change the cost of a forward.

1. greedy decoding tokens/s at batch 1 and batch 16 (a 64-token prompt each), and whether
   TP=2 decodes the same tokens as TP=1 (TP=1 on one thread too: each TP=2 rank's share);
2. the verify-cost curve: one forward over q = 1..8 new tokens on a cached 64-token prefix,
   ms and relative to q = 1;
3. gloo's own latency between two processes: an all-reduce of the residual stream (a TP=2
   forward runs 61 of them: two per layer and the embedding's, plus the logits' all-gather)
   and rank 0's step message.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers

from tandem.engine.llama import LlamaModel
from tandem.engine.model_runner import ModelRunner, SeqChunk, kv_bytes_per_token
from tandem.models import resolve_model
from verify_service.tp.group import start_leader

SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=8, num_key_value_heads=4, head_dim=72,
             max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-5)
PROMPT, BLOCK, BLOCKS_PER_SEQ = 64, 16, 8  # 128 positions per sequence
BATCHES = (1, 16)


def checkpoint(path: Path) -> Path:
    """The SmolLM2-shaped random checkpoint, written once."""
    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(**SHAPE)
        transformers.AutoModelForCausalLM.from_config(cfg).float().save_pretrained(path)
    return path


def decode(runner: ModelRunner, batch: int, steps: int) -> tuple[float, list[list[int]]]:
    """Greedy decoding of `batch` sequences: (tokens/s over the decode steps, tokens)."""
    gen = torch.Generator().manual_seed(batch)
    tables = [list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ)) for i in range(batch)]
    prompts = [torch.randint(0, SHAPE["vocab_size"], (PROMPT,), generator=gen).tolist()
               for _ in range(batch)]
    logits = runner.forward([SeqChunk(p, 0, t) for p, t in zip(prompts, tables)])
    out = [[int(x)] for x in logits.argmax(-1)]
    t0 = time.perf_counter()
    for step in range(steps):
        logits = runner.forward([SeqChunk([o[-1]], PROMPT + step, t)
                                 for o, t in zip(out, tables)])
        for o, x in zip(out, logits.argmax(-1)):
            o.append(int(x))
    return batch * steps / (time.perf_counter() - t0), out


def verify_curve(runner: ModelRunner, reps: int) -> dict[int, float]:
    """Median ms of one forward over q new tokens on a cached PROMPT-token prefix."""
    table = list(range(BLOCKS_PER_SEQ))
    ids = torch.randint(0, SHAPE["vocab_size"], (PROMPT + 8,),
                        generator=torch.Generator().manual_seed(7)).tolist()
    runner.forward([SeqChunk(ids[:PROMPT], 0, table)])
    curve = {}
    for q in range(1, 9):
        times = []
        for _ in range(reps + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            runner.forward([SeqChunk(ids[PROMPT:PROMPT + q], PROMPT, table, num_logits=q)])
            times.append(time.perf_counter() - t0)
        curve[q] = statistics.median(times[1:]) * 1e3
    return curve


def _probe(rank: int, init: str, out: str, reps: int) -> None:
    """One rank of the collective probe: mean µs of the per-step communication."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.set_num_threads(1)
    result = {}
    for rows in BATCHES:  # one all-reduce of the residual stream, as each layer runs twice
        x = torch.randn(rows, SHAPE["hidden_size"])
        for _ in range(20):  # warm-up
            dist.all_reduce(x)
        t0 = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(x)
        result[f"all_reduce_{rows}x576_us"] = (time.perf_counter() - t0) / reps * 1e6
    message = ("forward", [SeqChunk([1], PROMPT, list(range(BLOCKS_PER_SEQ)))], True)
    t0 = time.perf_counter()
    for _ in range(reps):  # rank 0's step message (two broadcasts: its size, then it)
        dist.broadcast_object_list([message if rank == 0 else None], src=0)
    result["step_message_us"] = (time.perf_counter() - t0) / reps * 1e6
    if rank == 0:
        Path(out).write_text(json.dumps({k: round(v, 1) for k, v in result.items()}))
    dist.destroy_process_group()


def collective_latency(reps: int = 300) -> dict:
    """gloo's latency between two processes here, outside any model."""
    import tempfile

    from tandem.netaddr import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "probe.json")
        mp.spawn(_probe, args=(f"tcp://127.0.0.1:{free_port()}", out, reps), nprocs=2)
        return json.loads(Path(out).read_text())


def measure(runners: dict, threads: dict, steps: int, reps: int) -> dict:
    """Every measurement for each runner in turn, `reps` times interleaved; medians."""
    rows: dict = {name: {"tok_s": {b: [] for b in BATCHES}, "curve": []} for name in runners}
    tokens: dict = {}
    for _ in range(reps):
        for name, runner in runners.items():
            torch.set_num_threads(threads[name])
            for b in BATCHES:
                tok_s, out = decode(runner, b, steps)
                rows[name]["tok_s"][b].append(tok_s)
                tokens[(name, b)] = out
            rows[name]["curve"].append(verify_curve(runner, 3))
    result = {}
    for name, r in rows.items():
        curve = {q: statistics.median(c[q] for c in r["curve"]) for q in range(1, 9)}
        result[name] = {
            "threads_per_rank": threads[name],
            "tokens_per_s": {b: round(statistics.median(v), 2) for b, v in r["tok_s"].items()},
            "verify_ms": {q: round(ms, 2) for q, ms in curve.items()},
            "verify_relative": {q: round(ms / curve[1], 3) for q, ms in curve.items()}}
    names = list(runners)
    result["same_greedy_tokens"] = {b: tokens[(names[0], b)] == tokens[(names[-1], b)]
                                    for b in BATCHES}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=32, help="decode steps per measurement")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions")
    ap.add_argument("--ckpt", type=Path, default=Path("/tmp/tandem-tp-bench-ckpt"))
    ap.add_argument("--out", type=Path, default=Path("results/tensor_parallel.json"))
    args = ap.parse_args()
    path = checkpoint(args.ckpt)
    blocks = BLOCKS_PER_SEQ * max(BATCHES)
    torch.set_num_threads(2)
    tp1 = ModelRunner(LlamaModel.load(resolve_model(path)), blocks, BLOCK)
    torch.set_num_threads(1)  # rank 0's kernels tuned for one thread, as rank 1's
    leader = start_leader(str(path), 2, "float32", threads=1, timeout_s=120)
    try:
        budget = blocks * BLOCK * kv_bytes_per_token(leader.model)
        tp2 = leader.make_runner(budget, BLOCK, keep_features=False)
        result = measure({"tp1_2threads": tp1, "tp1_1thread": tp1, "tp2_1thread_per_rank": tp2},
                         {"tp1_2threads": 2, "tp1_1thread": 1, "tp2_1thread_per_rank": 1},
                         args.steps, args.reps)
    finally:
        leader.close()
    result["gloo_latency"] = collective_latency()
    result["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(),
                         "torch": torch.__version__, "steps": args.steps, "reps": args.reps}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
