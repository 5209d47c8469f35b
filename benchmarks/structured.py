"""Structured output through the gateway: constrained against free decoding, plain against
speculation, the same prompts in the same cluster.

  python benchmarks/structured.py [--tokens 96] [--reps 2] [--arms ngram,suffix,auto]
                                  [--modes free,json,tools] [--temperature 0.7]
                                  [--no-forced-off] [--out results/structured.json]

Each prompt asks for a JSON object; it is asked free (no response_format) and constrained
(response_format json_schema, strict) by every method, the arms' order rotating prompt by
prompt. A second cluster runs with the verifier's forced drafts off (--forced-drafts off),
so what the grammar's forced tokens add as free drafts shows beside the rest. Greedy,
streamed; speed is completion tokens over wall time, and decode speed the tokens after
the first over the time from first to last (what the grammar and the drafts change, without
the prompt's prefill). Each arm and rep is its own tenant, so suffix decoding never drafts
from another arm's answer to the same prompt. Every constrained answer is validated against
its schema (jsonschema). Mode "tools" asks for the same object as a required tool call
(the schema as the function's parameters), streamed as argument deltas. At a temperature
above 0 every arm samples with the same seed per prompt and rep (text equality is then not
expected: drafts change how the noise is used, not the distribution).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import httpx
import jsonschema

from tools.bench.sse import chat_stream, choice_text
from tools.launcher import Cluster, ClusterConfig, free_port


def _obj(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


STR, INT = {"type": "string", "maxLength": 40}, {"type": "integer", "minimum": 0}
PROMPTS = [
    ("Describe a fictional person as JSON with name, age, city and job.",
     _obj({"name": STR, "age": INT, "city": STR, "job": STR})),
    ("Give a product listing as JSON: title, price in cents, stock count, category, "
     "and three tags.", _obj({"title": STR, "price_cents": INT, "stock": INT, "category": STR,
                             "tags": {"type": "array", "items": STR, "maxItems": 3}})),
    ("Return a calendar event as JSON with title, day, start hour, end hour and location.",
     _obj({"title": STR, "day": {"enum": ["Mon", "Tue", "Wed", "Thu", "Fri"]}, "start": INT,
           "end": INT, "location": STR})),
    ("Write a short recipe as JSON: name, servings, minutes, and a list of ingredients.",
     _obj({"name": STR, "servings": INT, "minutes": INT,
           "ingredients": {"type": "array", "items": STR, "maxItems": 5}})),
    ("Report the weather of three cities as JSON: a list of objects with city, celsius and "
     "sky.", _obj({"reports": {"type": "array", "maxItems": 3, "items": _obj(
         {"city": STR, "celsius": INT, "sky": {"enum": ["sunny", "cloudy", "rain"]}})}})),
    ("Describe a book as JSON with title, author, year, pages and genre.",
     _obj({"title": STR, "author": STR, "year": INT, "pages": INT, "genre": STR})),
]


def key_of(mode: str, method: str, rep: int) -> str:
    """Each arm and rep asks as its own tenant (an API key each): the verifier's suffix
    caches are per tenant, so no ask drafts from another arm's answer to the same prompt."""
    return f"bench-{mode}-{method}-{rep}"


def _constraint(mode: str, schema: dict) -> dict:
    if mode == "json":
        return {"response_format": {"type": "json_schema", "json_schema": {
            "name": "answer", "schema": schema, "strict": True}}}
    if mode == "tools":
        return {"tools": [{"type": "function", "function": {"name": "answer",
                                                            "parameters": schema}}],
                "tool_choice": "required", "parallel_tool_calls": False}
    return {}


def ask(url: str, model: str, prompt: str, schema: dict | None, method: str,
        tokens: int, key: str = "", mode: str = "json", sampling: dict | None = None) -> dict:
    """One streamed request: the text, its tokens, wall time and decode time (first token
    to last: what the grammar and the drafts change, without the prompt's prefill)."""
    body = {"model": model, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": prompt}],
            "speculation": {"method": method}, **(sampling or {})}
    if schema is not None:
        body |= _constraint(mode, schema)
    parts, first, last, finish, usage, spec = [], None, None, None, {}, {}
    t0 = time.perf_counter()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with chat_stream(url, body, timeout=600, headers=headers) as (r, chunks):
        r.raise_for_status()
        for chunk in chunks:
            for c in chunk["choices"]:
                piece = choice_text(c, tool_arguments=True)
                if piece:
                    first = first or time.perf_counter()
                    last = time.perf_counter()
                    parts.append(piece)
                finish = c.get("finish_reason") or finish
            usage, spec = chunk.get("usage") or usage, chunk.get("speculation") or spec
    wall = time.perf_counter() - t0
    text = "".join(parts)
    valid = None
    if schema is not None:
        try:
            jsonschema.validate(json.loads(text), schema)
            valid = True
        except (ValueError, jsonschema.ValidationError):
            valid = None if finish == "length" else False  # cut short: not counted
    n = usage.get("completion_tokens", 0)
    return {"tokens": n, "wall_s": wall, "decode_s": (last - first) if first else 0.0,
            "text": text, "finish": finish, "valid": valid, "spec": spec}


