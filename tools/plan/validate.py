"""`tandem plan validate`: start the local cluster (`tandem up`'s), drive it at several loads
with several methods, record every round (the SSE `speculation_round` events), then simulate
the same setups with the acceptance those rounds measured and compare, cell by cell.

Run it alone on the host (other benchmarks skew both sides):
  flock /tmp/tandem-bench.lock tandem plan validate --out docs/results/plan-validate-DATE
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

from tools.bench.sse import CHAT_PATH, achunks, choice_text

PROMPTS = Path(__file__).resolve().parents[1] / "bench" / "prompts.jsonl"
MODEL = "SmolLM2-135M-Instruct"


def _csv(kind):
    return lambda text: tuple(kind(x) for x in text.split(",") if x.strip())


def add_validate_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--methods", type=_csv(str), default=("none", "ngram", "suffix",
                                                         "draft_model"))
    p.add_argument("--concurrency", type=_csv(int), default=(1, 4, 16),
                   help="closed-loop loads (comma-separated)")
    p.add_argument("--rate", type=float, default=1.0,
                   help="a Poisson load, requests/s (0: none)")
    p.add_argument("--requests", type=int, default=12, help="requests per cell")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--profile", default="calibrate",
                   help="the simulation's cost profile; 'calibrate' (default): measure this "
                        "host now, before starting the cluster (out/profile.json)")
    p.add_argument("--port", type=int, default=8127, help="the cluster's gateway port")
    p.add_argument("--url", default="", help="an already running gateway (no start/stop)")
    p.add_argument("--out", default="plan-validate", help="directory for the results")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cell-speed", action="store_true",
                   help="scale each cell's device costs by how much slower the verifier's plain "
                        "forwards ran there than in the none cell of the same load (host drift)")
    p.add_argument("--from-measured", action="store_true",
                   help="no cluster: compare out/measured.json and out/rounds.jsonl again")


def _prompts() -> list[dict]:
    return [json.loads(x) for x in PROMPTS.read_text().splitlines() if x.strip()]


async def _one(client: httpx.AsyncClient, url: str, prompt: dict, method: str,
               max_tokens: int) -> dict:
    """One streamed request: its times (s, perf_counter), tokens and recorded rounds."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt["prompt"]}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
            "speculation": {"method": method, "events": True}}
    start, first, last, usage, rounds = time.perf_counter(), None, None, {}, []
    async with client.stream("POST", url + CHAT_PATH, json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"gateway answered {r.status_code}: {(await r.aread())[:300]}")
        async for obj in achunks(r.aiter_lines()):
            if "speculation_round" in obj:
                ev = obj["speculation_round"]
                rounds.append({"method": method, "workload": prompt["category"],
                               "round": ev.get("round", 0),
                               "drafted": ev["drafted"], "accepted": ev["accepted"],
                               "verify_ms": ev.get("verify_ms", 0.0),
                               "rejection_ms": ev.get("rejection_ms", 0.0),
                               "draft_wait_ms": ev.get("draft_wait_ms", 0.0),
                               "at": time.perf_counter()})
            if "".join(choice_text(c) for c in obj.get("choices", [])):
                now = time.perf_counter()
                first = first or now
                last = now
            if obj.get("usage"):
                usage = obj["usage"]
    n = usage.get("completion_tokens", 0)
    return {"start": start, "first": first or start, "last": last or start, "tokens": n,
            "prompt_tokens": usage.get("prompt_tokens", 0), "rounds": rounds}


async def _cell(url: str, method: str, concurrency: int, arrivals: list[float] | None,
                n: int, max_tokens: int, prompts: list[dict]) -> list[dict]:
    """n requests closed-loop at `concurrency`, or at the given arrival times (s)."""
    todo = list(enumerate(prompts[i % len(prompts)] for i in range(n)))
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=n + 4)) as client:
        if arrivals is not None:
            t0 = time.perf_counter()

            async def timed(i, p):
                await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
                return await _one(client, url, p, method, max_tokens)
            return list(await asyncio.gather(*(timed(i, p) for i, p in todo)))
        queue, out = list(todo), []

        async def worker():
            while queue:
                _, p = queue.pop(0)
                out.append(await _one(client, url, p, method, max_tokens))
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return out


