"""The measuring phases of one standard `tandem bench` run, each a function of the run's Ctx
(runner.py orders them, times them and records their failures; the chain-vs-tree phase is
tools.bench.shapes.run_shapes):

  run_peers        transformers plain / assisted / prompt lookup, in this process
  run_gateway      every Tandem method through the gateway, one session at a time
  run_rounds       the verifier's gRPC directly, for per-round stats
  run_concurrency  n sessions at once per level, the methods interleaved within a level

Within a phase the methods are interleaved per prompt, so drift hits every method alike.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from tandem.device import Placement
from tools.bench.config import ROUND_METHODS, TANDEM_METHODS, BenchConfig
from tools.bench.host import release_memory
from tools.bench.stats import percentile


@dataclass
class Ctx:
    """What every phase reads (the config, prompts and their token ids, the models) and the
    result it appends its rows to."""
    cfg: BenchConfig
    prompts: list[dict]
    ids: dict[str, list[int]]
    target: str
    draft: str
    bar: tqdm
    out_dir: Path
    result: dict = field(default_factory=dict)
    at: Placement | None = None  # where this process's models go (None: the cpu, float32)


def _row(p: dict, system: str, method: str, temperature: float, out: dict) -> dict:
    return {"system": system, "method": method, "temperature": temperature,
            "prompt_id": p["id"], "category": p["category"], "grounded": p["grounded"], **out}


def run_peers(ctx: Ctx) -> None:
    import torch

    from tools.bench.baselines import PEER_METHODS, load_assistant, load_target, run_peer

    cfg = ctx.cfg
    torch.set_num_threads(cfg.peer_threads or torch.get_num_threads())
    model = load_target(ctx.target, ctx.at)
    assistant = load_assistant(ctx.draft, model.config.vocab_size, ctx.at)
    warm = ctx.ids[ctx.prompts[0]["id"]]
    for method in PEER_METHODS:  # first calls pay one-off costs (allocator, kernels)
        run_peer(model, assistant, warm, method, 4, 0.0, cfg.k)
    for p in ctx.prompts:
        for temp in cfg.peer_temperatures:
            for method in PEER_METHODS:
                ctx.bar.set_description(f"transformers {method} T={temp} {p['id']}")
                out = run_peer(model, assistant, ctx.ids[p["id"]], method, cfg.max_tokens,
                               temp, cfg.k, cfg.seed or 0)
                ctx.result["runs"].append(_row(p, "transformers", method, temp, out))
                ctx.bar.update()
    del model, assistant
    release_memory(ctx.at)  # the cluster's processes get the memory back


def run_gateway(ctx: Ctx, url: str) -> None:
    from tools.bench.client import chat_body, run_single

    cfg = ctx.cfg
    for method in TANDEM_METHODS:  # warm-up: connections, draft worker caches
        run_single(url, chat_body(ctx.prompts[0]["prompt"], 8, 0.0, method, cfg.k))
    for p in ctx.prompts:
        for temp in cfg.temperatures:
            for method in TANDEM_METHODS:
                ctx.bar.set_description(f"tandem {method} T={temp} {p['id']}")
                body = chat_body(p["prompt"], cfg.max_tokens, temp, method, cfg.k, cfg.seed)
                ctx.result["runs"].append(_row(p, "tandem", method, temp,
                                               run_single(url, body)))
                ctx.bar.update()


def run_rounds(ctx: Ctx, verifier: str, draft: str) -> None:
    from tools.bench.client import verifier_rounds

    cfg = ctx.cfg
    for p in ctx.prompts:
        for temp in cfg.round_temperatures:
            for method in ROUND_METHODS:
                ctx.bar.set_description(f"verifier rounds {method} T={temp} {p['id']}")
                out = verifier_rounds(verifier, ctx.ids[p["id"]], cfg.max_tokens, temp,
                                      method, cfg.k, cfg.seed, draft)
                ctx.result["rounds"].append(_row(p, "tandem-grpc", method, temp, out))
                ctx.bar.update()


def run_concurrency(ctx: Ctx, url: str, tokenizer) -> None:
    """Each level runs every method back to back (A/B within the run: a level's methods share
    the host's noise). A failed (level, method) is recorded and the rest still run."""
    for n in ctx.cfg.concurrency:
        for method in ctx.cfg.concurrency_methods:
            ctx.bar.set_description(f"tandem {method} x{n} concurrent")
            try:
                ctx.result["concurrency"].append(_concurrent(ctx, url, tokenizer, n, method))
            except Exception as exc:  # reported in the results and on screen
                ctx.result["meta"].setdefault("errors", []).append(
                    f"concurrency {method} x{n}: {exc!r}")
                tqdm.write(f"concurrency {method} x{n} failed: {exc!r}")
            ctx.bar.update()


def _concurrent(ctx: Ctx, url: str, tokenizer, n: int, method: str) -> dict:
    """`n` greedy sessions of `method` at once, the prompts taken in turn."""
    from tools.bench.client import chat_body, run_concurrent

    cfg = ctx.cfg
    bodies = [chat_body(ctx.prompts[i % len(ctx.prompts)]["prompt"], cfg.max_tokens, 0.0,
                        method, cfg.k) for i in range(n)]
    out = run_concurrent(url, bodies, tokenizer)
    itl, ttft = out.pop("itl_s"), out.pop("ttft_s")
    return {"method": method, "temperature": 0.0, **out,
            "itl_p50_ms": percentile(itl, 50) * 1e3, "itl_p99_ms": percentile(itl, 99) * 1e3,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99)}
