"""One benchmark run, side by side: the transformers peers in this process, then a local
Tandem cluster (redis, 1 verifier, 1 draft worker, gateway as real processes) called over HTTP
and, for per-round stats, over the verifier's gRPC. Returns one JSON-able dict.

The peers run before the cluster starts, so the two never share the CPU; within a system the
methods are interleaved per prompt, so drift (a noisy neighbour) hits every method alike.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from tandem.device import Placement, check_device_spec, check_dtype_spec, place
from tandem.spec.methods import API_NAMES, Method
from tools.bench.shapes import TREE_METHODS
from tools.bench.stats import percentile

PROMPTS_FILE = Path(__file__).with_name("prompts.jsonl")
# Every method the API names but mtp: the default target carries no MTP module, so an mtp row
# would be plain decoding under another name.
TANDEM_METHODS = tuple(m for m in API_NAMES if m != Method.MTP.api_name)
SPEC_METHODS = tuple(m for m in TANDEM_METHODS if m != Method.NONE.api_name)  # those that draft
# Direct verifier runs: plain too, so the gateway hop of plain decoding is measured as well.
ROUND_METHODS = (Method.NONE.api_name, *SPEC_METHODS)
QUICK_CONCURRENCY_METHODS = (Method.NONE.api_name, Method.NGRAM.api_name,
                             Method.DRAFT_MODEL.api_name)


# Every prompt is asked several times in a run (per temperature, then direct): with its
# cross-request cache on, suffix would draft from the run's own earlier answers. The standard
# run measures it on prompts it has not seen; `--workload repetitive` measures the cache.
SUFFIX_CACHE_OFF = {"TANDEM_DRAFT_SUFFIX_CACHE_TOKENS": "0"}


@dataclass(frozen=True)
class BenchConfig:
    max_tokens: int = 128
    k: int = 16  # draft tokens per round at most, for every method (the verifier's cap)
    temperatures: tuple[float, ...] = (0.0, 0.7)  # Tandem through the gateway
    peer_temperatures: tuple[float, ...] = (0.0, 0.7)  # the transformers peers
    round_temperatures: tuple[float, ...] = (0.0, 0.7)  # direct gRPC runs for round stats
    concurrency: tuple[int, ...] = (1, 4, 16, 32)
    # Every level runs each of these, interleaved (for each level, for each method).
    concurrency_methods: tuple[str, ...] = TANDEM_METHODS
    # The chain-vs-tree phase (tools.bench.shapes) runs these methods, greedy, on the first
    # shape_prompts prompts of the run (0 = all of them); () skips the phase.
    shape_methods: tuple[str, ...] = TREE_METHODS
    shape_prompts: int = 0
    per_category: int = 0  # prompts per category, 0 = all
    prompt_ids: tuple[str, ...] = ()  # only these prompts (smoke runs); () = no filter
    model: str = ""  # target; "" = the default
    draft_model: str = ""  # "" = the shipped draft
    eagle: str = ""  # EAGLE head directory; "" = the shipped head ("none": no eagle)
    threads: int = 1  # torch threads per worker process
    peer_threads: int = 1  # torch threads of the transformers peers (1 is as fast as 2 here)
    peers: bool = True
    # None: Tandem requests carry no seed, as most users send them. Seeded sampled sessions
    # verify by matching keyed samples instead of rejection sampling: pass one to measure that.
    seed: int | None = None
    quick: bool = False
    # Where every model of the run goes (tandem.device): the peers and cost timings in this
    # process, and the cluster's verifier and draft worker (passed on as --device / --dtype).
    device: str = "auto"
    dtype: str = "auto"

    def __post_init__(self):
        if (self.max_tokens < 2 or not 1 <= self.k <= 32 or self.per_category < 0
                or self.shape_prompts < 0):
            raise ValueError("need max_tokens >= 2, 1 <= k <= 32, per_category >= 0, "
                             "shape_prompts >= 0")
        if any(c < 1 for c in self.concurrency):
            raise ValueError(f"concurrency levels must be >= 1, got {self.concurrency}")
        bad = [m for m in self.concurrency_methods if m not in API_NAMES]
        if bad or not self.concurrency_methods:
            raise ValueError(f"concurrency methods must be some of {', '.join(API_NAMES)}; "
                             f"got {','.join(bad) or 'an empty list'}")
        bad = [m for m in self.shape_methods if m not in TREE_METHODS]
        if bad:
            raise ValueError(f"shape methods must be some of {', '.join(TREE_METHODS)}; "
                             f"got {','.join(bad)}")
        check_device_spec(self.device)
        check_dtype_spec(self.dtype)


def quick_config(**overrides) -> BenchConfig:
    """--quick: one prompt per category, 64 tokens, greedy-only peers and round stats,
    concurrency 1/4/8 for none, ngram and draft_model, chain vs tree on 3 prompts: about
    five minutes on the 2-core machine."""
    base = dict(max_tokens=64, peer_temperatures=(0.0,), round_temperatures=(0.0,),
                concurrency=(1, 4, 8), per_category=1, quick=True,
                concurrency_methods=QUICK_CONCURRENCY_METHODS, shape_prompts=3)
    return BenchConfig(**{**base, **overrides})


@dataclass
class _Ctx:
    cfg: BenchConfig
    prompts: list[dict]
    ids: dict[str, list[int]]
    target: str
    draft: str
    bar: tqdm
    out_dir: Path
    result: dict = field(default_factory=dict)
    at: Placement | None = None  # where this process's models go (None: the cpu, float32)


def load_prompts(per_category: int = 0, ids: tuple[str, ...] = (),
                 path: Path = PROMPTS_FILE) -> list[dict]:
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    if ids:
        rows = [r for r in rows if r["id"] in ids]
    if not per_category:
        return rows
    seen: dict[str, int] = {}
    out = []
    for r in rows:
        seen[r["category"]] = seen.get(r["category"], 0) + 1
        if seen[r["category"]] <= per_category:
            out.append(r)
    return out


def resolve_eagle(value: str) -> str:
    """The EAGLE head the cluster serves: a directory, or "" for none."""
    if value.strip().lower() == "none":
        return ""
    if value:
        return value
    from draft_service.weights import default_eagle_dir

    shipped = default_eagle_dir()
    return str(shipped) if (shipped / "config.json").is_file() else ""


def resolve_draft(draft_model: str, out_dir: Path) -> tuple[str, dict]:
    """The draft directory every phase loads, and what to say about it. The shipped draft is
    copied first: a distillation may swap a new checkpoint in mid-run, and the peers and the
    cluster must measure the same weights."""
    if draft_model:
        return draft_model, {"source": draft_model}
    from draft_service.weights import default_draft_dir

    shipped = Path(default_draft_dir())
    if not (shipped / "config.json").is_file():
        raise SystemExit(f"no shipped draft at {shipped}; pass --draft-model DIR")
    snap = out_dir / "draft-snapshot"
    shutil.rmtree(snap, ignore_errors=True)
    shutil.copytree(shipped, snap)
    info = {"source": str(shipped), "snapshot": str(snap)}
    try:
        card = json.loads((snap / "tandem_draft.json").read_text())
        info.update(architecture=card.get("architecture"), progress=card.get("progress"))
    except (OSError, ValueError):
        pass
    return str(snap), info


def machine(at: Placement | None = None) -> dict:
    """The host, and where the run's models went (`at`; the cpu when not given)."""
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    on_gpu = at is not None and at.device.type == "cuda"
    return {"cpu": cpu, "cores": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(at.device) if on_gpu else "none",
            "device": str(at.device) if at is not None else "cpu",
            "dtype": at.dtype if at is not None else "float32",
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "load_avg_at_start": os.getloadavg()}


