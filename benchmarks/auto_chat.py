"""`auto` on chat, where copying pays least: plain against suffix, ngram and auto on six chat
prompts, through the gateway, with the verifier's Medusa heads on and off (auto may pick
them when the token history has nothing).

  python benchmarks/auto_chat.py [--reps 2] [--tokens 200] [--temperature 0]
                                 [--medusa on,off] [--out results/auto-chat.json]
  python benchmarks/auto_chat.py --arms none,eagle --eagle DIR --prompt-set heldout \
                                 --medusa off     # an EAGLE head on the held-out chat prompts

Each arm and rep is its own tenant (first asks only: no suffix cache holds the answer), arms
rotate prompt by prompt, non-streaming; greedy unless --temperature (then each ask is seeded,
the same seed for every arm). Speed is completion tokens over wall time,
against plain in the same cluster.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import httpx

from tools.launcher import Cluster, ClusterConfig, free_port

CHAT = ["Write three paragraphs about why the sky is blue.",
        "Give five tips for staying focused while studying, with two sentences each.",
        "Explain how a bicycle works to a ten year old.",
        "Write a short story about a robot who learns to paint.",
        "What are the pros and cons of working from home?",
        "Describe a walk through a forest in autumn."]
ARMS = ("none", "suffix", "ngram", "auto")


def ask(url: str, model: str, prompt: str, method: str, key: str, tokens: int,
        temperature: float = 0.0, seed: int = 0) -> dict:
    body = {"model": model, "max_tokens": tokens, "temperature": temperature, "seed": seed,
            "messages": [{"role": "user", "content": prompt}], "speculation": {"method": method}}
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600,
                   headers={"Authorization": f"Bearer {key}"})
    r.raise_for_status()
    out = r.json()
    return {"tokens": out["usage"]["completion_tokens"], "wall_s": time.perf_counter() - t0,
            "spec": out.get("speculation") or {}, "text": out["choices"][0]["message"]["content"]}


def prompt_set(name: str, n: int) -> list[str]:
    """CHAT, or the first n hand-written held-out chat prompts (never in any training set)."""
    if name == "chat":
        return CHAT[:n or None]
    from tools.distill.acceptance import load_prompts

    return load_prompts(None)[:n or None]


def run(medusa: bool, reps: int, tokens: int, temperature: float = 0.0, arms=ARMS,
        prompts=CHAT, eagle: str = "") -> dict:
    keys = [f"chat-{a}-{r}" for a in arms for r in range(reps)]
    env = {"TANDEM_API_KEYS": ",".join(keys), **({} if medusa else
                                                 {"TANDEM_VERIFIER_MEDUSA": "off"})}
    cluster = Cluster(ClusterConfig(gateway_port=free_port(), eagle=eagle), log=print,
                      env=env, output=subprocess.DEVNULL)
    cluster.start()
    rows, url = [], cluster.gateway_url
    try:
        auth = {"Authorization": f"Bearer {keys[0]}"}
        model = httpx.get(f"{url}/v1/models", headers=auth).json()["data"][0]["id"]
        ask(url, model, "Say hi.", "none", keys[0], 8)  # warm up
        for rep in range(reps):
            for i, prompt in enumerate(prompts):
                k = (i + rep) % len(arms)
                for arm in arms[k:] + arms[:k]:
                    res = ask(url, model, prompt, arm, f"chat-{arm}-{rep}", tokens,
                              temperature, seed=100 * rep + i)
                    rows.append({"rep": rep, "prompt": i, "arm": arm, **res})
                    print(f"medusa={medusa} rep {rep} prompt {i} {arm}: "
                          f"{res['tokens'] / res['wall_s']:.1f} tok/s", flush=True)
    finally:
        cluster.stop()
    rate = {a: sum(r["tokens"] for r in rows if r["arm"] == a)
            / sum(r["wall_s"] for r in rows if r["arm"] == a) for a in arms}
    plain = {(r["rep"], r["prompt"]): r["text"] for r in rows if r["arm"] == "none"}
    return {"plain_tok_s": rate["none"], "speedup": {a: rate[a] / rate["none"] for a in arms},
            "acceptance": _acceptance(rows, arms),
            "identical": all(r["text"] == plain[(r["rep"], r["prompt"])] for r in rows),
            "rows": rows}


def _acceptance(rows: list[dict], arms) -> dict:
    """Accepted over drafted tokens, and committed tokens per round, per speculating arm."""
    out = {}
    for a in arms:
        spec = [r["spec"] for r in rows if r["arm"] == a]
        proposed = sum(s.get("drafted_tokens", 0) for s in spec)
        rounds = sum(s.get("rounds", 0) for s in spec)
        if proposed:
            out[a] = {"acceptance": sum(s.get("accepted_tokens", 0) for s in spec) / proposed,
                      "tokens_per_round": sum(r["tokens"] for r in rows if r["arm"] == a)
                      / max(rounds, 1)}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=2, help="first asks per prompt and arm")
    ap.add_argument("--tokens", type=int, default=200, help="max new tokens per ask")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature of every ask (default 0: greedy)")
    ap.add_argument("--medusa", default="on,off",
                    help="the verifier's Medusa heads in the runs: on, off or on,off")
    ap.add_argument("--arms", default=",".join(ARMS),
                    help="speculation methods, plain (none) first [%(default)s]")
    ap.add_argument("--eagle", default="", help="EAGLE head directory (default: the shipped)")
    ap.add_argument("--prompt-set", choices=("chat", "heldout"), default="chat",
                    help="the six chat prompts above, or the held-out chat prompts")
    ap.add_argument("--num-prompts", type=int, default=0, help="the first N (0 = all)")
    ap.add_argument("--out", default="results/auto-chat.json")
    args = ap.parse_args(argv)
    arms = tuple(a.strip() for a in args.arms.split(","))
    if arms[0] != "none":
        ap.error("--arms must start with none (plain decoding, the baseline)")
    prompts = prompt_set(args.prompt_set, args.num_prompts)
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "reps": args.reps,
              "temperature": args.temperature}
    for medusa in [m.strip() == "on" for m in args.medusa.split(",")]:
        res = result[f"medusa_{'on' if medusa else 'off'}"] = run(
            medusa, args.reps, args.tokens, args.temperature, arms, prompts, args.eagle)
        singles = [v for a, v in res["speedup"].items() if a not in ("none", "auto")]
        vs_best = (f"; auto / best single {res['speedup']['auto'] / max(singles):.3f}"
                   if "auto" in arms and singles else "")
        print(f"medusa {'on' if medusa else 'off'}: " + ", ".join(
            f"{a} {v:.3f}x" for a, v in res["speedup"].items()) + vs_best
            + f"; acceptance {res['acceptance']}; text identical {res['identical']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