def measured(runs: list[dict]) -> dict:
    from tools.bench.stats import percentile
    start = min(r["start"] for r in runs)
    end = max(r["last"] for r in runs)
    ttft = [(r["first"] - r["start"]) * 1e3 for r in runs]
    tpot = [(r["last"] - r["first"]) * 1e3 / (r["tokens"] - 1) for r in runs if r["tokens"] > 1]
    return {"throughput_tok_s": sum(r["tokens"] for r in runs) / max(end - start, 1e-9),
            "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p99": percentile(ttft, 99),
            "tpot_ms_p50": percentile(tpot, 50), "tpot_ms_p99": percentile(tpot, 99),
            "prompt_tokens_mean": statistics.mean(r["prompt_tokens"] for r in runs),
            "requests": len(runs)}


def _beyond(runs: list[dict]) -> tuple[list[float], list[float]]:
    """Per request: ms of its first token beyond its first round's forward and rejection, and
    of a later token beyond its round's (the median round after the first)."""
    first, gap = [], []
    for r in runs:
        rs = r["rounds"]
        if not rs or r["tokens"] < 2:
            continue
        first.append((r["first"] - r["start"]) * 1e3 - rs[0]["verify_ms"] - rs[0]["rejection_ms"])
        later = statistics.median(x["verify_ms"] + x["rejection_ms"] for x in rs[1:] or rs)
        gap.append((r["last"] - r["first"]) * 1e3 / (r["tokens"] - 1) - later)
    return first, gap


def overheads(runs: list[dict], fresh: list[dict] | None = None) -> dict:
    """Median ms of a first token beyond its round's forward and rejection (gateway_ms), and of
    a later token beyond its round's (step_gap_ms), over single-session requests: `fresh`'s,
    each sent on a new connection, when given. `runs` went back to back on one kept-alive
    connection, as a closed-loop client sends them: their first token's extra time beyond
    fresh's is reuse_hold_ms (2026-11-28b: ~40 ms more, for the first bytes only, until the
    gateway's sockets got TCP_NODELAY; since, a few ms less: no connect; the tokens
    made meanwhile arrive with them, so such a request's TPOT is that much shorter, and the
    step gap is taken from the fresh requests)."""
    first, gap = _beyond(fresh or runs)
    out = {"gateway_ms": _med(first), "step_gap_ms": _med(gap), "requests": len(first)}
    if fresh is not None:
        reused, _ = _beyond(runs)
        # negative where a kept-alive connection is quicker than a new one (no connect);
        # never below -gateway_ms, since _med is never below 0
        out["reuse_hold_ms"] = _med(reused) - out["gateway_ms"] if reused and first else None
    return out


def _med(xs: list[float]) -> float | None:
    return max(0.0, statistics.median(xs)) if xs else None


async def _fresh(url: str, prompts: list[dict], max_tokens: int) -> list[dict]:
    """Every prompt once at one session, each on a new connection (a new client)."""
    out = []
    for p in prompts:
        async with httpx.AsyncClient() as client:
            out.append(await _one(client, url, p, "none", max_tokens))
    return out


def loads(args) -> list[tuple[str, int, float]]:
    out = [(f"c={c}", c, 0.0) for c in args.concurrency]
    return out + ([(f"rate={args.rate:g}/s", 0, args.rate)] if args.rate else [])


