"""A short load A/B through the gateway: every method against plain at each concurrency, and
plain of this tree against plain of another checkout (`--base`), interleaved within one run.

  python -m tools.bench.load_ab --levels 1,4,16,32 --methods none,ngram,suffix,draft_model,auto
  python -m tools.bench.load_ab --levels 16 --methods none --base /tmp/base --reps 3

Each (level, rep) runs every arm once, in an order that turns per rep (arm_order);
an arm's figure is its tokens over its wall time summed over the reps; ratios are to plain
(`none`) of this tree at the same level. Before a rep's arms, one untimed plain ask of one
token per session puts the rep's prompts in each verifier's prefix cache, so that every arm
finds them there (`--cold`: not; then the rep's first arm alone prefilled them, 0.5-1.5 s at
4 sessions, and with fewer reps than arms some arms never went first). Greedy (`--temperature`:
sampled, seeded per session), `ignore_eos` (`--natural`: answers end at EOS),
the suffix caches off (every ask a first ask), one verifier and one draft worker, as `tandem
up` starts them. A `--base` checkout is started by its own `tandem up` (its own flags and
defaults); `--base .` with `--base-env` runs this tree twice, under two settings.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tools.bench.client import chat_body, stream_chat
from tools.bench.config import SUFFIX_CACHE_OFF, load_prompts
from tools.bench.host import children_log_to
from tools.bench.proc_cpu import by_role
from tools.launcher import STARTUP_TIMEOUT_S, Cluster, ClusterConfig, free_port


class OwnLaunch:
    """A cluster of the checkout at `root`, started by that checkout's own `tandem up` (its
    launcher, flags and defaults: an older checkout knows none of this tree's new flags)."""

    def __init__(self, root: Path, dtype: str, log: Path, env: dict):
        port = free_port()
        self.gateway_url = f"http://127.0.0.1:{port}"
        run_env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(root), **env)
        self.output = open(log, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tools.cli", "up", "--port", str(port), "--dtype", dtype],
            env=run_env, cwd=root, start_new_session=True, stdout=self.output,
            stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S * 2
        while "Tandem is up" not in log.read_text():  # every process healthy, not the gateway
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the cluster of {root} did not come up (see {log})")
            time.sleep(1.0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # `tandem up` drains and stops its children
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.output.close()


def start(root: Path, dtype: str, log: Path, env: dict | None = None):
    """This tree's cluster (its launcher, in process), or another checkout's (OwnLaunch)."""
    env = {**SUFFIX_CACHE_OFF, **(env or {})}
    if root.resolve() != Path.cwd().resolve():
        return OwnLaunch(root, dtype, log, env)
    cluster = Cluster(ClusterConfig(num_drafts=1, num_verifiers=1, gateway_port=free_port(),
                                    dtype=dtype), log=lambda m: None, env=env)
    with children_log_to(log):
        cluster.start()
    return cluster


def bodies(prompts: list[dict], n: int, method: str, tokens: int, offset: int,
           temperature: float = 0.0, natural: bool = False) -> list[dict]:
    """The n sessions' requests. `natural`: answers end at EOS (else exactly `tokens` each);
    sampled ones are seeded per session, so every arm draws the same answers."""
    return [chat_body(prompts[(offset + i) % len(prompts)]["prompt"], tokens, temperature,
                      method, 16, seed=offset + i if temperature else None,
                      ignore_eos=not natural) for i in range(n)]


def one(url: str, prompts: list[dict], n: int, method: str, tokens: int, offset: int,
        temperature: float = 0.0, natural: bool = False) -> dict:
    """n sessions at once (bodies): their tokens, the wall time, and their rounds and drafts."""
    requests = bodies(prompts, n, method, tokens, offset, temperature, natural)

    async def go():
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=n + 4)) as client:
            t0 = time.perf_counter()
            outs = await asyncio.gather(*(stream_chat(client, url, b) for b in requests))
            return outs, time.perf_counter() - t0

    outs, wall = asyncio.run(go())
    spec = [o["speculation"] for o in outs]
    return {"tokens": sum(o["tokens"] for o in outs), "wall_s": round(wall, 3),
            **{k: sum(s.get(k, 0) for s in spec)
               for k in ("rounds", "drafted_tokens", "accepted_tokens")}}