def release_memory(at: Placement | None) -> None:
    """Give what this process's models held back (the cluster's processes need it)."""
    gc.collect()
    if at is not None and at.device.type == "cuda":
        import torch

        torch.cuda.empty_cache()


def _row(p: dict, system: str, method: str, temperature: float, out: dict) -> dict:
    return {"system": system, "method": method, "temperature": temperature,
            "prompt_id": p["id"], "category": p["category"], "grounded": p["grounded"], **out}


def run_peers(ctx: _Ctx) -> None:
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


def run_gateway(ctx: _Ctx, url: str) -> None:
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


def run_rounds(ctx: _Ctx, verifier: str, draft: str) -> None:
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


def run_concurrency(ctx: _Ctx, url: str, tokenizer) -> None:
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


def _concurrent(ctx: _Ctx, url: str, tokenizer, n: int, method: str) -> dict:
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


@contextlib.contextmanager
def _children_log_to(path: Path):
    """Point this process's stdout/stderr at `path` while the cluster's processes are
    spawned: they inherit the descriptors, so their logs land in the file instead of tearing
    up the progress bar, and ours come back afterwards."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)


def _phase(ctx: _Ctx, name: str, fn, *args) -> None:
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


def _costs(ctx: _Ctx, eagle: str, shape_methods: tuple[str, ...]) -> None:
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


def run_bench(cfg: BenchConfig, result: dict, out_dir: Path) -> dict:
    """Fills `result` as it goes, so a caller that catches an interruption still has every
    measurement made before it."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from tandem.models import resolve_model
    from tools.bench.client import worker_addresses
    from tools.bench.shapes import run_shapes
    from tools.launcher import Cluster, ClusterConfig, free_port

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
        ctx = _Ctx(cfg, prompts, ids, target, draft, bar, out_dir, result, at)
        if cfg.peers:
            _phase(ctx, "peers", run_peers)
        _costs(ctx, eagle, shape_methods)
        bar.set_description("starting the cluster")
        cluster = Cluster(ClusterConfig(num_drafts=1, num_verifiers=1, gateway_port=free_port(),
                                        model=cfg.model, draft_model=draft, eagle=eagle,
                                        threads=cfg.threads, device=cfg.device,
                                        dtype=cfg.dtype),
                          log=lambda m: None, env=dict(SUFFIX_CACHE_OFF))
        try:
            with _children_log_to(ctx.out_dir / "cluster.log"):
                cluster.start()
            workers = worker_addresses(cluster.redis_url)
            _phase(ctx, "gateway", run_gateway, cluster.gateway_url)
            if shape_methods:
                _phase(ctx, "shapes", run_shapes, cluster.gateway_url, shape_methods)
            _phase(ctx, "rounds", run_rounds, workers["verifier"][0], workers["draft"][0])
            _phase(ctx, "concurrency", run_concurrency, cluster.gateway_url, tok)
        finally:
            cluster.stop()
    result["meta"]["wall_s"] = round(time.perf_counter() - start, 1)
    result["meta"]["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return result
