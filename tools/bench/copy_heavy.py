"""Copy-heavy prompts through the gateway: plain decoding against ngram, suffix and auto.

  tandem bench --workload copy [--repeats 2] [--max-tokens 256] [--history verifier,worker]
                               [--temperatures 0] [--out results/bench-copy-DATE]
                               [--arms ngram,suffix,auto] [--first-reps 2]
                               [--model gemma3-270m] [--prompts 0,3,12]
                               [--docs docs/results]   # '' skips DOCS/benchmarks-copy.md
  python -m tools.bench.copy_heavy [--tokens 256] [--reps 2] ...   # the same, --docs '' default

One local cluster per `--history` place (the verifier's --history-drafts: ngram and suffix
drafted in the verifier's own step, or by the draft worker over the draft link). In each, every
prompt is asked once per arm (none, ngram, suffix, medusa, eagle, draft_model, auto, and
layer_skip when named in --arms; where the worker drafts, none, ngram and suffix), by category,
and two chat prompts beside them, the arms' order rotating prompt by prompt so drift hits all
alike; later reps ask none, suffix and auto again; greedy (or seeded sampling: the same text
whatever the method), non-streaming. Each arm is its own tenant (an API key each), so suffix
caches are the arm's own. Rep 0 is every prompt's first ask (the arm's cache holds only other
prompts' answers); later reps are repeats, where suffix and auto also draft from their own
earlier answer. Before its arms, each prompt is asked for one plain token, so every arm finds
its KV in the verifier's prefix cache (the arm asked first would otherwise pay the prefill the
others skip). Speed is completion tokens over the request's wall time; speedup is each arm's
total tokens/s over plain's in the same cluster. Copy share: the fraction of the plain answer's
12-character spans that occur in the prompt.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import httpx

from tools.bench.copy_prompts import PROMPTS
from tools.bench.copy_report import (
    ARMS,
    OPT_IN_ARMS,
    REPEAT_ARMS,
    WORKER_ARMS,
    markdown,
    summarise,
    write_docs,
)
from tools.launcher import Cluster, ClusterConfig, free_port


def key_of(arm: str, first_pass: int = 0) -> str:
    """Each arm asks with its own API key, so it is its own tenant: the verifier's suffix
    caches are per tenant, and no arm drafts from another arm's answer to the same prompt."""
    return f"bench-{arm}" + (f"-{first_pass}" if first_pass else "")


def served_model(url: str) -> str:
    """The name the cluster's gateway serves (what "model" must say)."""
    r = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key_of('none')}"})
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def ask(url: str, prompt: str, method: str, tokens: int, temperature: float = 0.0,
        first_pass: int = 0, model: str = "SmolLM2-135M-Instruct") -> dict:
    body = {"model": model, "max_tokens": tokens, "temperature": temperature,
            "seed": 7, "messages": [{"role": "user", "content": prompt}],
            "speculation": {"method": method}}
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600,
                   headers={"Authorization": f"Bearer {key_of(method, first_pass)}"})
    wall = time.perf_counter() - t0
    r.raise_for_status()
    out = r.json()
    return {"text": out["choices"][0]["message"]["content"], "wall_s": wall,
            "tokens": out["usage"]["completion_tokens"], "spec": out.get("speculation") or {}}


def run_place(place: str, reps: int, tokens: int, temperature: float,
              only: tuple[str, ...] = (), model: str = "", first_reps: int = 1,
              picks: tuple[int, ...] = ()) -> dict:
    # The worker-drafting cluster is there for ngram and suffix only: auto and the model
    # methods draft the same way in both clusters.
    arms = ARMS if place == "verifier" else WORKER_ARMS
    arms = tuple(a for a in arms if a == "none" or (a in only if only else a not in OPT_IN_ARMS))
    cluster = Cluster(ClusterConfig(gateway_port=free_port(), model=model), log=print,
                      env={"TANDEM_VERIFIER_HISTORY_DRAFTS": place,
                           "TANDEM_API_KEYS": ",".join(key_of(a, j) for a in ARMS
                                                       for j in range(first_reps))},
                      output=subprocess.DEVNULL)
    cluster.start()
    rows = []
    try:
        name = served_model(cluster.gateway_url)
        ask(cluster.gateway_url, "Say hi.", "none", 8, model=name)  # warm up
        # First asks `first_reps` times over, each pass as fresh tenants (no answer to the
        # same prompt in any cache), then the repeats as the first pass's tenants.
        for rep, first_pass in [(0, j) for j in range(first_reps)] + [
                (r, 0) for r in range(1, reps)]:
            # Repeats only where a cache can help (and plain, their baseline).
            asked = arms if rep == 0 else [a for a in arms if a in REPEAT_ARMS]
            for i, prompt in enumerate(PROMPTS):
                if picks and i not in picks:  # --prompts: a subset
                    continue
                k = (i + rep + first_pass) % len(asked)
                # The prompt's KV into the verifier's prefix cache first (one plain token):
                # otherwise the arm asked first pays the prefill that every later arm skips.
                ask(cluster.gateway_url, prompt, "none", 1, temperature, first_pass, name)
                for arm in asked[k:] + asked[:k]:
                    res = ask(cluster.gateway_url, prompt, arm, tokens, temperature, first_pass,
                              name)
                    rows.append({"rep": rep, "pass": first_pass, "prompt": i, "arm": arm,
                                 **res})
                    print(f"[{place}] rep {rep} prompt {i} {arm}: {res['tokens']} tokens "
                          f"{res['tokens'] / res['wall_s']:.1f} tok/s "
                          f"accepted {res['spec'].get('acceptance_rate')}", flush=True)
    finally:
        cluster.stop()
    return {"rows": rows, "first": summarise([r for r in rows if r["rep"] == 0]),
            "repeat": summarise([r for r in rows if r["rep"] > 0]), **summarise(rows)}