def arm_order(arms: list, rep: int) -> list:
    """The rep's order of the arms: a rotation (each arm goes first as often as the others)
    whose direction also turns every other rep, so that no arm always follows the same one
    (a cyclic rotation alone keeps each arm's predecessor, and what an arm leaves behind,
    a draft worker still busy or a learnt step curve, then always lands on the same next arm)."""
    shift = rep % len(arms)
    order = arms[shift:] + arms[:shift]
    return order if (rep // len(arms)) % 2 == 0 else [order[0], *reversed(order[1:])]


def unbalanced(reps: int, arms: int) -> str:
    """Why `reps` reps leave arm_order's order unbalanced ("" if they do not): each arm is
    first equally often only over a multiple of the arms, and follows both its neighbours
    only once the direction has turned (a multiple of twice the arms). A 6-rep run of 6 arms
    kept every arm's predecessor, the bias docs/results/load-order-2026-11-29.md measured."""
    if arms < 2 or reps % (2 * arms) == 0:
        return ""
    return (f"{reps} reps of {arms} arms: each arm does not go first equally often and follow "
            f"both neighbours equally; use a multiple of {2 * arms} reps")


def roots_of(cluster) -> list[int]:
    """The pids a cluster's processes hang under: our children, or its `tandem up`'s."""
    if isinstance(cluster, OwnLaunch):
        return [cluster.proc.pid]
    return [p.pid for _, p in cluster.procs] + ([cluster.redis.pid] if cluster.redis else [])


def run(args, clusters: dict) -> list[dict]:
    prompts, rows = load_prompts(), []
    arms = [("new", m) for m in args.methods] + [("base", m) for m in args.base_methods
                                                 if "base" in clusters]
    for n in args.levels:
        for rep in range(args.reps):
            if not args.cold:  # the rep's prompts in each verifier's prefix cache, untimed:
                for c in clusters.values():  # else the first arm alone prefills them cold
                    one(c.gateway_url, prompts, n, "none", 1, rep * n)
            for name, method in arm_order(arms, rep):
                before = by_role(roots_of(clusters[name])) if args.cpu else {}
                try:
                    r = one(clusters[name].gateway_url, prompts, n, method, args.tokens, rep * n,
                            args.temperature, args.natural)
                except Exception as exc:  # recorded; the other cells still run
                    r = {"error": repr(exc)[:300]}
                if args.cpu:  # CPU seconds of each role over the arm
                    after = by_role(roots_of(clusters[name]))
                    r["cpu_s"] = {k: round(v - before.get(k, 0.0), 3) for k, v in after.items()}
                rows.append({"tree": name, "level": n, "rep": rep, "method": method, **r})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def summary(rows: list[dict]) -> dict:
    """tok/s per (tree, level, method) over the reps, and the ratio to this tree's plain (and
    for the base's arms, to the base's own plain when it ran)."""
    tps: dict[tuple, float] = {}
    cpu: dict[tuple, dict[str, float]] = {}  # --cpu: each role's CPU seconds over the reps
    for key in {(r["tree"], r["level"], r["method"]) for r in rows}:
        mine = [r for r in rows if (r["tree"], r["level"], r["method"]) == key
                and "error" not in r]
        if not mine:
            continue
        tps[key] = sum(r["tokens"] for r in mine) / sum(r["wall_s"] for r in mine)
        for r in mine:
            for k, v in r.get("cpu_s", {}).items():
                sums = cpu.setdefault(key, {})
                sums[k] = sums.get(k, 0.0) + v
    out = {}
    for key, v in sorted(tps.items()):
        tree, level, method = key
        plain = tps.get(("new", level, "none"))
        own = tps.get((tree, level, "none"))
        out[f"{tree} x{level} {method}"] = {"tok_s": round(v, 1),
                                            "vs_plain": round(v / plain, 3) if plain else None,
                                            **({"vs_own_plain": round(v / own, 3)}
                                               if tree == "base" and own else {}),
                                            **({"cpu_s": {k: round(x, 2) for k, x in
                                                          cpu[key].items()}}
                                               if key in cpu else {})}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--levels", default="1,4,16,32")
    p.add_argument("--methods", default="none,ngram,suffix,draft_model,auto")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (seeded per session: every arm draws alike)")
    p.add_argument("--natural", action="store_true",
                   help="answers end at EOS, --tokens at most (default: exactly --tokens)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--base", default="", help="another checkout whose plain runs beside ours")
    p.add_argument("--base-methods", default="none", help="the base's arms (comma-separated)")
    p.add_argument("--base-dtype", default="",
                   help="the base's --dtype (default --dtype's); with --base . this compares "
                        "two dtypes of one checkout")
    p.add_argument("--base-env", default="",
                   help="KEY=VALUE,... for the base's processes; with --base . this compares "
                        "two settings of one checkout (e.g. TANDEM_VERIFIER_WIDE_ROWS=1000)")
    p.add_argument("--cold", action="store_true",
                   help="no untimed pass over each rep's prompts first (the first arm of a rep "
                        "then prefills them cold, the arms after it find them cached)")
    p.add_argument("--cpu", action="store_true",
                   help="record each arm's CPU seconds per process role (verifier, draft, "
                        "gateway, redis, client) from /proc")
    p.add_argument("--out", default="results/load_ab.json")
    args = p.parse_args()
    args.levels = [int(x) for x in args.levels.split(",")]
    args.methods = args.methods.split(",")
    args.base_methods = args.base_methods.split(",")
    base_env = [kv for kv in args.base_env.split(",") if kv]
    if any("=" not in kv for kv in base_env):
        p.error(f"--base-env takes KEY=VALUE,...; got {args.base_env!r}")
    arms = len(args.methods) + (len(args.base_methods) if args.base else 0)
    if order_warning := unbalanced(args.reps, arms):  # kept with the result too
        print(f"load_ab: warning: {order_warning}", file=sys.stderr, flush=True)
    out = Path(args.out)
    roots = {"new": Path.cwd(), **({"base": Path(args.base)} if args.base else {})}
    clusters: dict = {}
    try:
        for name, root in roots.items():
            dtype = args.base_dtype if name == "base" and args.base_dtype else args.dtype
            env = dict(kv.split("=", 1) for kv in base_env) if name == "base" else {}
            clusters[name] = start(root, dtype, out.with_suffix(f".{name}.log"), env)
        start_s = time.time()
        rows = run(args, clusters)
        result = {"args": vars(args), "wall_s": round(time.time() - start_s),
                  **({"order_warning": order_warning} if order_warning else {}),
                  "summary": summary(rows), "rows": rows}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print(json.dumps(result["summary"], indent=1))
    finally:
        for c in clusters.values():
            c.stop()


if __name__ == "__main__":
    main()
