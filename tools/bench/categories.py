"""Short answers by category through the gateway: plain decoding against ngram, suffix and
auto (issue 49: never slower than plain; the copy win on short answers too).

  tandem bench --workload categories [--first-reps 2] [--max-tokens 192] [--arms ngram,suffix,auto]
  python -m tools.bench.categories [--passes 2] [--tokens 192] [--out results/categories.json]

One local cluster (the default: a verifier drafting ngram and suffix in its own step, a draft
worker for auto's model drafts, the gateway), the cross-request suffix cache off
(--suffix-cache-tokens 0) and the verifier's prefix cache off, so every ask is a first ask
and pays its own prefill. Every prompt of tools/bench/category_prompts.py is asked once per
arm per pass, the arms' order rotating prompt by prompt and pass by pass (drift and the
host's noise hit all alike); greedy, or seeded sampling for the chat T=0.7 category.
Speed is completion tokens over the request's wall time (prefill included); each category's
ratio is an arm's total tokens/s over plain's on the same prompts in the same run.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import httpx

from tools.bench.category_prompts import CATEGORIES, COPY_HEAVY, TASKS
from tools.bench.copy_heavy import ask, key_of, served_model
from tools.bench.copy_report import copy_share
from tools.launcher import Cluster, ClusterConfig, free_port

ARMS = ("none", "ngram", "suffix", "auto")
SINGLE = ("ngram", "suffix")  # the single methods `auto` is held against


def _ask(url: str, prompt: str, arm: str, tokens: int, temp: float, name: str,
         tries: int = 3) -> dict:
    """One request; a 5xx (a worker restarting on a starved host) is asked again."""
    for i in range(tries):
        try:
            return ask(url, prompt, arm, tokens, temp, model=name)
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code < 500 or i == tries - 1:
                raise
            time.sleep(5.0)
    raise AssertionError("unreachable")


def run(passes: int = 2, tokens: int = 192, arms: tuple[str, ...] = ARMS,
        picks: tuple[int, ...] = (), log=print, save=None, dtype: str = "auto") -> list[dict]:
    """Every prompt (or those in picks) x arm x pass, rotated; the rows (save(rows) after
    each prompt, so a run cut short keeps what it measured)."""
    env = {"TANDEM_VERIFIER_SUFFIX_CACHE_TOKENS": "0",
           "TANDEM_VERIFIER_ENABLE_PREFIX_CACHING": "false",
           "TANDEM_API_KEYS": ",".join(key_of(a) for a in arms)}
    cluster = Cluster(ClusterConfig(gateway_port=free_port(), dtype=dtype), log=log, env=env,
                      output=subprocess.DEVNULL)
    cluster.start()
    rows: list[dict] = []
    try:
        url = cluster.gateway_url
        name = served_model(url)
        ask(url, "Say hi.", "none", 8, model=name)  # warm up
        for p in range(passes):
            for i, (category, prompt, temp) in enumerate(TASKS):
                if picks and i not in picks:
                    continue
                k = (i + p) % len(arms)
                for arm in arms[k:] + arms[:k]:
                    res = _ask(url, prompt, arm, tokens, temp, name)
                    rows.append({"pass": p, "prompt": i, "category": category, "arm": arm,
                                 "temperature": temp, **res})
                    log(f"pass {p} prompt {i} ({category}) {arm}: {res['tokens']} tokens "
                        f"{res['tokens'] / res['wall_s']:.1f} tok/s accepted "
                        f"{res['spec'].get('accepted_tokens')}/"
                        f"{res['spec'].get('drafted_tokens')} in {res['spec'].get('rounds')} "
                        f"rounds")
                if save is not None:
                    save(rows)
    finally:
        cluster.stop()
    return rows


def _tps(rows: list[dict]) -> float:
    wall = sum(r["wall_s"] for r in rows)
    return sum(r["tokens"] for r in rows) / wall if wall else 0.0


def ratios(rows: list[dict]) -> dict[str, dict[str, float]]:
    """{group: {arm: tokens/s over plain's}} for each category, and 'copy-heavy (all)' over
    the four edit categories together."""
    groups = {c: [r for r in rows if r["category"] == c] for c in CATEGORIES}
    groups["copy-heavy (all)"] = [r for r in rows if r["category"] in COPY_HEAVY]
    out = {}
    for group, sel in groups.items():
        plain = _tps([r for r in sel if r["arm"] == "none"])
        if not sel or not plain:
            continue
        arms = dict.fromkeys(r["arm"] for r in sel)
        out[group] = {a: _tps([r for r in sel if r["arm"] == a]) / plain for a in arms}
    return out


def markdown(rows: list[dict]) -> str:
    """The table: every category x arm as a ratio to plain; auto over the best single."""
    table = ratios(rows)
    arms = [a for a in ARMS if any(a in v for v in table.values())]
    lines = ["| category | answer tokens | copy share | " + " | ".join(arms)
             + " | best single | auto / best |", "|---" * (len(arms) + 5) + "|"]
    for group, by_arm in table.items():
        sel = [r for r in rows if r["arm"] == "none" and (
            r["category"] == group or group == "copy-heavy (all)" and r["category"] in COPY_HEAVY)]
        mean_tokens = sum(r["tokens"] for r in sel) / len(sel)
        share = sum(copy_share(r["text"], TASKS[r["prompt"]][1]) for r in sel) / len(sel)
        singles = {a: by_arm[a] for a in SINGLE if a in by_arm}
        best = max(singles, key=singles.get) if singles else None
        cells = [f"{by_arm[a]:.2f}x" if a in by_arm else "-" for a in arms]
        tail = (f"{best} {singles[best]:.2f}x | "
                + (f"{by_arm['auto'] / singles[best]:.2f}" if "auto" in by_arm else "-")
                if best else "- | -")
        lines.append(f"| {group} | {mean_tokens:.0f} | {share:.2f} | " + " | ".join(cells)
                     + f" | {tail} |")
    same = all(r["text"] == _plain_text(rows, r) for r in rows if r["temperature"] == 0)
    lines.append(f"\nGreedy answers identical to plain across arms: {same}.")
    return "\n".join(lines)


def _plain_text(rows: list[dict], row: dict) -> str:
    return next(r["text"] for r in rows if r["arm"] == "none" and r["prompt"] == row["prompt"]
                and r["pass"] == row["pass"])


def run_workload(passes: int, tokens: int, out: Path, arms: tuple[str, ...] = (),
                 picks: tuple[int, ...] = (), dtype: str = "auto") -> str:
    arms = ("none", *[a for a in (arms or ARMS) if a != "none"])
    started = time.strftime("%Y-%m-%d %H:%M")
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(rows: list[dict]) -> None:
        out.write_text(json.dumps({"date": started, "tokens": tokens, "passes": passes,
                                   "arms": arms, "dtype": dtype, "rows": rows}, indent=2))

    rows = run(passes, tokens, arms, picks, save=save, dtype=dtype)
    save(rows)
    table = markdown(rows)
    print(table)
    print(f"wrote {out}")
    return table


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passes", type=int, default=2, help="asks per prompt and arm")
    ap.add_argument("--tokens", type=int, default=192, help="max new tokens per request")
    ap.add_argument("--arms", default="", help="methods beside plain (default ngram,suffix,auto)")
    ap.add_argument("--prompts", default="", help="only these indices into TASKS")
    ap.add_argument("--out", default="results/categories.json")
    ap.add_argument("--report", default="", help="only print the table of a saved run")
    ap.add_argument("--dtype", default="auto", help="the cluster's --dtype (auto, int8-bf16, ...)")
    args = ap.parse_args(argv)
    if args.report:
        print(markdown(json.loads(Path(args.report).read_text())["rows"]))
        return
    run_workload(args.passes, args.tokens, Path(args.out),
                 tuple(a for a in args.arms.split(",") if a),
                 tuple(int(i) for i in args.prompts.split(",") if i), args.dtype)


if __name__ == "__main__":
    main()