def _warm_passes(url: str, out: Path, prompts: list[dict]) -> None:
    """Before the cells: every prompt once, cold (their prefills time the prefill curve at
    their length; from then on every cell finds them in the prefix cache, as the simulation
    is told); then twice more, warm: what a request costs beyond the verifier's forwards (the
    gateway, Redis, gRPC, the engine loop): the simulation's gateway_ms and per-step overhead,
    each request on a new connection; and back to back on one, as the closed-loop cells send."""
    warm = asyncio.run(_cell(url, "none", 1, None, len(prompts), 2, prompts))
    with open(out / "prefill.jsonl", "w") as f:
        for i, r in enumerate(warm):
            first = r["rounds"][0] if r["rounds"] else {}
            f.write(json.dumps({"prompt": i, "prompt_tokens": r["prompt_tokens"],
                                "verify_ms": first.get("verify_ms", 0.0)}) + "\n")
    again = asyncio.run(_cell(url, "none", 1, None, len(prompts), 8, prompts))
    fresh = asyncio.run(_fresh(url, prompts, 16))
    (out / "overhead.json").write_text(json.dumps(overheads(again, fresh), indent=1) + "\n")


def _record(runs: list[dict], method: str, load: str, rounds, requests) -> None:
    """A cell's requests (requests.jsonl) and rounds (rounds.jsonl); times in s since the
    cell's first request ("at": when the client got the round's event)."""
    t0 = min(r["start"] for r in runs)
    for r in runs:
        requests.write(json.dumps({
            "method": method, "load": load, "start": round(r["start"] - t0, 4),
            "first": round(r["first"] - t0, 4), "last": round(r["last"] - t0, 4),
            "tokens": r["tokens"], "prompt_tokens": r["prompt_tokens"]}) + "\n")
        for ev in r.pop("rounds"):
            rounds.write(json.dumps({**ev, "load": load, "at": round(ev["at"] - t0, 4)}) + "\n")


def drive(args, url: str, out: Path) -> dict:
    """Every (method, load) cell against the running cluster; the rounds to rounds.jsonl."""
    from tqdm import tqdm

    from tools.plan.config import SimConfig
    from tools.plan.sim import make_requests

    prompts, cells = _prompts(), {}
    _warm_passes(url, out, prompts)
    todo = [(m, ld) for m in args.methods for ld in loads(args)]
    bar = tqdm(todo, desc="validate", file=sys.stderr)
    with open(out / "rounds.jsonl", "w") as rounds, open(out / "requests.jsonl", "w") as requests, \
            bar:
        for method, (name, c, rate) in bar:
            bar.set_postfix_str(f"{method} {name}")
            arrivals = None
            if rate:
                cfg = SimConfig(method=method, rate=rate, requests=args.requests, seed=args.seed,
                                drafts=1)
                reqs = make_requests(cfg, random.Random(args.seed))
                arrivals = [r.arrival_ms / 1e3 for r in reqs]
            runs = asyncio.run(_cell(url, method, c, arrivals, args.requests, args.max_tokens,
                                     prompts))
            _record(runs, method, name, rounds, requests)
            cells[f"{method}|{name}"] = measured(runs)
    return cells


def run_validation(args) -> int:
    from tools.plan.report import compare, write_report

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.from_measured:
        if args.profile == "calibrate":
            args.profile = str(out / "profile.json")
        cells = json.loads((out / "measured.json").read_text())
        write_report(args, compare(args, cells, out), out)
        return 0
    if args.profile == "calibrate":
        from tools.plan.calibrate import calibrate_host
        from tools.plan.profile import save_profile
        print("calibrating this host ...", file=sys.stderr, flush=True)
        save_profile(calibrate_host(reps=3), out / "profile.json")
        args.profile = str(out / "profile.json")
    if args.url:
        cells = drive(args, args.url, out)
    else:
        from tools.launcher import Cluster, ClusterConfig
        cluster = Cluster(ClusterConfig(gateway_port=args.port),
                          log=lambda m: print(m, file=sys.stderr, flush=True))
        try:
            cluster.start()
            cells = drive(args, cluster.gateway_url, out)
        finally:
            cluster.stop()
    (out / "measured.json").write_text(json.dumps(cells, indent=1) + "\n")
    rows = compare(args, cells, out)
    write_report(args, rows, out)
    return 0
