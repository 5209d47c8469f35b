"""One benchmark run, side by side: the transformers peers in this process, then a local
Tandem cluster (redis, 1 verifier, 1 draft worker, gateway as real processes) called over HTTP
and, for per-round stats, over the verifier's gRPC. Returns one JSON-able dict.

The peers run before the cluster starts, so the two never share the CPU; within a system the
methods are interleaved per prompt, so drift (a noisy neighbour) hits every method alike.

This module orders the phases, times them and keeps one failure from costing the rest; what
a run measures is config.py, the phases themselves phases.py (and shapes.run_shapes).
"""
from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from tandem.device import place
from tools.bench.config import (
    ROUND_METHODS,
    SUFFIX_CACHE_OFF,
    TANDEM_METHODS,
    BenchConfig,
    load_prompts,
    resolve_draft,
    resolve_eagle,
)
from tools.bench.host import children_log_to, machine, release_memory
from tools.bench.phases import Ctx, run_concurrency, run_gateway, run_peers, run_rounds


def _phase(ctx: Ctx, name: str, fn, *args) -> None:
    """Run one phase, timing it; a failure is recorded and the next phase still runs, so
    one broken method does not cost the whole run's figures."""
    start = time.perf_counter()
    try:
        fn(ctx, *args)
    except Exception as exc:  # reported in the results and on screen, not swallowed
        ctx.result["meta"].setdefault("errors", []).append(f"{name}: {exc!r}")
        tqdm.write(f"{name} failed: {exc!r}")
    ctx.result["meta"].setdefault("phase_s", {})[name] = round(time.perf_counter() - start, 1)


def _jobs(cfg: BenchConfig, n_prompts: int, shape_methods: tuple[str, ...]) -> int:
    from tools.bench.shapes import jobs as shape_jobs

    peers = n_prompts * len(cfg.peer_temperatures) * 3 if cfg.peers else 0
    return (peers + n_prompts * len(cfg.temperatures) * len(TANDEM_METHODS)
            + shape_jobs(cfg, n_prompts, shape_methods)
            + n_prompts * len(cfg.round_temperatures) * len(ROUND_METHODS)
            + len(cfg.concurrency) * len(cfg.concurrency_methods))


def _shape_methods(cfg: BenchConfig, eagle: str,
                   target) -> tuple[tuple[str, ...], dict[str, str]]:
    """The chain-vs-tree methods this run can serve, and why the others are skipped (`target`:
    its tandem.models.ModelPaths)."""
    from tandem.engine.medusa import find_medusa
    from tools.bench.shapes import available

    # The cluster's verifier finds Medusa heads the same way (its --medusa auto).
    return available(cfg.shape_methods, eagle, find_medusa(target) is not None)


def _costs(ctx: Ctx, eagle: str, shape_methods: tuple[str, ...]) -> None:
    """The in-process cost timings, each its own phase, before the cluster takes the CPU."""
    from tools.bench.baselines import (
        measure_c,
        measure_eagle_c,
        measure_layer_skip_c,
        measure_verify_curve,
    )

    cfg, at, meta = ctx.cfg, ctx.at, ctx.result["meta"]
    ctx.bar.set_description("draft/target forward cost (c)")
    _phase(ctx, "cost", lambda c: meta.update(cost=measure_c(ctx.draft, ctx.target, at=at)))
    if eagle:
        ctx.bar.set_description("eagle head/target cost (c)")
        _phase(ctx, "cost_eagle", lambda c: meta.update(
            cost_eagle=measure_eagle_c(eagle, ctx.target, at=at)))
    ctx.bar.set_description("layer-skip/target cost (c)")
    _phase(ctx, "cost_layer_skip", lambda c: meta.update(
        cost_layer_skip=measure_layer_skip_c(ctx.target, at=at)))
    if shape_methods:  # the chain-vs-tree bound's cost(q)
        ctx.bar.set_description("verify cost by tokens per forward")
        _phase(ctx, "cost_verify", lambda c: meta.update(cost_verify=measure_verify_curve(
            ctx.target, cfg.k + 1, cfg.threads, at=at)))
    release_memory(at)


def _on_cluster(ctx: Ctx, eagle: str, shape_methods: tuple[str, ...], tokenizer) -> None:
    """Start a local cluster (its logs to <out>/cluster.log) and run the phases that call it;
    the cluster stops however they end."""
    from tools.bench.client import worker_addresses
    from tools.bench.shapes import run_shapes
    from tools.launcher import Cluster, ClusterConfig, free_port

    cfg = ctx.cfg
    ctx.bar.set_description("starting the cluster")
    cluster = Cluster(ClusterConfig(num_drafts=1, num_verifiers=1, gateway_port=free_port(),
                                    model=cfg.model, draft_model=ctx.draft, eagle=eagle,
                                    threads=cfg.threads, device=cfg.device, dtype=cfg.dtype),
                      log=lambda m: None, env=dict(SUFFIX_CACHE_OFF))
    try:
        with children_log_to(ctx.out_dir / "cluster.log"):
            cluster.start()
        workers = worker_addresses(cluster.redis_url, cluster.redis_password)
        _phase(ctx, "gateway", run_gateway, cluster.gateway_url)
        if shape_methods:
            _phase(ctx, "shapes", run_shapes, cluster.gateway_url, shape_methods)
        _phase(ctx, "rounds", run_rounds, workers["verifier"][0], workers["draft"][0])
        _phase(ctx, "concurrency", run_concurrency, cluster.gateway_url, tokenizer)
    finally:
        cluster.stop()


def run_bench(cfg: BenchConfig, result: dict, out_dir: Path) -> dict:
    """Fills `result` as it goes, so a caller that catches an interruption still has every
    measurement made before it."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from tandem.models import resolve_model

    hf_logging.set_verbosity_error()  # generate()'s deprecation chatter would bury the bar
    start = time.perf_counter()
    at = place(cfg.device, cfg.dtype)
    target_paths = resolve_model(cfg.model or None)
    target = str(target_paths.root)
    draft, draft_info = resolve_draft(cfg.draft_model, out_dir)
    tok = AutoTokenizer.from_pretrained(target)
    prompts = load_prompts(cfg.per_category, cfg.prompt_ids)
    ids = {p["id"]: list(tok.apply_chat_template([{"role": "user", "content": p["prompt"]}],
                                                 add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)) for p in prompts}
    eagle = resolve_eagle(cfg.eagle)
    shape_methods, shapes_skipped = _shape_methods(cfg, eagle, target_paths)
    result.update({"meta": {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                            "machine": machine(at), "config": asdict(cfg), "target": target,
                            "draft": draft, "draft_info": draft_info,
                            "suffix_cache": "off (own text only; see --workload repetitive)",
                            "prompt_tokens": {p["id"]: len(ids[p["id"]]) for p in prompts},
                            **({"eagle": eagle} if eagle else {}),
                            "shapes_skipped": shapes_skipped},
                   "runs": [], "shapes": [], "rounds": [], "concurrency": []})
    with tqdm(total=_jobs(cfg, len(prompts), shape_methods), unit="run") as bar:
        ctx = Ctx(cfg, prompts, ids, target, draft, bar, out_dir, result, at)
        if cfg.peers:
            _phase(ctx, "peers", run_peers)
        _costs(ctx, eagle, shape_methods)
        _on_cluster(ctx, eagle, shape_methods, tok)
    result["meta"]["wall_s"] = round(time.perf_counter() - start, 1)
    result["meta"]["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return result
