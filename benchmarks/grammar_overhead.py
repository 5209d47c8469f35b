"""What a grammar costs plain decoding, through the gateway: the same prompt decoded free and
under a JSON schema whose one field is a long string, both cut at the same max_tokens, so
the two arms decode the same number of tokens at the same context lengths.

  python -m benchmarks.grammar_overhead [--tokens 128] [--reps 6] [--temperatures 0,0.7]
                                         [--out results/grammar-overhead.json]

Arms alternate (free, constrained, constrained, free, ...) so drift on a shared host hits
both alike. Speed is decode tokens/s (tokens after the first over first-to-last time), plain
decoding (speculation.method none); each ask is its own tenant.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import httpx

from benchmarks.structured import ask
from tools.launcher import Cluster, ClusterConfig, free_port

PROMPT = ("Write a long story about a lighthouse keeper and a storm, as JSON with one field, "
          "story.")
SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 2000}},
          "required": ["story"], "additionalProperties": False}


def run(tokens: int, reps: int, temperatures: list[float]) -> list[dict]:
    keys = [f"overhead-{i}" for i in range(2 * reps * len(temperatures) + 1)]
    cluster = Cluster(ClusterConfig(gateway_port=free_port()), log=print,
                      env={"TANDEM_API_KEYS": ",".join(keys)}, output=subprocess.DEVNULL)
    cluster.start()
    rows, url, n = [], cluster.gateway_url, 0
    try:
        auth = {"Authorization": f"Bearer {keys[0]}"}
        model = httpx.get(f"{url}/v1/models", headers=auth).json()["data"][0]["id"]
        ask(url, model, PROMPT, SCHEMA, "none", 8, keys[0])  # warm up, compiles the grammar
        for t in temperatures:
            for rep in range(reps):
                order = ("free", "json") if rep % 2 == 0 else ("json", "free")
                for mode in order:
                    n += 1
                    res = ask(url, model, PROMPT, SCHEMA if mode == "json" else None, "none",
                              tokens, keys[n], mode, {"temperature": t, "seed": rep})
                    rate = (res["tokens"] - 1) / max(res["decode_s"], 1e-9)
                    rows.append({"temperature": t, "rep": rep, "mode": mode,
                                 "tokens": res["tokens"], "decode_tok_s": rate})
                    print(f"T={t} rep {rep} {mode}: {res['tokens']} tok, {rate:.1f} tok/s",
                          flush=True)
    finally:
        cluster.stop()
    return rows


def summarise(rows: list[dict], temperatures: list[float]) -> dict:
    out = {}
    for t in temperatures:
        rate = {m: statistics.median(r["decode_tok_s"] for r in rows
                                     if r["temperature"] == t and r["mode"] == m)
                for m in ("free", "json")}
        lengths = {m: statistics.mean(r["tokens"] for r in rows
                                      if r["temperature"] == t and r["mode"] == m)
                   for m in ("free", "json")}
        out[str(t)] = {"free_tok_s": rate["free"], "json_tok_s": rate["json"],
                       "ratio": rate["json"] / rate["free"], "mean_tokens": lengths}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128, help="max new tokens per ask")
    ap.add_argument("--reps", type=int, default=6, help="asks per arm and temperature")
    ap.add_argument("--temperatures", default="0,0.7", help="comma separated")
    ap.add_argument("--out", default="results/grammar-overhead.json")
    args = ap.parse_args(argv)
    temps = [float(t) for t in args.temperatures.split(",")]
    rows = run(args.tokens, args.reps, temps)
    summary = summarise(rows, temps)
    for t, s in summary.items():
        print(f"T={t}: free {s['free_tok_s']:.1f} tok/s, json {s['json_tok_s']:.1f} tok/s, "
              f"constrained / free = {s['ratio']:.3f} (tokens {s['mean_tokens']})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "summary": summary,
                               "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
