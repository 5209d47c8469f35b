"""Predicted Outputs against plain and suffix decoding on code edits, through a running gateway.

    python -m tools.bench.predicted --url http://127.0.0.1:8131 [--max-tokens 320] \\
        [--repeats 2] [--out result.json]

Workload: three edits of one ~190-line Python file (tools/bench/predicted_file.txt, a
snapshot of gateway/routing.py with one typo put in): rename a variable, add a docstring, fix
the typo; the model is asked for the whole edited file. As a completion (/v1/completions):
the original file, the edit asked for, and the edited file's first words, which the model
goes on from; the default model (SmolLM2-135M-Instruct) answers the same ask as a chat with
prose about the code rather than the file. Systems, interleaved per request (the order
rotated each time, so host drift and any prefix caching hit every system alike):

    plain               speculation.method none
    suffix              suffix decoding (over the prompt, which holds the file; start the
                        verifier with TANDEM_VERIFIER_SUFFIX_CACHE_TOKENS=0, or its cache
                        of earlier answers copies plain's answer to the same prompt)
    prediction          method none + prediction = the file as sent (the prediction alone)
    auto + prediction   auto (suffix, ngram) with the prediction as one more proposal

Each request is one non-streamed completion at temperature 0: wall time includes the
prefill. Every system's text must equal plain's for the same edit (lossless); the prediction
systems report usage.completion_tokens_details.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import httpx

FILE = Path(__file__).with_name("predicted_file.txt")
PATH = "/v1/completions"
TASKS = {
    "rename": "the variable `candidates` renamed to `options` everywhere",
    "docstring": "a one-line docstring added to the function `affinity_key`",
    "typo": "the spelling mistake in the module docstring fixed",
}
START = '"""Which verifier'  # the edited file's first words, in the prompt
SYSTEMS = {  # name: (method, with the prediction)
    "plain": ("none", False), "suffix": ("suffix", False),
    "prediction": ("none", True), "auto + prediction": ("auto", True)}


def body(task: str, system: str, source: str, max_tokens: int) -> dict:
    method, predicted = SYSTEMS[system]
    prompt = (f"Original file:\n```python\n{source}```\n\n"
              f"Edited file ({TASKS[task]}):\n```python\n{START}")
    req = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
           "speculation": {"method": method}}
    if predicted:
        req["prediction"] = {"type": "content", "content": source}
    return req


def run(url: str, max_tokens: int, repeats: int, timeout: float = 600.0) -> list[dict]:
    """Every (repeat, task, system) request, in order; each row its figures."""
    source = FILE.read_text()
    rows, names = [], list(SYSTEMS)
    with httpx.Client(base_url=url, timeout=timeout) as client:
        client.post(PATH, json={"prompt": "Say hello.", "max_tokens": 4})  # warm-up
        turn = 0
        for rep in range(repeats):
            for task in TASKS:
                order = names[turn % len(names):] + names[:turn % len(names)]
                turn += 1
                for system in order:
                    rows.append(_one(client, rep, task, system,
                                     body(task, system, source, max_tokens)))
                    print(_line(rows[-1]), flush=True)
    _check_lossless(rows)
    return rows


def _one(client: httpx.Client, rep: int, task: str, system: str, req: dict) -> dict:
    start = time.perf_counter()
    r = client.post(PATH, json=req)
    wall = time.perf_counter() - start
    r.raise_for_status()
    out = r.json()
    usage, spec = out["usage"], out["speculation"]
    details = usage.get("completion_tokens_details") or {}
    return {"repeat": rep, "task": task, "system": system, "wall_s": wall,
            "prompt_tokens": usage["prompt_tokens"],
            "completion_tokens": usage["completion_tokens"],
            "rounds": spec["rounds"], "drafted": spec["drafted_tokens"],
            "accepted": spec["accepted_tokens"],
            "accepted_prediction": details.get("accepted_prediction_tokens"),
            "rejected_prediction": details.get("rejected_prediction_tokens"),
            "text": out["choices"][0]["text"]}


def _line(row: dict) -> str:
    pred = "" if row["accepted_prediction"] is None else (
        f" prediction +{row['accepted_prediction']}/-{row['rejected_prediction']}")
    return (f"{row['repeat']} {row['task']:9} {row['system']:17} {row['wall_s']:6.2f} s "
            f"{row['completion_tokens']:4} tok {row['rounds']:4} rounds{pred}")


def _check_lossless(rows: list[dict]) -> None:
    """Each row's `same_as_plain`: its text equals plain's for the same repeat and task."""
    plain = {(r["repeat"], r["task"]): r["text"] for r in rows if r["system"] == "plain"}
    for r in rows:
        r["same_as_plain"] = r["text"] == plain.get((r["repeat"], r["task"]))


def summary(rows: list[dict]) -> str:
    """A markdown table per system: total wall time, tokens/s, speed-up over plain, rounds
    per token, prediction tokens accepted / rejected, texts equal to plain."""
    plain_s = sum(r["wall_s"] for r in rows if r["system"] == "plain")
    lines = ["| system | wall s (sum) | tokens | tokens/s | vs plain | tokens/round | "
             "prediction accepted | rejected | text = plain |", "|---" * 9 + "|"]
    for system in SYSTEMS:
        mine = [r for r in rows if r["system"] == system]
        wall = sum(r["wall_s"] for r in mine)
        toks = sum(r["completion_tokens"] for r in mine)
        rounds = sum(r["rounds"] for r in mine)
        acc = [r["accepted_prediction"] for r in mine if r["accepted_prediction"] is not None]
        rej = [r["rejected_prediction"] for r in mine if r["rejected_prediction"] is not None]
        same = sum(r["same_as_plain"] for r in mine)
        lines.append(f"| {system} | {wall:.1f} | {toks} | {toks / wall:.1f} | "
                     f"{plain_s / wall:.2f}x | {toks / max(1, rounds):.2f} | "
                     f"{sum(acc) if acc else '-'} | {sum(rej) if rej else '-'} | "
                     f"{same}/{len(mine)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8131")
    ap.add_argument("--max-tokens", type=int, default=320)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="the rows as JSON")
    args = ap.parse_args(argv)
    rows = run(args.url, args.max_tokens, args.repeats)
    print(summary(rows))
    if args.out is not None:
        args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                        "args": {k: str(v) for k, v in vars(args).items()},
                                        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