def verify_curve(counts=(1, 2, 3, 4, 6, 8, 12, 16, 17), model: str = "") -> dict[int, float]:
    """ms of one target forward over q new tokens, as the cluster's verifier runs it (the
    target under --dtype auto, 1 torch thread): the cost side of Leviathan's bound."""
    import torch

    from tandem.device import place
    from tandem.engine.exact_dtype import load_target
    from tandem.engine.model_runner import ModelRunner
    from tandem.models import resolve_model
    from verify_service.policy.calibration import calibrate

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target = load_target(resolve_model(model or "default"), place("cpu", "auto"))
        return calibrate(ModelRunner.with_memory(target, 64 << 20, 16), counts, reps=5)
    finally:
        torch.set_num_threads(threads)


def run_workload(tokens: int = 256, reps: int = 2, places=("verifier", "worker"),
                 temperature: float = 0.0, out: Path = Path("results/copy_heavy.json"),
                 docs: Path | None = None, arms: tuple[str, ...] = (), model: str = "",
                 first_reps: int = 1, picks: tuple[int, ...] = ()) -> dict:
    """One cluster per place, every prompt and arm; table printed, JSON (and docs) written."""
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "tokens": tokens, "reps": reps,
              "temperature": temperature, "model": model or "default", "first_reps": first_reps,
              "prompts": list(picks),
              "verify_ms": verify_curve(model=model), "places": {}}
    for place in places:
        result["places"][place] = run_place(place, reps, tokens, temperature, arms, model,
                                            first_reps, picks)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))  # first: the table must not lose the run
    table = markdown(result)
    print(table)
    print(f"wrote {out}")
    if docs is not None:
        write_docs(result, table, docs)
    return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=256, help="max new tokens per request")
    ap.add_argument("--reps", type=int, default=2, help="asks per prompt and arm")
    ap.add_argument("--history", default="verifier,worker",
                    help="where ngram/suffix draft, one cluster each (verifier, worker)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; else seeded")
    ap.add_argument("--out", default="results/copy_heavy.json")
    ap.add_argument("--docs", default="", help="also write DOCS/benchmarks-copy.md and a plot")
    ap.add_argument("--arms", default="", help="only these methods beside plain, comma "
                    "separated (default: all of " +
                    ", ".join(a for a in ARMS[1:] if a not in OPT_IN_ARMS) + "; " +
                    ", ".join(OPT_IN_ARMS) + " only when named)")
    ap.add_argument("--model", default="", help="target (default: the default target)")
    ap.add_argument("--first-reps", type=int, default=1, help="independent first asks per "
                    "prompt and arm, each pass as fresh tenants (default 1)")
    ap.add_argument("--prompts", default="", help="only these prompts, comma-separated indices "
                    f"into the {len(PROMPTS)} (default: all)")
    args = ap.parse_args(argv)
    run_workload(args.tokens, args.reps, tuple(args.history.split(",")), args.temperature,
                 Path(args.out), Path(args.docs) if args.docs else None,
                 tuple(a for a in args.arms.split(",") if a), args.model, args.first_reps,
                 tuple(int(i) for i in args.prompts.split(",") if i))


def rerender(path: str, docs: str) -> None:
    """The table, page and plot again from a saved run (`--report`)."""
    result = json.loads(Path(path).read_text())
    write_docs(result, markdown(result), Path(docs))


if __name__ == "__main__":
    main()