def run_cluster(forced: bool, arms: list[tuple[str, str]], reps: int, tokens: int,
                temperature: float = 0.0) -> list:
    keys = [key_of(mode, method, rep) for mode, method in arms for rep in range(reps)]
    cluster = Cluster(ClusterConfig(gateway_port=free_port()), log=print,
                      env={"TANDEM_VERIFIER_FORCED_DRAFTS": "on" if forced else "off",
                           "TANDEM_API_KEYS": ",".join(keys)}, output=subprocess.DEVNULL)
    cluster.start()
    rows, url = [], cluster.gateway_url
    try:
        auth = {"Authorization": f"Bearer {keys[0]}"}
        model = httpx.get(f"{url}/v1/models", headers=auth).json()["data"][0]["id"]
        ask(url, model, "Say hi.", None, "none", 8, keys[0])  # warm up
        for rep in range(reps):
            for i, (prompt, schema) in enumerate(PROMPTS):
                k = (i + rep) % len(arms)
                sampling = {"temperature": temperature, "seed": 1000 * rep + i}
                for mode, method in arms[k:] + arms[:k]:
                    res = ask(url, model, prompt, schema if mode != "free" else None, method,
                              tokens, key_of(mode, method, rep), mode, sampling)
                    rows.append({"forced": forced, "rep": rep, "prompt": i, "mode": mode,
                                 "method": method, **res})
                    print(f"forced={forced} rep {rep} prompt {i} {mode}/{method}: "
                          f"{res['tokens']} tok {res['tokens'] / res['wall_s']:.1f} tok/s "
                          f"valid={res['valid']}", flush=True)
    finally:
        cluster.stop()
    return rows


def summarise(rows: list[dict]) -> dict:
    """tokens/s per (forced, mode, method) over all its asks; ratios to the same cluster's
    plain of the same mode; validity counts."""
    out: dict = {}
    for r in rows:
        key = f"{'forced' if r['forced'] else 'noforced'}/{r['mode']}/{r['method']}"
        a = out.setdefault(key, {"tokens": 0, "wall_s": 0.0, "decode_s": 0.0, "valid": 0,
                                 "invalid": 0, "drafted": 0, "accepted": 0, "asks": 0})
        a["tokens"] += r["tokens"]
        a["asks"] += 1
        a["wall_s"] += r["wall_s"]
        a["decode_s"] += r["decode_s"]
        a["valid"] += r["valid"] is True
        a["invalid"] += r["valid"] is False
        a["drafted"] += r["spec"].get("drafted_tokens", 0)
        a["accepted"] += r["spec"].get("accepted_tokens", 0)
    for a in out.values():
        a["tok_s"] = a["tokens"] / a["wall_s"]
        # decode: tokens after each answer's first, over first-to-last time
        a["decode_tok_s"] = (a["tokens"] - a["asks"]) / max(a["decode_s"], 1e-9)
    for key, a in out.items():
        base = out.get(key.rsplit("/", 1)[0] + "/none")
        a["vs_plain"] = a["tok_s"] / base["tok_s"]
        a["decode_vs_plain"] = a["decode_tok_s"] / base["decode_tok_s"]
    return out


def markdown(summary: dict, identical: dict) -> str:
    lines = ["| cluster | mode | method | tok/s | decode tok/s | vs plain (same mode), "
             "decode | accepted / drafted | valid / invalid | greedy text = plain |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key, a in sorted(summary.items()):
        forced, mode, method = key.split("/")
        acc = f"{a['accepted']} / {a['drafted']}" if a["drafted"] else "-"
        val = f"{a['valid']} / {a['invalid']}" if mode != "free" else "-"
        lines.append(f"| {forced} | {mode} | {method} | {a['tok_s']:.1f} | "
                     f"{a['decode_tok_s']:.1f} | {a['decode_vs_plain']:.2f}x | {acc} | {val} | "
                     f"{identical.get(key, '-')} |")
    return "\n".join(lines)


def identical_text(rows: list[dict]) -> dict:
    """Per arm: whether every answer equals plain's of the same mode, prompt and rep."""
    plain = {(r["forced"], r["mode"], r["prompt"], r["rep"]): r["text"] for r in rows
             if r["method"] == "none"}
    out: dict = {}
    for r in rows:
        key = f"{'forced' if r['forced'] else 'noforced'}/{r['mode']}/{r['method']}"
        same = plain[(r["forced"], r["mode"], r["prompt"], r["rep"])] == r["text"]
        out[key] = out.get(key, True) and same
    return {k: "yes" if v else "NO" for k, v in out.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=96, help="max new tokens per request")
    ap.add_argument("--reps", type=int, default=2, help="asks per prompt and arm")
    ap.add_argument("--arms", default="ngram,suffix,auto,draft_model",
                    help="methods beside plain, comma separated")
    ap.add_argument("--modes", default="free,json",
                    help="free, json (response_format) and/or tools (a required tool call)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="every arm samples at this temperature (seeded per prompt and rep)")
    ap.add_argument("--no-forced-off", action="store_true",
                    help="skip the second cluster (forced drafts off)")
    ap.add_argument("--out", default="results/structured.json")
    args = ap.parse_args(argv)
    methods = ["none", *[m for m in args.arms.split(",") if m]]
    modes = [m for m in args.modes.split(",") if m]
    arms = [(mode, m) for m in methods for mode in modes]
    rows = run_cluster(True, arms, args.reps, args.tokens, args.temperature)
    local = [("json", m) for m in methods if m in ("none", "ngram", "suffix", "auto")]
    if not args.no_forced_off:
        rows += run_cluster(False, local, args.reps, args.tokens, args.temperature)
    summary = summarise(rows)
    same = identical_text(rows) if args.temperature == 0 else {}
    table = markdown(summary, same)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "tokens": args.tokens,
                               "reps": args.reps, "temperature": args.temperature,
                               "summary": summary, "rows": rows,
                               "table": table}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
